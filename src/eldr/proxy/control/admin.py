"""The router's admin side: the bearer-token check with a per-address limit on wrong
tokens (:class:`AdminToken`), and the artifact reload (``POST /admin/reload``, SIGHUP,
``--learn`` swaps) with the checks that keep an artifact for another deployment out
(:class:`Reloader`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from eldr.proxy.config import ServeConfig
from eldr.proxy.errors import ProxyError
from eldr.proxy.request import LiveRouting, RoutingState, WorkerMismatch, build_state

if TYPE_CHECKING:
    from eldr.proxy.engines import UpstreamPool
    from eldr.proxy.metrics import RouterMetrics

__all__ = ["AdminToken", "FailedAttempts", "JournalLink", "ReloadRefused", "Reloader"]

log = logging.getLogger("eldr.serve")


class JournalLink(Protocol):
    """A worker's channel to the pool journal of ``--workers N``
    (:class:`eldr.proxy.workers.poollink.PoolLink`): the changes control asks for go
    through it, to be applied in every worker in one order."""

    on_message: Callable[[dict], None] | None  # the parent's other messages (learn records)

    async def reload(self, artifact: str | None = None) -> RoutingState: ...

    async def add(self, url: str, name: str | None, like: str | None): ...

    async def drain(self, name: str) -> int: ...

    async def freed(self, seq: int) -> bool: ...

    def removed(self, name: str) -> None: ...

    def send(self, msg: dict, *, droppable: bool = False) -> bool: ...


class FailedAttempts:
    """Wrong admin tokens per client address in a sliding window, to slow guessing down.

    ``max_failures`` within ``window`` seconds limit an address until the oldest ages
    out. At most ``max_peers`` addresses are remembered (the oldest forgotten first), so a
    flood of addresses cannot grow memory.
    """

    def __init__(self, *, max_failures: int = 5, window: float = 60.0,
                 max_peers: int = 4096, clock=time.monotonic) -> None:
        self.max_failures = max_failures
        self.window = window
        self.max_peers = max_peers
        self.clock = clock
        self._seen: OrderedDict[str, collections.deque] = OrderedDict()

    def _recent(self, peer: str) -> collections.deque | None:
        times = self._seen.get(peer)
        if times is not None:
            cutoff = self.clock() - self.window
            while times and times[0] < cutoff:
                times.popleft()
        return times

    def is_limited(self, peer: str) -> bool:
        times = self._recent(peer)
        return times is not None and len(times) >= self.max_failures

    def record(self, peer: str) -> None:
        times = self._recent(peer)
        if times is None:
            times = self._seen[peer] = collections.deque(maxlen=self.max_failures)
        times.append(self.clock())
        self._seen.move_to_end(peer)
        while len(self._seen) > self.max_peers:
            self._seen.popitem(last=False)


class ReloadRefused(ValueError):
    """A valid artifact that does not fit the running deployment (HTTP 409)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class AdminToken:
    """The bearer token of ``/admin/*`` and of ``/health``'s details (None: every admin
    request is refused), with ``failed``, the wrong tokens per client address."""

    def __init__(self, token: str | None, failed: FailedAttempts | None = None) -> None:
        self._token = token
        self.failed = FailedAttempts() if failed is None else failed

    def authorize(self, request) -> None:
        """Raise unless the request carries the admin token (403 disabled, 401 wrong, 429
        after too many wrong tokens from its address)."""
        if self._token is None:
            raise ProxyError(403, "admin endpoints are disabled: start eldr serve with "
                                  "ELDR_ADMIN_TOKEN or --admin-token-file",
                             code="admin_disabled")
        peer = request.remote or "?"
        if self.failed.is_limited(peer):
            raise ProxyError(429, "too many wrong admin tokens from this address; wait a "
                                  "minute", code="rate_limited")
        if not self._matches(request):
            self.failed.record(peer)
            raise ProxyError(401, "missing or wrong admin token (Authorization: Bearer ...)",
                             code="unauthorized")

    def is_admin(self, request) -> bool:
        try:
            self.authorize(request)
        except ProxyError:
            return False
        return True

    def _matches(self, request) -> bool:
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode(), self._token.encode())


class Reloader:
    """Artifact reloads of one router: ``POST /admin/reload`` (:meth:`route`), SIGHUP and
    ``--learn`` swaps (:meth:`reload`).

    A reload builds a new routing snapshot off the event loop, checks it against the
    running one and the engines' model, and hands it to ``swap`` (the router's one way to
    change its state). ``lock`` is shared with the elastic pool: one change at a time. With
    ``--workers N`` the worker's :class:`JournalLink` is set as ``link``:
    reloads then go through the pool journal, which calls :meth:`apply` in every worker.
    """

    def __init__(self, live: LiveRouting, swap: Callable[[RoutingState, ServeConfig], None],
                 pool: UpstreamPool, metrics: RouterMetrics, token: AdminToken,
                 lock: asyncio.Lock) -> None:
        self.live, self._swap, self.pool, self.metrics = live, swap, pool, metrics
        self.token, self.lock = token, lock
        self.link: JournalLink | None = None  # the pool journal, in a worker of --workers N

    async def route(self, request):
        """``POST /admin/reload``."""
        from aiohttp import web

        self.token.authorize(request)
        try:
            state = await self.reload()
        except ReloadRefused as exc:
            raise ProxyError(409, f"artifact reload refused, the previous one stays in use: "
                                  f"{exc}", code=exc.code) from None
        except (ValueError, OSError) as exc:
            raise ProxyError(500, f"artifact reload failed, the previous one stays in use: "
                                  f"{exc}", code="reload_failed") from None
        except Exception as exc:  # reload() logged the traceback; name no internals
            raise ProxyError(500, f"artifact reload failed ({type(exc).__name__}), the "
                                  f"previous one stays in use", code="reload_failed") from None
        return web.json_response({"reloaded": True, "artifact": state.artifact,
                                  "policy": state.policy.name, "tau": state.tau,
                                  "decoders": list(state.worker_names)})

    async def reload(self, artifact: str | None = None) -> RoutingState:
        """Reload the artifact (``artifact``: this directory instead of the configured one,
        which it becomes on success): here, or in every worker through the journal."""
        if self.link is not None:
            return await self.link.reload(artifact)
        return await self.apply(artifact)

    def _check_fingerprint(self, new: RoutingState) -> None:
        """Refuse an artifact fitted for another model than the one being served.

        Such an artifact loads fine and then silently routes every request by load (its
        (L, E) never match a payload). The served model is known from the engines' payloads
        (``pool.engine_shape``) once a request went through; k, and everything before the
        first request, is compared with the running artifact. A deployment that changes
        model restarts the router.
        """
        if new.num_layers is None:
            return  # no artifact: nothing model-specific to compare
        old = self.live.state
        engines = self.pool.engine_shape
        if engines is not None and engines != (new.num_layers, new.num_experts):
            raise ReloadRefused(
                f"the new artifact is for {new.fingerprint()}, the engines' prefill payloads "
                f"have L={engines[0]} E={engines[1]}", "artifact_model_mismatch")
        same_shape = (old.num_layers, old.num_experts) == (new.num_layers, new.num_experts)
        if old.num_layers is not None and (engines is None or same_shape) and \
                old.fingerprint() != new.fingerprint():
            raise ReloadRefused(
                f"the new artifact is for {new.fingerprint()}, the running artifact is for "
                f"{old.fingerprint()}", "artifact_model_mismatch")

    async def apply(self, artifact: str | None = None) -> RoutingState:
        """Re-read the artifact off the event loop, check it, swap the routing snapshot.

        Requests in flight keep the snapshot they started with. A bad artifact raises
        ``ValueError`` and the current one stays.
        """
        async with self.lock:
            loop = asyncio.get_running_loop()
            config = self.live.config if artifact is None else \
                dataclasses.replace(self.live.config, artifact=artifact)
            try:
                try:
                    state = await loop.run_in_executor(None, build_state, config)
                except WorkerMismatch as exc:  # e.g. fitted before a decoder was added
                    raise ReloadRefused(str(exc), "artifact_workers") from None
                self._check_workers(state)
                self._check_fingerprint(state)
            except (ValueError, OSError) as exc:
                self.metrics.reloads.inc(result="error")
                log.error("artifact reload failed (keeping the current one): %s", exc)
                raise
            except Exception:  # an artifact must never take the router down
                self.metrics.reloads.inc(result="error")
                log.exception("artifact reload failed (keeping the current one)")
                raise
            self._swap(state, config)
            self.metrics.reloads.inc(result="ok")
            log.info("routing artifact reloaded from %s", state.artifact)
            return state

    def replay(self, artifact: str | None) -> RoutingState:
        """A reload of the pool journal replayed before a restarted worker serves: read at
        once (nothing runs yet), checked against the decoders only (the running workers
        checked the rest and logged the outcome); raises as :meth:`apply` does."""
        config = dataclasses.replace(self.live.config,
                                     artifact=artifact or self.live.config.artifact)
        state = build_state(config)
        self._check_workers(state)
        self._swap(state, config)
        return state

    def _check_workers(self, new: RoutingState) -> None:
        running = self.live.state.worker_names
        if new.worker_names != running:
            raise ReloadRefused(f"the new artifact's decoders {list(new.worker_names)} differ "
                                f"from the running {list(running)}", "artifact_workers")
