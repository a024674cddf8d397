"""The decode half of the vLLM plugin (:mod:`eldr.capture.vllm_plugin` wires it).

Engine-core process (the scheduler):

- :func:`absorb_decode`: the worker's per-step :class:`~eldr.capture.decode.DecodeStep`
  list (attribute ``eldr_decode`` of the ``ModelRunnerOutput``) feeds the engine's
  :class:`~eldr.capture.decode.Footprint` (every decode row of every batch) and the
  :class:`~eldr.capture.decode.DecodeTally` of each decode leg (``kv_transfer_params``
  naming ``do_remote_prefill``) or, with ``ELDR_CAPTURE=all``, of every request.
- :func:`attach_decode`: when such a request finishes, its payload goes under
  :data:`~eldr.capture.decode.DECODE_KEY` of its final output's ``kv_transfer_params``
  (created, and marked ``own``, when the connector returned none). vLLM's completion
  and chat servers copy ``kv_transfer_params`` into a non-streaming response.
- the footprint is written, at most every :data:`FOOTPRINT_PERIOD` seconds, atomically to
  a small JSON file (``ELDR_FOOTPRINT_FILE``, default
  ``<tmp>/eldr-footprint-<API server pid>.json``: the engine core is the API server's
  child process).

API-server process:

- streams: vLLM puts ``kv_transfer_params`` into no stream chunk, so the completion and
  chat stream generators are wrapped: the wrapper taps the engine's ``RequestOutput``\\ s
  on their way in and, just before ``data: [DONE]``, sends one extra event
  ``data: {"eldr_decode": <payload>}`` when a payload came (only decode legs get one).
  No new connection, no round trip, no state kept after the stream: the cheapest
  channel. The router strips that event (:mod:`eldr.proxy.request.decodepayload`).
- ``/metrics``: a ``prometheus_client`` collector on the default registry (vLLM's,
  unless ``PROMETHEUS_MULTIPROC_DIR`` is set) reads the footprint file on each scrape:
  ``eldr_engine_footprint_experts{layer}``, ``eldr_engine_step_distinct_experts`` and
  ``eldr_engine_footprint_steps`` (docs/capture.md).
- step timings (docs/capture.md#step-timings): each timed decode step goes into a
  :class:`~eldr.capture.decode.StepRing`, written every :data:`STEPS_PERIOD` seconds (and
  when the engine runs out of requests) to ``<footprint file>.steps.json``; the collector
  adds ``eldr_engine_step_seconds`` (histogram) and step token / distinct-expert counters,
  and ``GET /eldr/steps`` serves the ring for ``eldr calibrate``.
- ``GET /eldr/footprint``: the per-(layer, expert) footprint of that file, compact
  (:func:`eldr.capture.decode.encode_engine_footprint`: one base-91 character per cell,
  not 6k gauges), for router replicas to route on (``eldr serve --engine-footprint``).
  vLLM 0.32 adds routes through ``vllm.endpoint_plugins`` entry points that must be named
  in ``VLLM_PLUGINS``, which would also gate every general plugin; so this plugin appends
  its endpoint object to what ``vllm.plugins.load_endpoint_plugins`` returns (vLLM calls
  it while building the app, after loading general plugins). ``ELDR_FOOTPRINT_ROUTE=0``
  leaves the app alone.
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import os
import tempfile
import time
from functools import wraps

from eldr.capture.decode import (
    DECODE_KEY,
    DecodeTally,
    Footprint,
    StepRing,
    encode_decode_payload,
    encode_engine_footprint,
    is_decode_leg,
)

__all__ = ["FOOTPRINT_PERIOD", "FOOTPRINT_ROUTE", "STEPS_PERIOD", "STEPS_ROUTE",
           "FootprintEndpoint", "absorb_decode", "attach_decode", "flush_steps",
           "footprint_path", "install_api_server_hooks", "read_footprint", "read_steps",
           "steps_path"]

logger = logging.getLogger("vllm.eldr_capture")
FOOTPRINT_PERIOD = 0.2  # seconds between writes of the footprint file
_WINDOW = int(os.environ.get("ELDR_FOOTPRINT_WINDOW", "32"))  # steps in the footprint
_PATCHED = "_eldr_decode_patched"
FOOTPRINT_ROUTE = "/eldr/footprint"
STEPS_ROUTE = "/eldr/steps"
STEPS_PERIOD = 1.0  # seconds between writes of the step-timing file (≈ 75 kB when full)
_STEPS_CAPACITY = 4096  # timed decode steps kept for eldr calibrate


def footprint_path(server_pid: int | None = None) -> str:
    """The footprint file of the API server ``server_pid`` (default: this process)."""
    explicit = os.environ.get("ELDR_FOOTPRINT_FILE")
    if explicit:
        return explicit
    pid = os.getpid() if server_pid is None else server_pid
    return os.path.join(tempfile.gettempdir(), f"eldr-footprint-{pid}.json")


def steps_path(server_pid: int | None = None) -> str:
    """The step-timing file next to the footprint file (``….json`` → ``….steps.json``): a
    file of its own, written 5x less often, because it is 10x the footprint's size."""
    base = footprint_path(server_pid)
    return (base[:-5] if base.endswith(".json") else base) + ".steps.json"


# -- engine core -------------------------------------------------------------------------------
def absorb_decode(sched, steps: list) -> None:
    """Add one engine step's decode rows to the footprint and to each wanted request."""
    if not steps:
        return
    d = sched.__dict__
    tallies: dict = d.setdefault("_eldr_dec", {})
    everything = os.environ.get("ELDR_CAPTURE") == "all"
    _, L, _ = steps[0].ids.shape
    fp = d.get("_eldr_footprint")
    if fp is None:
        E = int(sched.vllm_config.model_config.get_num_experts())
        fp = d["_eldr_footprint"] = Footprint(max(_WINDOW, 1), L, E)
        d["_eldr_fp_written"] = 0.0
        d["_eldr_steps"] = StepRing(_STEPS_CAPACITY)
        d["_eldr_steps_written"] = (0.0, 0)  # (monotonic time, ring count) of the last write
        atexit.register(_remove_footprint, footprint_path(os.getppid()))
        atexit.register(_remove_footprint, steps_path(os.getppid()))
    ring: StepRing = d["_eldr_steps"]
    for step in steps:
        fp.push(step.ids)
        if step.wall_s is not None:
            ring.push(step.wall_s, step.num_tokens, step.distinct_sum, step.is_mixed)
        for i, req_id in enumerate(step.req_ids):
            tally = tallies.get(req_id)
            if tally is None:
                request = sched.requests.get(req_id)
                if request is None:
                    continue
                if not (everything or is_decode_leg(request.kv_transfer_params)):
                    tallies[req_id] = False  # not ours to report: remembered, skipped
                    continue
                tally = tallies[req_id] = DecodeTally(L, fp.used.shape[2])
            elif tally is False:
                continue
            tally.add(step.ids[step.owner == i], step.distinct, step.wall_s)
    now = time.monotonic()
    if now - d["_eldr_fp_written"] >= FOOTPRINT_PERIOD:
        d["_eldr_fp_written"] = now
        _write_footprint(fp)
    if now - d["_eldr_steps_written"][0] >= STEPS_PERIOD:
        flush_steps(sched)


def flush_steps(sched) -> None:
    """Write the step-timing file now if the ring changed since the last write (called
    every :data:`STEPS_PERIOD` and when the engine runs out of requests, so an idle
    engine's file holds its last step)."""
    d = sched.__dict__
    ring: StepRing | None = d.get("_eldr_steps")
    if ring is None or d["_eldr_steps_written"][1] == ring.count:
        return
    d["_eldr_steps_written"] = (time.monotonic(), ring.count)
    L, E = d["_eldr_footprint"].used.shape[1:]
    _write_json(steps_path(os.getppid()), ring.snapshot(L, E, time.time()))


def _write_footprint(fp: Footprint) -> None:
    path = footprint_path(os.getppid())
    now = time.time()
    doc = {**fp.snapshot(), "time": now, "window": int(fp.used.shape[0]),
           "cells": encode_engine_footprint(fp, now)}
    _write_json(path, doc)


def _write_json(path: str, doc: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(doc, fh, separators=(",", ":"))
        os.replace(tmp, path)  # readers see the old file or the new one, never half
    except OSError as exc:
        logger.warning("eldr capture plugin: %s not written: %s", path, exc)


def attach_decode(sched, outputs) -> None:
    """Put each finished decode leg's payload into its final output."""
    tallies: dict | None = sched.__dict__.get("_eldr_dec")
    if not tallies:
        return
    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            if out.finish_reason is None:
                continue
            tally = tallies.pop(out.request_id, None)
            if not tally:
                continue
            own = out.kv_transfer_params is None
            params = dict(out.kv_transfer_params or {})
            params[DECODE_KEY] = encode_decode_payload(tally, own=own)
            out.kv_transfer_params = params
    if len(tallies) > 2 * len(sched.requests) + 64:  # aborted requests leave entries
        for req_id in [r for r in tallies if r not in sched.requests]:
            del tallies[req_id]


# -- API server --------------------------------------------------------------------------------
def install_api_server_hooks() -> None:
    """Wrap the stream generators and register the footprint collector (idempotent;
    harmless in processes that serve no HTTP)."""
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except Exception as exc:  # another layout: JSON answers still carry the payload
        logger.info("eldr capture plugin: stream hooks not installed (%s)", exc)
    else:
        _wrap_stream(OpenAIServingCompletion, "completion_stream_generator")
        _wrap_stream(OpenAIServingChat, "chat_completion_stream_generator")
    _register_collector()
    if os.environ.get("ELDR_FOOTPRINT_ROUTE", "1") != "0":
        _add_endpoint()


def _payload_of(item) -> dict | None:
    out = item[1] if isinstance(item, tuple) and len(item) == 2 else item
    params = getattr(out, "kv_transfer_params", None)
    return params.get(DECODE_KEY) if isinstance(params, dict) else None


def _wrap_stream(cls, name: str) -> None:
    original = getattr(cls, name)
    if getattr(original, _PATCHED, False):
        return
    signature = inspect.signature(original)

    @wraps(original)
    async def stream(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        found: list[dict] = []
        source = bound.arguments.get("result_generator")
        if source is not None:
            async def tap(source=source):
                async for item in source:
                    payload = _payload_of(item)
                    if payload is not None:
                        found.append(payload)
                    yield item
            bound.arguments["result_generator"] = tap()
        async for chunk in original(*bound.args, **bound.kwargs):
            if found and isinstance(chunk, str) and chunk.startswith("data: [DONE]"):
                for payload in found:
                    yield "data: " + json.dumps({DECODE_KEY: payload},
                                                separators=(",", ":")) + "\n\n"
                found.clear()
            yield chunk

    setattr(stream, _PATCHED, True)
    setattr(cls, name, stream)


_COLLECTOR = []  # the one registered collector of this process


class _FootprintCollector:
    """Reads this API server's engine footprint file on each scrape."""

    def describe(self):
        return []  # no values read at registration

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        try:
            with open(footprint_path()) as fh:
                doc = json.load(fh)
            experts = [float(x) for x in doc["experts"]]
            mean = float(doc["step_distinct_mean"])
            steps = float(doc["steps"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # no decode step yet, or not a decode engine
        per = GaugeMetricFamily("eldr_engine_footprint_experts", "Experts used per MoE layer "
                                "by this engine's decode batches over its last W steps.",
                                labels=["layer"])
        for layer, value in enumerate(experts):
            per.add_metric([str(layer)], value)
        yield per
        yield GaugeMetricFamily("eldr_engine_step_distinct_experts", "Mean distinct experts "
                                "per MoE layer per decode step over the last W steps.",
                                value=mean)
        yield GaugeMetricFamily("eldr_engine_footprint_steps",
                                "Decode steps in the footprint window.", value=steps)
        yield from _step_metrics()


def _step_metrics():
    """Lifetime step-timing metrics from the step-timing file: enough to fit the step model
    from scrapes alone (per interval: Δseconds = t0·Δsteps + b·Δdistinct + c·Δtokens)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    doc = read_steps()
    total = doc.get("total") if doc else None
    try:
        buckets = [(str(le), float(n)) for le, n in total["buckets"]]
        values = {k: float(total[k]) for k in ("steps", "seconds", "tokens", "distinct_sum",
                                               "mixed")}
    except (TypeError, KeyError, ValueError):
        return
    yield HistogramMetricFamily("eldr_engine_step_seconds", "Model-runner seconds per decode "
                                "step (execute_model + sample_tokens; mixed steps included).",
                                buckets=buckets, sum_value=values["seconds"])
    yield CounterMetricFamily("eldr_engine_step_tokens", "Tokens (rows) of the timed decode "
                              "steps, prompt rows of mixed steps included.",
                              value=values["tokens"])
    yield CounterMetricFamily("eldr_engine_step_distinct_experts_sum", "Sum over timed "
                              "decode steps of the distinct experts summed over MoE layers.",
                              value=values["distinct_sum"])
    yield CounterMetricFamily("eldr_engine_step_mixed", "Timed decode steps that also ran "
                              "prompt rows (left out of eldr calibrate's fit).",
                              value=values["mixed"])


def _register_collector() -> None:
    if _COLLECTOR:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    collector = _FootprintCollector()
    try:
        REGISTRY.register(collector)
    except ValueError:  # already registered by an earlier load of this module
        return
    _COLLECTOR.append(collector)
    atexit.register(_remove_footprint, footprint_path())  # this server's files, if any
    atexit.register(_remove_footprint, steps_path())


def read_footprint(path: str | None = None) -> dict | None:
    """The compact per-cell footprint of this API server's engine (the file's ``cells``),
    or None: no decode step yet, not a decode engine, or an unreadable file."""
    try:
        with open(path or footprint_path()) as fh:
            cells = json.load(fh).get("cells")
    except (OSError, ValueError, AttributeError):
        return None
    return cells if isinstance(cells, dict) else None


def read_steps(path: str | None = None) -> dict | None:
    """The step-timing document of this API server's engine
    (:meth:`eldr.capture.decode.StepRing.snapshot`), or None: no timed decode step yet,
    or an unreadable file."""
    try:
        with open(path or steps_path()) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class FootprintEndpoint:
    """vLLM endpoint plugin (``EndpointPlugin`` protocol): ``GET /eldr/footprint`` and
    ``GET /eldr/steps``."""

    name = "eldr_footprint"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        from fastapi.responses import JSONResponse, Response

        async def footprint():
            cells = read_footprint()
            if cells is None:  # 404, like any route a plain engine lacks
                return JSONResponse({"error": "no decode footprint yet"}, status_code=404)
            # its age on the engine's own clock: the router's may be skewed
            at = cells.get("time")
            if isinstance(at, (int, float)):
                cells["age"] = max(0.0, time.time() - float(at))
            body = json.dumps(cells, separators=(",", ":"))
            return Response(body, media_type="application/json",
                            headers={"Cache-Control": "no-store"})

        async def steps():
            path = steps_path()
            try:  # served as written: the file is already compact JSON
                with open(path, "rb") as fh:
                    body = fh.read()
            except OSError:
                # 404 as a plain engine answers, with a key saying the plugin is there
                return JSONResponse({"error": "no timed decode step yet", "eldr_steps": 0},
                                    status_code=404)
            return Response(body, media_type="application/json",
                            headers={"Cache-Control": "no-store"})

        app.add_api_route(FOOTPRINT_ROUTE, footprint, methods=["GET"],
                          include_in_schema=False)
        app.add_api_route(STEPS_ROUTE, steps, methods=["GET"], include_in_schema=False)

    async def init_state(self, engine_client, state, args) -> None:
        """Nothing to set up: the route reads the engine core's file."""


def _add_endpoint() -> None:
    try:
        import vllm.plugins as plugins
    except ImportError:
        return
    original = getattr(plugins, "load_endpoint_plugins", None)
    if original is None or getattr(original, _PATCHED, False):
        if original is None:
            logger.info("eldr capture plugin: no endpoint plugins in this vLLM; "
                        "%s not served", FOOTPRINT_ROUTE)
        return

    @wraps(original)
    def load_endpoint_plugins(*args, **kwargs):
        found = list(original(*args, **kwargs))
        tasks = args[0] if args else kwargs.get("supported_tasks")
        wanted = set(tasks or ()) & set(FootprintEndpoint.required_tasks)
        if wanted and not any(getattr(p, "name", None) == FootprintEndpoint.name
                              for p in found):
            found.append(FootprintEndpoint())
        return found

    setattr(load_endpoint_plugins, _PATCHED, True)
    plugins.load_endpoint_plugins = load_endpoint_plugins


def _remove_footprint(path: str) -> None:
    try:
        os.remove(path)
    except OSError:  # none was written (not a decode engine), or already gone
        pass

