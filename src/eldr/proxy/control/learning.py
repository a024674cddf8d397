"""``eldr serve --learn DIR``: the router's side of learning from live traffic (docs/learn.md).

:class:`LiveLearning` wires a :class:`eldr.learn.controller.Learner` into a router with
one hook, :meth:`on_request_done`, called by the flow when a decode completes: it reads
the prompt's expert counts from the prefill response (the payload, or vLLM's
``routed_experts``), the decode counts when the engines sent them (optional), and gives
the learner a record and the request's signature under the running artifact (for drift).
An accepted artifact is swapped in with the router's own reload (``Router.reload(path)``),
so it is checked exactly like ``POST /admin/reload``. Learning metrics (``eldr_learn_*``)
are registered on the router's registry and every stage is logged under ``eldr.learn``.

With ``--workers N`` worker 0 has the :class:`LiveLearning`; the others have a
:class:`ForwardLearning`, which reads each completed request the same way
(:func:`read_parts`) and sends it to worker 0 through the parent (dropped, never waited
for, when the learner falls behind); worker 0's swaps reach every worker through the pool
journal (:mod:`eldr.proxy.workers.poollink`) with the learned artifact's path.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np

from eldr.learn.buffer import make_record
from eldr.learn.config import LearnConfig
from eldr.learn.controller import Learner, learned_artifact
from eldr.proxy.request.signatures import read_counts, split_kv_params

__all__ = ["ForwardLearning", "LiveLearning", "add_arguments", "config_from_args",
           "start_artifact"]

log = logging.getLogger("eldr.learn")

_SMALL_ANSWER = 32 * 1024  # answers whose usage is read back (bigger: length unknown)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--learn DIR`` and its settings (a group of ``eldr serve``'s options)."""
    g = p.add_argument_group("learning from live traffic (docs/learn.md)")
    g.add_argument("--learn", metavar="DIR", default=None,
                   help="collect completed requests into a calibration trace in DIR, fit an "
                        "artifact when enough are in, validate it and swap it in; refit on "
                        "drift. Survives restarts (DIR is reloaded)")
    g.add_argument("--learn-min-requests", type=int, default=500, metavar="N",
                   help="requests before the first fit, and new ones per refit (default 500)")
    g.add_argument("--learn-max-requests", type=int, default=4000, metavar="N",
                   help="requests kept in the buffer, oldest dropped (default 4000)")
    g.add_argument("--learn-holdout", type=float, default=0.25, metavar="F",
                   help="fraction of a fit's requests held out to validate it (default 0.25)")
    g.add_argument("--learn-drift-window", type=int, default=100, metavar="N",
                   help="requests per drift test (default 100)")
    g.add_argument("--learn-drift-alpha", type=float, default=0.01, metavar="A",
                   help="false-alarm level of one drift test (default 0.01)")
    g.add_argument("--learn-no-drift", dest="learn_drift", action="store_false",
                   help="never refit on drift (fit once)")
    g.add_argument("--learn-persist-interval", type=float, default=30.0, metavar="S",
                   help="seconds between writes of the buffer to DIR (default 30)")


def config_from_args(args: argparse.Namespace) -> LearnConfig | None:
    if getattr(args, "learn", None) is None:
        return None
    return LearnConfig(directory=args.learn, min_requests=args.learn_min_requests,
                       max_requests=args.learn_max_requests, holdout=args.learn_holdout,
                       drift=args.learn_drift, drift_window=args.learn_drift_window,
                       drift_alpha=args.learn_drift_alpha,
                       persist_interval=args.learn_persist_interval)


def start_artifact(config: LearnConfig | None) -> str | None:
    """The learned artifact a restarted router should start with (None: none saved)."""
    return None if config is None else learned_artifact(config.directory)


def _answer_tokens(resp) -> int | None:
    """``usage.completion_tokens`` of a small buffered JSON answer, else None (streams'
    lengths come with the engines' decode payload, when they send one)."""
    body = getattr(resp, "body", None)
    if not isinstance(body, (bytes, bytearray)) or len(body) > _SMALL_ANSWER:
        return None
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError, RecursionError):
        return None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


class LiveLearning:
    """A learner attached to ``router`` (``router.learner = LiveLearning(router, config)``)."""

    def __init__(self, router, config: LearnConfig, *, executor=None) -> None:
        self.router = router
        self.learner = Learner(config, worker_ids=lambda: tuple(router.state.worker_names),
                               current_artifact=lambda: router.config.artifact,
                               swap=self._swap, on_event=self._event, executor=executor)
        self._register(router.metrics.registry)

    def _register(self, reg) -> None:
        learner = self.learner
        buf = learner.buffer
        self.requests = reg.counter(
            "eldr_learn_requests_total",
            "Completed requests offered to the learn buffer, by result (collected, or why "
            "not).", ("result",))
        self.fits = reg.counter("eldr_learn_fits_total",
                                "Artifact fits by result (accepted, refused, failed).",
                                ("result",))
        self.swaps = reg.counter("eldr_learn_swaps_total", "Learned artifacts swapped in.")
        self.refusals = reg.counter("eldr_learn_refusals_total",
                                    "Candidate artifacts refused, by reason.", ("reason",))
        self.drifts = reg.counter("eldr_learn_drift_detections_total",
                                  "Drift declared, by signal.", ("signal",))
        self.requests.prime(("collected",))  # zero series, on the page before any event
        self.fits.prime(("accepted",), ("refused",), ("failed",))
        reg.gauge("eldr_learn_buffer_requests", "Requests in the learn buffer (all, and "
                  "those with decode counts).", ("kind",),
                  collect=lambda: {("all",): float(len(buf)),
                                   ("with_decode",): float(buf.num_with_decode)})
        reg.gauge("eldr_learn_drift_score", "Last drift test per signal (>= 1: past its "
                  "threshold).", ("signal",),
                  collect=lambda: {} if learner.detector is None else
                  {(s,): r.score for s, r in learner.detector.last_.items()})
        reg.gauge("eldr_learn_fit_running", "1 while a fit runs in the learner's process.",
                  collect=lambda: {(): float(learner.fit_task is not None
                                             and not learner.fit_task.done())})
        reg.gauge("eldr_learn_artifact_score", "Held-out score of the last accepted learned "
                  "artifact (expected distinct experts vs load balancing; lower is better).",
                  collect=self._artifact_score)

    def _artifact_score(self) -> dict:
        last = self.learner.state.get("last") or {}
        cand = last.get("candidate") if last.get("accepted") else None
        return {} if not cand else {(): float(cand["score"])}

    async def start(self) -> None:
        await self.learner.start()

    async def stop(self) -> None:
        await self.learner.stop()

    async def _swap(self, path: str) -> None:
        await self.router.reload(path)

    def on_pool_change(self, names: tuple[str, ...]) -> None:
        """A decoder was added or removed (:mod:`eldr.proxy.control.elastic`). Fits read the
        router's decoders when they start, so the next one is for ``names``; with an
        artifact running (fitted for the old set) a refit on the whole buffer is asked for
        now (:meth:`eldr.learn.controller.Learner.pool_changed`). A fit already running
        finishes for the old set, and the refit for ``names`` follows it."""
        learner = self.learner
        learner.pool_changed()
        if self.router.config.artifact is None:
            log.info("learn: decoders are now %s; the first fit will be for them",
                     list(names))
            return
        log.info("learn: decoders are now %s; refitting for them once %d requests are in",
                 list(names), learner.config.min_requests)

    # -- the hook ---------------------------------------------------------------------------
    def on_request_done(self, doc: dict, decoder: str, resp=None, decode=None) -> None:
        """A decode completed: ``doc`` is its prefill response, ``decoder`` the decoder's
        name, ``resp`` the client's answer (its usage, if small), ``decode`` the decode
        engine's report (:class:`eldr.capture.decode.DecodeReport`: ``counts`` (L, E),
        ``tokens`` decoded, ``steps`` and ``mean_distinct``; None when the decoder sent
        none). Never raises: learning must not fail a request."""
        try:
            result = self._collect(doc, decoder, resp, decode)
        except Exception:  # a bug of ours: logged, the request is unaffected
            log.exception("learn: recording a completed request failed")
            result = "error"
        self.requests.inc(result=result)

    def _collect(self, doc: dict, decoder: str, resp, decode) -> str:
        parts = read_parts(self.router, doc, decoder, resp, decode,
                           self.learner.buffer.shape)
        return parts if isinstance(parts, str) else self._record(parts)

    def on_forwarded(self, parts: dict) -> None:
        """A completed request another worker read (:class:`ForwardLearning`)."""
        try:
            parts = {**parts, "counts": np.asarray(parts["counts"], np.int64)}
            if parts["decode_counts"] is not None:
                parts["decode_counts"] = np.asarray(parts["decode_counts"], np.int64)
            result = self._record(parts)
        except Exception:  # a bug of ours or a garbled record: logged, nothing else
            log.exception("learn: recording a forwarded request failed")
            result = "error"
        self.requests.inc(result=result)

    def _record(self, p: dict) -> str:
        router, buf = self.router, self.learner.buffer
        counts, k, tokens = p["counts"], p["top_k"] or buf.top_k, p["tokens"]
        if k is None and tokens:
            total = int(counts[0].sum())
            k = total // tokens if total % tokens == 0 else None
        if not k:
            return "unknown_top_k"
        dec_counts, out = p["decode_counts"], p["output_tokens"]
        try:
            record = make_record(counts, top_k=k, decoder=p["decoder"], time=p["time"],
                                 tokens=tokens, decode_counts=dec_counts, output_tokens=out)
        except ValueError:
            if dec_counts is None:
                return "inconsistent"
            try:  # decode counts of another shape or top-k: the prompt's still count
                record = make_record(counts, top_k=k, decoder=p["decoder"], time=p["time"],
                                     tokens=tokens, output_tokens=out)
            except ValueError:
                return "inconsistent"
        if buf.top_k is None:
            buf.top_k = int(k)
            known = router.pool.models()
            buf.model = known[0] if known else "unknown"
        elif buf.top_k != k or (buf.shape is not None and buf.shape != counts.shape):
            return "other_model"
        state = router.state
        signature = None
        if state.encoder is not None and counts.shape == state.shape:
            signature = np.asarray(state.encode(counts), dtype=np.float64)
        self.learner.observe(record, signature)
        if p["steps"]:  # the engine-measured distinct experts per layer per step
            self.learner.observe_steps(p["decoder"], np.array([p["mean_distinct"]]))
        return "collected"

    # -- events → metrics and log -----------------------------------------------------------
    def _event(self, name: str, info: dict) -> None:
        if name == "fit_started":
            log.info("learn: fitting on %d requests (%s)", info["requests"], info["reason"])
        elif name == "fit_accepted":
            self.fits.inc(result="accepted")
            log.info("learn: candidate accepted after %.1f s in process %d: held-out score "
                     "%.4f (running %.4f), rho %s, sizes %s", info["seconds"], info["pid"],
                     info["candidate"]["score"], info["running"]["score"],
                     info["candidate"]["rho"], info["candidate"]["sizes"])
        elif name == "swapped":
            self.swaps.inc()
            log.info("learn: artifact %s swapped in", info["artifact"])
        elif name == "fit_refused":
            self.fits.inc(result="refused")
            for reason in info["reasons"]:
                self.refusals.inc(reason=reason.split(":", 1)[0])
            log.warning("learn: candidate refused, the running artifact stays: %s",
                        "; ".join(info["reasons"]))
        elif name == "fit_failed":
            self.fits.inc(result="failed")
            log.error("learn: fit failed (%s): %s", info["reason"], info["error"])
        elif name == "drift":
            for signal in info["signals"]:
                self.drifts.inc(signal=signal)
            log.warning("learn: drift detected (%s), refitting once enough new requests are "
                        "in", ", ".join(f"{s} score {v:.2f}" for s, v in info["scores"].items()))
        elif name == "drift_checked":
            log.debug("learn: drift test %s", [(r.signal, round(r.score, 3))
                                               for r in info["reports"]])
        elif name in ("collected", "started", "calibrated"):
            log.info("learn: %s %s", name, info)
        else:
            log.debug("learn: %s %s", name, info)


def read_parts(router, doc: dict, decoder: str, resp, decode, shape=None) -> dict | str:
    """What a completed request gives the learner (``counts`` (L, E), ``top_k`` or None,
    ``tokens``, ``decoder``, ``output_tokens``, ``decode_counts`` (L, E) or None,
    ``steps``, ``mean_distinct``, ``time``), or why nothing (``"no_counts"``). ``shape``:
    the (L, E) expected when the routing state has none (vLLM's ``routed_experts``)."""
    _, payload = split_kv_params(doc)
    want = None if payload is not None else (router.state.shape or shape)
    counts = read_counts(doc, payload, want)
    if counts.counts is None:
        return "no_counts"
    decoded = getattr(decode, "tokens", None)  # forward passes: generated tokens - 1
    steps = getattr(decode, "steps", 0) or 0
    return {"counts": counts.counts, "top_k": counts.top_k or router.state.top_k,
            "tokens": counts.tokens, "decoder": decoder,
            "output_tokens": _answer_tokens(resp) or
            (decoded + 1 if isinstance(decoded, int) else None),
            "decode_counts": getattr(decode, "counts", None), "steps": int(steps),
            "mean_distinct": float(decode.mean_distinct) if steps else None,
            "time": time.time()}


class ForwardLearning:
    """``router.learner`` of a worker that does not learn (``--workers N``, rows > 0): it
    reads each completed request like :class:`LiveLearning` and sends it to the learning
    worker through the parent (``send(msg)``: the worker's link, buffered, never waiting;
    the parent drops records when the learner falls behind)."""

    def __init__(self, router, send) -> None:
        self.router, self._send = router, send
        self.forwarded = router.metrics.registry.counter(
            "eldr_learn_forwarded_total", "Completed requests this worker sent to the "
            "learning worker (--workers N), by result (sent; dropped: the link to the "
            "parent was full or closed; or why the request was not collected).", ("result",))
        self.forwarded.prime(("sent",), ("dropped",))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def on_request_done(self, doc: dict, decoder: str, resp=None, decode=None) -> None:
        try:
            parts = read_parts(self.router, doc, decoder, resp, decode)
            if isinstance(parts, str):
                self.forwarded.inc(result=parts)
                return
            dec = parts["decode_counts"]
            parts.update(counts=np.asarray(parts["counts"]).tolist(),
                         decode_counts=None if dec is None else np.asarray(dec).tolist())
            sent = self._send({"op": "learn", "parts": parts})
            self.forwarded.inc(result="dropped" if sent is False else "sent")
        except Exception:  # learning must not fail a request
            log.exception("learn: forwarding a completed request failed")


def configure(config, args: argparse.Namespace):
    """(serve config, learn config or None) from ``eldr serve``'s arguments: with
    ``--learn DIR`` and no ``--artifact``, the router starts with the artifact it learned
    last in DIR (none: it starts without one, a policy that needs one, such as ``eldr``,
    running ``eldr_cost`` until the first learned artifact is swapped in)."""
    import dataclasses

    learn = config_from_args(args)
    if learn is not None and config.artifact is None:
        config = dataclasses.replace(config, artifact=start_artifact(learn), stand_in=True)
    return config, learn


def attach(router, learn: LearnConfig | None, row: int | None = None) -> None:
    """Give ``router`` a learner (nothing without ``--learn``). ``row``: the worker's row
    with ``--workers N``: worker 0 learns, the others forward to it (their link's
    ``send``, set up by :func:`attach_link`)."""
    if learn is None:
        return
    if row is None or row == 0:
        router.learner = LiveLearning(router, learn)
    else:
        router.learner = ForwardLearning(router, lambda msg: None)


def attach_link(router, link) -> None:
    """Connect a worker's learner to its pool link (``--workers N``): forwarded records
    reach worker 0's learner, the others' records leave through the link."""
    if isinstance(router.learner, LiveLearning):
        link.on_message = lambda msg: router.learner.on_forwarded(msg["parts"]) \
            if msg.get("op") == "learn" else None
    elif isinstance(router.learner, ForwardLearning):
        router.learner._send = lambda msg: link.send(msg, droppable=True)
