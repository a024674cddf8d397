"""``eldr serve --learn DIR``: the router's side of learning from live traffic (docs/learn.md).

:class:`LiveLearning` wires a :class:`eldr.learn.controller.Learner` into a router with
one hook, :meth:`on_request_done`, called by the flow when a decode completes: it reads
the prompt's expert counts from the prefill response (the payload, or vLLM's
``routed_experts``), the decode counts when the engines sent them (optional), and gives
the learner a record and the request's signature under the running artifact (for drift).
An accepted artifact is swapped in with the router's own reload (``reload(path)``: the
router's :meth:`~eldr.proxy.control.admin.Reloader.reload`), so it is checked exactly like
``POST /admin/reload``. Learning metrics (``eldr_learn_*``)
are registered on the router's registry and every stage is logged under ``eldr.learn``.

With ``--workers N`` worker 0 has the :class:`LiveLearning`; the others have a
:class:`ForwardLearning`, which reads each completed request the same way
(:func:`read_parts`) and sends it to worker 0 through the parent (dropped, never waited
for, when the learner falls behind); worker 0's swaps reach every worker through the pool
journal (:mod:`eldr.proxy.workers.poollink`) with the learned artifact's path.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from eldr.learn.buffer import make_record
from eldr.learn.config import LearnConfig
from eldr.learn.controller import Learner
from eldr.proxy.control.admin import JournalLink
from eldr.proxy.request import LiveRouting, RoutingState, read_counts, split_kv_params

if TYPE_CHECKING:
    from eldr.proxy.engines import UpstreamPool
    from eldr.proxy.metrics import Registry

__all__ = ["ForwardLearning", "LiveLearning", "read_parts"]

log = logging.getLogger("eldr.learn")

_SMALL_ANSWER = 32 * 1024  # answers whose usage is read back (bigger: length unknown)


def _tokenizer_identity(folder: str | None) -> tuple[str, int] | None:
    """(fingerprint, vocab size) of ``--tokenizer``'s folder for the learned prompt
    predictor, or None (no tokenizer given, or unreadable: logged; the predictor then knows
    the ids it has seen)."""
    if not folder:
        return None
    from eldr.fit.prompt import tokenizer_fingerprint, tokenizer_vocab_size

    try:
        return tokenizer_fingerprint(folder), tokenizer_vocab_size(folder)
    except ValueError as exc:
        log.warning("learn: the tokenizer in %s is not usable for the prompt predictor "
                    "(%s)", folder, exc)
        return None


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
    """The learner of one router (``Router.learn``): ``live`` is its routing snapshot (the
    decoders fits are for, the artifact running), ``pool`` its engines (the model's name),
    ``registry`` its metrics, ``reload(path)`` how an accepted artifact is swapped in."""

    def __init__(self, config: LearnConfig, *, live: LiveRouting, pool: UpstreamPool,
                 registry: Registry, reload: Callable[[str], Awaitable[RoutingState]],
                 executor=None) -> None:
        self.live, self.pool, self._reload = live, pool, reload
        self.learner = Learner(config, worker_ids=lambda: tuple(live.state.worker_names),
                               current_artifact=lambda: live.config.artifact,
                               swap=self._swap, on_event=self._event, executor=executor)
        self.learner.tokenizer = _tokenizer_identity(live.config.tokenizer)
        self._register(registry)

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
        await self._reload(path)

    def connect(self, link: JournalLink) -> None:
        """``--workers N``: the requests other workers forward reach this learner."""
        link.on_message = lambda msg: self.on_forwarded(msg["parts"]) \
            if msg.get("op") == "learn" else None

    def on_pool_change(self, names: tuple[str, ...]) -> None:
        """A decoder was added or removed (:mod:`eldr.proxy.control.elastic`). Fits read the
        router's decoders when they start, so the next one is for ``names``; with an
        artifact running (fitted for the old set) a refit on the whole buffer is asked for
        now (:meth:`eldr.learn.controller.Learner.pool_changed`). A fit already running
        finishes for the old set, and the refit for ``names`` follows it."""
        learner = self.learner
        learner.pool_changed()
        if self.live.config.artifact is None:
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
        parts = read_parts(self.live.state, doc, decoder, resp, decode,
                           self.learner.buffer.shape)
        return parts if isinstance(parts, str) else self._record(parts)

    def on_forwarded(self, parts: dict) -> None:
        """A completed request another worker read (:class:`ForwardLearning`)."""
        try:
            parts = {**parts, "counts": np.asarray(parts["counts"], np.int64)}
            if parts["decode_counts"] is not None:
                parts["decode_counts"] = np.asarray(parts["decode_counts"], np.int64)
            if parts.get("prompt_ids") is not None:
                parts["prompt_ids"] = np.asarray(parts["prompt_ids"], np.int64)
            result = self._record(parts)
        except Exception:  # a bug of ours or a garbled record: logged, nothing else
            log.exception("learn: recording a forwarded request failed")
            result = "error"
        self.requests.inc(result=result)

    def _record(self, p: dict) -> str:
        buf = self.learner.buffer
        counts, k, tokens = p["counts"], p["top_k"] or buf.top_k, p["tokens"]
        if k is None and tokens:
            total = int(counts[0].sum())
            k = total // tokens if total % tokens == 0 else None
        if not k:
            return "unknown_top_k"
        dec_counts, out = p["decode_counts"], p["output_tokens"]
        try:
            record = make_record(counts, top_k=k, decoder=p["decoder"], time=p["time"],
                                 tokens=tokens, decode_counts=dec_counts, output_tokens=out,
                                 prompt_ids=p.get("prompt_ids"))
        except ValueError:
            if dec_counts is None:
                return "inconsistent"
            try:  # decode counts of another shape or top-k: the prompt's still count
                record = make_record(counts, top_k=k, decoder=p["decoder"], time=p["time"],
                                     tokens=tokens, output_tokens=out,
                                     prompt_ids=p.get("prompt_ids"))
            except ValueError:
                return "inconsistent"
        if buf.top_k is None:
            buf.top_k = int(k)
            known = self.pool.models()
            buf.model = known[0] if known else "unknown"
        elif buf.top_k != k or (buf.shape is not None and buf.shape != counts.shape):
            return "other_model"
        state = self.live.state
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


def _prompt_tokens(doc: dict) -> int | None:
    """``usage.prompt_tokens`` of a prefill response, else None."""
    usage = doc.get("usage")
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


_MAX_PROMPT_IDS = 1 << 20  # longer id lists in a prefill answer are ignored, not learned


def _prompt_ids(doc: dict) -> np.ndarray | None:
    """The prompt's token ids a prefill answer carries when asked (vLLM's
    ``return_token_ids``: ``choices[0].prompt_token_ids`` for completions, top-level
    ``prompt_token_ids`` for chat), as (P,) int64; None when absent or not a list of
    non-negative ints."""
    ids = doc.get("prompt_token_ids")
    choices = doc.get("choices")
    if ids is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        ids = choices[0].get("prompt_token_ids")
    if not isinstance(ids, list) or not ids or len(ids) > _MAX_PROMPT_IDS:
        return None
    if not all(type(t) is int and 0 <= t < 1 << 31 for t in ids):
        return None
    return np.array(ids, dtype=np.int64)


def read_parts(state: RoutingState, doc: dict, decoder: str, resp, decode,
               shape=None) -> dict | str:
    """What a completed request gives the learner (``counts`` (L, E), ``top_k`` or None,
    ``tokens``, ``decoder``, ``output_tokens``, ``decode_counts`` (L, E) or None,
    ``steps``, ``mean_distinct``, ``time``), or why nothing (``"no_counts"``; ``"partial"``:
    the counts cover fewer tokens than the prompt has, because the prefill found the rest
    in a prefix cache or a KV connector loaded it. Such counts are a sample of the
    prompt's tail: routing may still use them (counted there), learning must not, or its
    fits and its drift reference mix whole prompts with tails). ``shape``:
    the (L, E) expected when the routing state has none (vLLM's ``routed_experts``)."""
    _, payload = split_kv_params(doc)
    want = None if payload is not None else (state.shape or shape)
    counts = read_counts(doc, payload, want)
    if counts.counts is None:
        return "no_counts"
    prompt = _prompt_tokens(doc)
    if counts.tokens is not None and prompt is not None and counts.tokens < prompt:
        return "partial"  # part of the prompt came from a cache: not what it routes like
    decoded = getattr(decode, "tokens", None)  # forward passes: generated tokens - 1
    steps = getattr(decode, "steps", 0) or 0
    return {"counts": counts.counts, "top_k": counts.top_k or state.top_k,
            "tokens": counts.tokens, "decoder": decoder,
            "output_tokens": _answer_tokens(resp) or
            (decoded + 1 if isinstance(decoded, int) else None),
            "decode_counts": getattr(decode, "counts", None), "steps": int(steps),
            "mean_distinct": float(decode.mean_distinct) if steps else None,
            "prompt_ids": _prompt_ids(doc),
            "time": time.time()}


class ForwardLearning:
    """The learner of a worker that does not learn (``--workers N``, rows > 0): it reads
    each completed request like :class:`LiveLearning` and sends it to the learning worker
    through the parent (the worker's link once :meth:`connect` gave it one: buffered, never
    waiting; the parent drops records when the learner falls behind)."""

    def __init__(self, live: LiveRouting, registry: Registry) -> None:
        self.live = live
        self._send: Callable[[dict], bool] = lambda msg: False  # no link yet: dropped
        self.forwarded = registry.counter(
            "eldr_learn_forwarded_total", "Completed requests this worker sent to the "
            "learning worker (--workers N), by result (sent; dropped: the link to the "
            "parent was full or closed; or why the request was not collected).", ("result",))
        self.forwarded.prime(("sent",), ("dropped",))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def connect(self, link: JournalLink) -> None:
        """``--workers N``: records leave through the worker's link to the parent."""
        self._send = lambda msg: link.send(msg, droppable=True)

    def on_request_done(self, doc: dict, decoder: str, resp=None, decode=None) -> None:
        try:
            parts = read_parts(self.live.state, doc, decoder, resp, decode)
            if isinstance(parts, str):
                self.forwarded.inc(result=parts)
                return
            dec, ids = parts["decode_counts"], parts["prompt_ids"]
            parts.update(counts=np.asarray(parts["counts"]).tolist(),
                         decode_counts=None if dec is None else np.asarray(dec).tolist(),
                         prompt_ids=None if ids is None else ids.tolist())
            sent = self._send({"op": "learn", "parts": parts})
            self.forwarded.inc(result="dropped" if sent is False else "sent")
        except Exception:  # learning must not fail a request
            log.exception("learn: forwarding a completed request failed")
