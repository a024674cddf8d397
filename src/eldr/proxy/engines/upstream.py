"""The engines behind the router: their health, their load, and the models they serve.

Health has two inputs. Active: every ``health_interval`` seconds each instance's
``GET /health`` is called; ``unhealthy_after`` consecutive failures take it out, one
success brings it back. Passive: a request that cannot even connect to an instance takes
it out at once (a refused connection is definitive), and other request failures count
like failed checks. Nothing is ever removed for good: a restarted engine is taken back by
the next successful check.

Request outcomes also drive a circuit breaker per decoder (:mod:`eldr.proxy.engines.breaker`):
health checks re-admit an instance, but a decoder whose breaker is open gets no request
until its back-off ends and a real request (the probe) succeeds there.

Load. The decode loads the routing policy sees live in one
:class:`eldr.routing.loads.LoadTracker`: +1 when the router dispatches a decode, −1 when it
ends. With ``scrape_interval > 0`` each decoder's own ``/metrics`` is also read and
``vllm:num_requests_running + vllm:num_requests_waiting`` replaces the tracked value
(``LoadTracker.report``), so several router replicas in front of the same engines see the
same loads instead of only their own share. The same round reads each decoder's own expert
footprint for the routing policy (:mod:`eldr.proxy.engines.footprints`, ``--engine-footprint``),
so the replicas' ``eldr_cost`` routes on the engines' whole batches, not its share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
from dataclasses import dataclass, field

import numpy as np

from eldr.proxy.bodies import json_object, read_upto
from eldr.proxy.config import ServeConfig
from eldr.proxy.engines.breaker import CircuitBreaker
from eldr.proxy.engines.footprints import FootprintReader
from eldr.proxy.metrics import parse_samples
from eldr.routing.loads import LoadTracker

__all__ = ["ENGINE_LOAD_METRICS", "Instance", "UpstreamPool", "error_kind", "make_session"]

log = logging.getLogger("eldr.serve")

ENGINE_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# the eldr plugin's live footprint of a decode engine (docs/capture.md), read when present
ENGINE_DISTINCT_METRIC = "eldr_engine_step_distinct_experts"
# bytes read of an engine's answers to the router's own calls (never the whole of a runaway)
_HEALTH_BODY_LIMIT = 64 * 1024
_MODELS_BODY_LIMIT = 1024 * 1024
_METRICS_BODY_LIMIT = 16 * 1024 * 1024
# vLLM's info gauge of its cache settings: vllm:cache_config_info{block_size="16",...} 1.0
_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}\n]*\bblock_size="(\d+)"', re.M)


@dataclass(slots=True, eq=False)
class Instance:
    """One engine the router sends requests to."""

    role: str  # "prefill" or "decode"
    index: int  # position in its pool: prefill i, or decode worker k
    url: str  # base URL, no trailing slash
    name: str  # label in metrics and /health: the artifact worker id, or "prefill-i"
    healthy: bool = True  # may receive requests now
    failures: int = 0  # consecutive failed checks or requests
    in_flight: int = 0  # requests of THIS router at the instance now
    last_error: str | None = None  # the most recent failure, for /health
    engine_load: float | None = None  # running + waiting from the engine's /metrics, if scraped
    models: tuple[str, ...] = field(default_factory=tuple)  # ids from its /v1/models
    max_model_len: int | None = None  # context length its /v1/models reports, if any
    breaker: CircuitBreaker | None = None  # request-outcome breaker (decoders), or None
    # mean distinct experts per layer per decode step over the engine's last steps: its own
    # live footprint (eldr plugin), scraped; the same for every router replica
    engine_distinct: float | None = None
    draining: bool = False  # being removed: no new request, its in-flight ones finish
    block_size: int | None = None  # tokens per KV block, from its /metrics (cache_config_info)
    deaths: int = 0  # times a probe found it dead right after a failed request
    dead: bool = False  # a probe found it dead, and no request or check succeeded since
    removed: bool = False  # out of the pool (a late health check or scrape is ignored)

    def describe(self) -> dict:
        doc = {"name": self.name, "url": self.url, "healthy": self.healthy,
               "in_flight": self.in_flight, "failures": self.failures,
               "engine_load": self.engine_load, "last_error": self.last_error}
        if self.breaker is not None:
            doc["breaker"] = self.breaker.state
        if self.role == "decode":
            doc["draining"] = self.draining
        return doc


def make_session(session):
    """The client the router talks to engines with:
    :class:`eldr.proxy.engines.client.UpstreamSession` over the aiohttp ``session`` (which
    serves what it does not), or the aiohttp session itself when ``httptools`` is not
    installed."""
    try:
        from eldr.proxy.engines.client import UpstreamSession
    except ModuleNotFoundError:
        return session
    return UpstreamSession(session)


def error_kind(exc: BaseException) -> str:
    """A short label for an upstream failure: the ``kind`` of the error metric."""
    import aiohttp

    client = sys.modules.get("eldr.proxy.engines.client")  # not loaded: none of its errors exist
    if client is not None and isinstance(exc, client.UpstreamConnectError):
        return "connect"
    if client is not None and isinstance(exc, client.UpstreamProtocolError):
        return "protocol"
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                        aiohttp.ClientOSError)):
        return "disconnect"
    if isinstance(exc, (ValueError, aiohttp.ContentTypeError)):
        return "protocol"
    return "other"


class UpstreamPool:
    """Prefill and decode instances, health checks, load scraping, served models."""

    def __init__(self, config: ServeConfig, decode_names: list[str], *,
                 tracker: LoadTracker | None = None) -> None:
        self.config = config
        self.prefill = [Instance("prefill", i, u, f"prefill-{i}")
                        for i, u in enumerate(config.prefill_urls)]
        self.decode = [self._decoder(k, u, decode_names[k])
                       for k, u in enumerate(config.decode_urls)]
        # decode loads + health, for policies (shared by the workers of --workers N: a
        # SharedLoadTracker given by the router's builder)
        self.tracker = LoadTracker(len(self.decode)) if tracker is None else tracker
        self.prefill_loads = np.zeros(len(self.prefill))  # (P,) in-flight prefills
        self.prefill_healthy = np.ones(len(self.prefill), dtype=bool)  # (P,)
        self.on_recover = None  # callback(instance) when an instance comes back
        # engine footprints for the policy; the router sets footprints.policy_of
        self.footprints = FootprintReader(config.scrape_interval, config.engine_footprint)
        self.session = None  # the HTTP client to the engines, from start() on
        # (L, E) the engines' prefill payloads declared last: the served model's
        # fingerprint (the request flow records it; an artifact reload must match it)
        self.engine_shape: tuple[int, int] | None = None
        self._tasks: list[asyncio.Task] = []
        self._probes: dict[Instance, asyncio.Future] = {}  # death checks in flight
        self._block_size: int | None = None  # smallest KV block the engines reported

    def _decoder(self, k: int, url: str, name: str, **kw) -> Instance:
        config = self.config
        return Instance("decode", k, url, name, breaker=CircuitBreaker(
            failures=config.breaker_failures, backoff=config.breaker_backoff,
            max_backoff=config.breaker_max_backoff), **kw)

    # -- the elastic pool (eldr.proxy.control.elastic) -------------------------------------------
    def add_decoder(self, url: str, name: str) -> Instance:
        """A new decoder at index K, out of rotation until its first health check passes
        (``healthy`` False here and in the tracker)."""
        k = self.tracker.add_worker()
        self.tracker.set_healthy(k, False)
        inst = self._decoder(k, url, name, healthy=False)
        self.decode.append(inst)
        return inst

    def remove_decoder(self, inst: Instance) -> int:
        """Take a (drained) decoder out; those after it move down one index. Returns the
        index it had."""
        k = inst.index
        self.tracker.remove_worker(k)
        del self.decode[k]
        for other in self.decode[k:]:
            other.index -= 1
        inst.removed = True
        return k

    # -- state changes -------------------------------------------------------------------
    def _set_healthy(self, inst: Instance, ok: bool) -> None:
        if inst.healthy == ok or inst.removed:
            return
        inst.healthy = ok
        if inst.role == "decode":
            self.tracker.set_healthy(inst.index, ok)
        else:
            self.prefill_healthy[inst.index] = ok
        log.warning("%s %s (%s) is %s%s", inst.role, inst.name, inst.url,
                    ("healthy again" if inst.last_error else "healthy") if ok else "unhealthy",
                    "" if ok else f": {inst.last_error}")
        if ok and self.on_recover is not None:
            self.on_recover(inst)

    def record_success(self, inst: Instance) -> None:
        inst.failures = 0
        inst.dead = False
        self._set_healthy(inst, True)

    def record_failure(self, inst: Instance, kind: str, detail: str) -> None:
        """A failed check or request. ``kind == "connect"`` takes the instance out at once."""
        inst.failures += 1
        inst.last_error = f"{kind}: {detail}"
        if kind == "connect" or inst.failures >= self.config.unhealthy_after:
            self._set_healthy(inst, False)

    def request_succeeded(self, inst: Instance) -> None:
        """A request answered: healthy, and its breaker closes (health checks never do)."""
        self.record_success(inst)
        if inst.breaker is not None:
            inst.breaker.on_success()

    def request_failed(self, inst: Instance, kind: str, detail: str) -> None:
        """A request failed at ``inst``: like a failed check, and its breaker counts it."""
        self.record_failure(inst, kind, detail)
        if inst.breaker is not None:
            inst.breaker.on_failure()

    def decode_available(self) -> np.ndarray:
        """(K,) bool: decoders that are healthy, not draining, and whose breaker lets a
        request through."""
        mask = self.tracker.healthy.copy()
        for inst in self.decode:
            if self._refuses(inst):
                mask[inst.index] = False
        return mask

    def decode_refusing(self) -> int:
        """How many decoders cannot take a request now (the ones :meth:`decode_available`
        leaves out). The request path asks twice per request and nearly always hears 0:
        answered without building the mask (its copy and numpy's ``any``/``all`` were
        3 µs of each request)."""
        return sum(self._refuses(inst) for inst in self.decode)

    def _refuses(self, inst: Instance) -> bool:
        """Decoder ``inst`` cannot take a request now: unhealthy, draining, or its breaker
        says no."""
        return not self.tracker.healthy[inst.index] or inst.draining \
            or not inst.breaker.allows()

    def begin(self, inst: Instance) -> None:
        """A request of this router starts at ``inst``."""
        inst.in_flight += 1
        if inst.role == "decode":
            self.tracker.on_dispatch(inst.index)
        else:
            self.prefill_loads[inst.index] += 1

    def end(self, inst: Instance) -> None:
        """That request ended (any outcome)."""
        inst.in_flight -= 1
        if inst.role == "decode":
            self.tracker.on_complete(inst.index)
        else:
            self.prefill_loads[inst.index] -= 1

    def block_size(self) -> int | None:
        """The smallest KV block any engine reported (None: none reported). Read on every
        request (the short-prompt threshold): kept up to date where a report is read, not
        recomputed over the engines here."""
        return self._block_size

    def _note_block_size(self, inst: Instance, size: int | None) -> None:
        inst.block_size = size
        sizes = [i.block_size for i in (*self.prefill, *self.decode) if i.block_size]
        self._block_size = min(sizes) if sizes else None

    async def confirm_alive(self, inst: Instance) -> bool:
        """Is ``inst`` still alive after a request failed there? One ``GET /health`` now,
        shared by every request that asks while it runs (an engine that dies fails all its
        requests at once: one probe answers them all).

        Dead means the engine is gone (connection refused or lost) or says so (a non-200:
        vLLM answers 503 once its engine core died); the instance is then taken out at
        once. A probe that times out is no proof of death: alive (an overloaded engine
        answers late; a hung one is left to the health checks and the breaker).
        """
        probe = self._probes.get(inst)
        if probe is None:
            probe = asyncio.ensure_future(self._probe(inst))
            self._probes[inst] = probe
            probe.add_done_callback(lambda _: self._probes.pop(inst, None))
        return await asyncio.shield(probe)

    async def _probe(self, inst: Instance) -> bool:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        try:
            async with self.session.get(f"{inst.url}/health", timeout=timeout,
                                         headers=self.auth_headers()) as resp:
                await read_upto(resp, _HEALTH_BODY_LIMIT)
                if resp.status == 200:
                    return True
                detail = f"/health answered {resp.status} right after a failed request"
        except Exception as exc:
            if error_kind(exc) == "timeout":
                return True
            detail = f"gone right after a failed request ({str(exc) or type(exc).__name__})"
        inst.failures += 1
        if not inst.dead:  # one death, however many of its requests find it
            inst.dead = True
            inst.deaths += 1
        inst.last_error = f"dead: {detail}"
        self._set_healthy(inst, False)
        return False

    def auth_headers(self) -> dict[str, str]:
        """``Authorization`` for the engines when they require a key (vllm --api-key)."""
        key = self.config.upstream_api_key
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    def max_model_len(self) -> int | None:
        """The smallest context length any engine reported (None: none reported)."""
        lens = [i.max_model_len for i in (*self.prefill, *self.decode)
                if i.max_model_len is not None]
        return min(lens) if lens else None

    def models(self) -> tuple[str, ...]:
        """Accepted model names: the configured ones, else all upstream instances report."""
        if self.config.models:
            return self.config.models
        seen: dict[str, None] = {}
        for inst in (*self.prefill, *self.decode):
            for m in inst.models:
                seen[m] = None
        return tuple(seen)

    # -- background loops ----------------------------------------------------------------
    async def start(self, session) -> None:
        """Run one health round now, then keep checking (and scraping) in the background."""
        self.session = session
        await self.check_all()
        self._tasks.append(asyncio.create_task(self._loop(self.check_all,
                                                          self.config.health_interval)))
        if self.config.scrape_interval > 0:
            self._tasks.append(asyncio.create_task(self._loop(self.scrape_all,
                                                              self.config.scrape_interval)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    @staticmethod
    async def _loop(step, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await step()
            except Exception:  # a bug in one round must not end the checks for good
                log.exception("background round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in (*self.prefill, *self.decode)))

    async def check(self, inst: Instance) -> bool:
        """``GET /health`` (and ``/v1/models`` until known); updates the instance's health."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        headers = self.auth_headers()
        try:
            async with self.session.get(f"{inst.url}/health", timeout=timeout,
                                         headers=headers) as resp:
                await read_upto(resp, _HEALTH_BODY_LIMIT)
                if resp.status != 200:
                    raise ValueError(f"/health answered {resp.status}")
            if not inst.models:
                async with self.session.get(f"{inst.url}/v1/models", timeout=timeout,
                                             headers=headers) as resp:
                    raw, whole = await read_upto(resp, _MODELS_BODY_LIMIT)
                    doc = json_object(raw) if resp.status == 200 and whole else None
                    if doc is not None:  # an odd list is no reason to take an engine out
                        self._learn_models(inst, doc)
            if inst.block_size is None and self.config.short_prompt_tokens is None:
                self._note_block_size(inst, await self._read_block_size(inst, timeout,
                                                                        headers))
        except Exception as exc:  # any failure is "unhealthy"
            self.record_failure(inst, error_kind(exc), str(exc) or type(exc).__name__)
            return False
        self.record_success(inst)
        return True

    async def _read_block_size(self, inst: Instance, timeout, headers) -> int | None:
        """The engine's KV block size from its ``/metrics`` (vLLM's
        ``vllm:cache_config_info`` info gauge), 0 when it reports none (asked once), None
        when the page could not be read (asked again at the next check)."""
        try:
            async with self.session.get(f"{inst.url}/metrics", timeout=timeout,
                                         headers=headers) as resp:
                raw, _ = await read_upto(resp, _METRICS_BODY_LIMIT)
                if resp.status != 200:
                    return 0
        except Exception:  # the health check passed: a scrape failure decides nothing
            return None
        match = _BLOCK_SIZE.search(raw.decode("utf-8", "replace"))
        size = int(match.group(1)) if match else 0
        return size if 0 < size <= 1 << 20 else 0

    @staticmethod
    def _learn_models(inst: Instance, doc: dict) -> None:
        data = doc.get("data")
        data = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        inst.models = tuple(str(m["id"]) for m in data if isinstance(m.get("id"), str))
        lens = [m["max_model_len"] for m in data
                if isinstance(m.get("max_model_len"), int)
                and not isinstance(m["max_model_len"], bool) and m["max_model_len"] > 0]
        inst.max_model_len = min(lens) if lens else None

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(i) for i in self.decode if i.healthy))

    async def scrape(self, inst: Instance) -> None:
        """Read a decoder's running + waiting requests from its ``/metrics``, then its
        engine footprint when the policy takes one."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        await self._scrape_metrics(inst, timeout)
        if not inst.removed:
            await self.footprints.read(self.session, inst, timeout=timeout,
                                       headers=self.auth_headers())

    async def _scrape_metrics(self, inst: Instance, timeout) -> None:
        # in flight when asked: requests that end while the answer travels are in the
        # engine's count but no longer ours (LoadTracker.report)
        then = self.tracker.in_flight_at(inst.index)
        try:
            async with self.session.get(f"{inst.url}/metrics", timeout=timeout,
                                         headers=self.auth_headers()) as resp:
                if resp.status != 200:
                    return
                raw, whole = await read_upto(resp, _METRICS_BODY_LIMIT)
                if not whole:
                    return
                text = raw.decode("utf-8", "replace")
        except Exception as exc:  # health checks decide about health
            log.debug("scrape of %s failed: %s", inst.url, exc)
            return
        samples = parse_samples(text, (*ENGINE_LOAD_METRICS, ENGINE_DISTINCT_METRIC))
        inst.engine_distinct = samples.pop(ENGINE_DISTINCT_METRIC, inst.engine_distinct)
        if not samples or inst.removed:
            return
        inst.engine_load = sum(samples.values())
        self.tracker.report(inst.index, inst.engine_load, in_flight_then=then)
