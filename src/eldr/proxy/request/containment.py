"""Fault containment: poison requests and the retry budget (docs/failures.md).

Retries protect a request from a failing engine; they must not let one request, or one
failing engine, take more engines down. Two mechanisms, both free of I/O:

- :class:`PoisonList` counts engine deaths per request body and remembers, for ``ttl``
  seconds, the bodies that killed two engines in one request, or three over several (a
  "query of death"). A resend of such a
  body is refused before any engine sees it. It is a fixed table of ``capacity``
  entries, indexed by the body's hash (a newer entry replaces an older one in its slot):
  bounded memory whatever the clients send, and a slot is four 8-byte words, so the
  table can live in memory shared by every worker of ``--workers N``.
- :class:`RetryBudget` caps the retries of ALL requests together: over the last
  ``window`` seconds, at most ``min_per_second · window + ratio · requests`` retries
  (Finagle's retry budget: a floor so that a quiet router can still retry, and a share
  of the traffic so that retries never more than ``1 + ratio`` times the load on the
  engines left). Each worker counts its own requests and retries in its own row of
  per-second buckets (one writer per cell, no lock); every worker reads the sum of all
  rows, so the budget is shared by ``--workers N``.

:class:`Strikes` is what went wrong for one request; :class:`RequestGuards` applies both
mechanisms to the requests of one router: what a death is (a 5xx or a lost connection
followed by the engine failing a health probe), when a body becomes poison, whether a
retry may go.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from eldr.proxy.errors import ProxyError

if TYPE_CHECKING:
    from eldr.proxy.config import ServeConfig
    from eldr.proxy.engines import Instance, UpstreamPool
    from eldr.proxy.metrics import RouterMetrics

log = logging.getLogger("eldr.serve")

__all__ = ["DEATH_KINDS", "POISON_BODY_DEATHS", "POISON_DEATHS", "GuardBuffers", "PoisonList",
           "RequestGuards", "RetryBudget", "Strikes", "body_digest", "make_guards",
           "shared_buffer"]

POISON_DEATHS = 2  # engines one request may see die: at the second it is poison
# deaths a body may see over several requests (resends) before it is refused: one more than
# a request's own, since identical bodies in flight at two unrelated deaths are not poison
POISON_BODY_DEATHS = 3
# failures after which the engine may have died: probed, and a death is a strike
DEATH_KINDS = ("http_5xx", "disconnect")


def body_digest(raw: bytes) -> int:
    """A request body's 63-bit fingerprint (BLAKE2b; 0 is never returned: it marks an
    empty slot)."""
    value = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
    return value or 1


def shared_buffer(num_bytes: int):
    """Zeroed memory shared with processes forked after this call (anonymous mapping)."""
    return mmap.mmap(-1, num_bytes)


class PoisonList:
    """Engine deaths per request body, and the bodies refused for them.

    ``capacity`` slots of (digest, expiry, deaths, last death event), indexed by the
    digest. A body is refused for ``ttl`` seconds once :meth:`add` put it there (a request
    that saw two engines die), or once it has seen :data:`POISON_BODY_DEATHS` deaths
    within ``ttl`` of each other across several requests (a prompt that kills the only
    prefill engine dies once per request; it is refused at its third). One death event
    (an engine that dies, found by one health probe) counts once per body, however many
    identical requests were in flight there.

    ``buffer``: memory for the table (``PoisonList.nbytes(capacity)`` bytes, e.g. a
    :func:`shared_buffer`); None: private memory. ``clock``: wall-clock seconds
    (``time.time``: the same in every process).
    """

    def __init__(self, *, capacity: int = 4096, ttl: float = 300.0, buffer=None,
                 clock: Callable[[], float] = time.time) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"poison list capacity must be a positive integer, got "
                             f"{capacity!r}")
        if not ttl > 0:
            raise ValueError(f"poison list ttl must be > 0, got {ttl!r}")
        self.capacity = capacity
        self.ttl = float(ttl)
        self.clock = clock
        buf = bytearray(self.nbytes(capacity)) if buffer is None else buffer
        table = np.frombuffer(buf, dtype=np.int64, count=3 * capacity).reshape(capacity, 3)
        self._digests, self._deaths, self._events = table[:, 0], table[:, 1], table[:, 2]
        self._expiry = np.frombuffer(buf, dtype=np.float64, count=capacity,
                                     offset=24 * capacity)

    @staticmethod
    def nbytes(capacity: int) -> int:
        return 32 * capacity

    def _live(self, slot: int, digest: int) -> bool:
        return int(self._digests[slot]) == digest and self._expiry[slot] > self.clock()

    def _claim(self, digest: int) -> int:
        """``digest``'s slot, emptied first when it held another body (or an expired one)."""
        slot = digest % self.capacity
        if not self._live(slot, digest):
            self._expiry[slot] = 0.0  # a reader in between sees no entry, never a wrong one
            self._digests[slot], self._deaths[slot], self._events[slot] = digest, 0, 0
        return slot

    def record_death(self, digest: int, event: int) -> int:
        """An engine died serving ``digest`` (death ``event``: the same for every request
        that saw that death); the body's deaths within ``ttl`` (this one included)."""
        slot = self._claim(digest)
        if int(self._events[slot]) != event:
            self._deaths[slot] += 1
            self._events[slot] = event
        self._expiry[slot] = self.clock() + self.ttl
        return int(self._deaths[slot])

    def add(self, digest: int) -> None:
        """Refuse ``digest`` for ``ttl`` seconds from now."""
        slot = self._claim(digest)
        self._deaths[slot] = max(int(self._deaths[slot]), POISON_BODY_DEATHS)
        self._expiry[slot] = self.clock() + self.ttl

    def seconds_left(self, digest: int) -> float | None:
        """Seconds ``digest`` stays refused, or None when it is not poison."""
        slot = digest % self.capacity
        if int(self._digests[slot]) != digest or self._deaths[slot] < POISON_BODY_DEATHS:
            return None
        left = float(self._expiry[slot]) - self.clock()
        return left if left > 0 else None

    def __len__(self) -> int:
        """Bodies refused now."""
        return int(np.count_nonzero((self._expiry > self.clock())
                                    & (self._deaths >= POISON_BODY_DEATHS)))


class RetryBudget:
    """Retries of all requests over a sliding window of ``window`` one-second buckets.

    ``on_request()`` once per client request; ``try_retry()`` before each retry: True
    (and counted) while the budget allows one, else False. ``rows``/``row``: the workers
    sharing ``buffer`` (``RetryBudget.nbytes(rows, window)`` bytes) and this one's row.
    """

    def __init__(self, *, ratio: float = 0.2, min_per_second: float = 5.0,
                 window: int = 10, rows: int = 1, row: int = 0, buffer=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (ratio >= 0 and np.isfinite(ratio)):
            raise ValueError(f"retry budget ratio must be finite and >= 0, got {ratio!r}")
        if not (min_per_second >= 0 and np.isfinite(min_per_second)):
            raise ValueError(f"retry budget floor must be finite and >= 0, got "
                             f"{min_per_second!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"retry budget window must be a positive integer, got {window!r}")
        if not 0 <= row < rows:
            raise ValueError(f"row {row} is not in [0, {rows})")
        self.ratio = float(ratio)
        self.min_per_second = float(min_per_second)
        self.window = window
        self.row = row
        self.clock = clock
        buf = bytearray(self.nbytes(rows, window)) if buffer is None else buffer
        # (rows, window, 3) int64: the second each bucket holds, its requests, its retries
        self._table = np.frombuffer(buf, dtype=np.int64, count=rows * window * 3).reshape(
            rows, window, 3)

    @staticmethod
    def nbytes(rows: int, window: int) -> int:
        return 8 * 3 * rows * window

    def _bucket(self) -> np.ndarray:
        """This row's bucket of the current second (emptied when it held an older one)."""
        second = int(self.clock())
        cell = self._table[self.row, second % self.window]
        if cell[0] != second:
            cell[1] = cell[2] = 0
            cell[0] = second
        return cell

    def _totals(self) -> tuple[int, int]:
        """(requests, retries) of every row over the window."""
        second = int(self.clock())
        live = self._table[:, :, 0] > second - self.window
        return (int(self._table[:, :, 1][live].sum()), int(self._table[:, :, 2][live].sum()))

    def on_request(self) -> None:
        self._bucket()[1] += 1

    def allowed(self) -> float:
        """Retries the window allows in all (spent ones included)."""
        requests, _ = self._totals()
        return self.min_per_second * self.window + self.ratio * requests

    def try_retry(self) -> bool:
        requests, retries = self._totals()
        if retries + 1 > self.min_per_second * self.window + self.ratio * requests:
            return False
        self._bucket()[2] += 1
        return True


class Strikes:
    """What went wrong for one request: its body's digest, the engines that died while
    serving it, whether the retry budget refused it a retry."""

    __slots__ = ("budget_refused", "deaths", "digest", "rid")

    def __init__(self, rid: str, digest: int) -> None:
        self.rid = rid  # the client's request id (logs)
        self.digest = digest  # body_digest of its body
        self.deaths: list[str] = []  # "role name (kind)" of each engine that died
        self.budget_refused = False


@dataclass(frozen=True, slots=True)
class GuardBuffers:
    """The memory of one poison list and one retry budget shared by ``rows`` workers
    (``eldr serve --workers N``): made before ``fork``, so every worker maps the same
    pages; each worker's :func:`make_guards` lays its list and budget over them."""

    poison: mmap.mmap  # PoisonList.nbytes(config.poison_capacity) zeroed bytes
    budget: mmap.mmap  # RetryBudget.nbytes(rows, config.retry_budget_window) zeroed bytes
    rows: int  # workers sharing them, each writing its own row of the budget

    @classmethod
    def allocate(cls, config: ServeConfig, rows: int) -> GuardBuffers:
        return cls(shared_buffer(PoisonList.nbytes(config.poison_capacity)),
                   shared_buffer(RetryBudget.nbytes(rows, config.retry_budget_window)), rows)


def make_guards(config: ServeConfig, shared: GuardBuffers | None = None,
                row: int = 0) -> tuple[PoisonList, RetryBudget]:
    """The poison list and retry budget of one router (docs/failures.md): over ``shared``
    memory as worker ``row`` of ``--workers N``, else this process's own."""
    poison = PoisonList(capacity=config.poison_capacity, ttl=config.poison_ttl,
                        buffer=None if shared is None else shared.poison)
    budget = RetryBudget(ratio=config.retry_budget_ratio,
                         min_per_second=config.retry_budget_min,
                         window=config.retry_budget_window,
                         rows=1 if shared is None else shared.rows,
                         row=0 if shared is None else row,
                         buffer=None if shared is None else shared.budget)
    return poison, budget


class RequestGuards:
    """The poison list and the retry budget, applied to one router's requests.

    The request flow asks it at three points: :meth:`admit` before any engine sees a
    request, :meth:`may_retry` before each retry, :meth:`check_death` after a failure that
    may have killed an engine (also mid-stream, from the relay). ``pool`` probes an engine
    that failed; ``metrics`` counts deaths, poison requests and refused retries.
    """

    def __init__(self, poison: PoisonList, budget: RetryBudget, *, pool: UpstreamPool,
                 metrics: RouterMetrics, poison_ttl: float) -> None:
        self.poison = poison  # bodies that killed engines (shared by --workers N)
        self.budget = budget  # retries of all requests (shared by --workers N)
        self._pool, self._metrics, self._poison_ttl = pool, metrics, poison_ttl
        # death events already counted (an engine death found by several requests)
        self._deaths_seen: collections.deque = collections.deque(maxlen=64)

    def admit(self, faults: Strikes) -> None:
        """Count a new request toward the retry budget; first, 422 for a body that killed
        two engines not long ago (before any engine sees it)."""
        left = self.poison.seconds_left(faults.digest)
        if left is not None:
            self._metrics.poison.inc(event="refused")
            raise ProxyError(422, f"this request is refused for another {left:.0f} s: the "
                                  f"same body made two engines die in a row (a poison "
                                  f"request; change it, or ask the operator)",
                             code="poison_request")
        self.budget.on_request()

    def is_refused(self, faults: Strikes) -> bool:
        """Whether the request's body is on the poison list now."""
        return self.poison.seconds_left(faults.digest) is not None

    def may_retry(self, faults: Strikes, last: object) -> bool:
        """One more try elsewhere, if the shared retry budget allows it (``last``: the
        failure that asks, for the log)."""
        if self.budget.try_retry():
            return True
        faults.budget_refused = True
        self._metrics.retries_refused.inc()
        log.warning("request %s: not retried, the retry budget is spent (%s)", faults.rid,
                    last)
        return False

    async def check_death(self, inst: Instance, kind: str, faults: Strikes) -> None:
        """After a 5xx or a lost connection at ``inst``: did the engine die? A death is a
        strike against the request; the second makes it poison (ProxyError 502, the body
        refused for ``poison_ttl`` s)."""
        if kind not in DEATH_KINDS or await self._pool.confirm_alive(inst):
            return
        faults.deaths.append(f"{inst.role} {inst.name} ({kind})")
        # one death event per engine death, whichever of its requests found it
        event = body_digest(f"{inst.url}#{inst.deaths}".encode())
        if event not in self._deaths_seen:
            self._deaths_seen.append(event)
            self._metrics.engine_deaths.inc(role=inst.role, instance=inst.name)
        total = self.poison.record_death(faults.digest, event)
        if len(faults.deaths) >= POISON_DEATHS or total >= POISON_BODY_DEATHS:
            raise self._poisoned(faults, total)

    def _poisoned(self, faults: Strikes, total: int) -> ProxyError:
        self.poison.add(faults.digest)
        self._metrics.poison.inc(event="detected")
        deaths = ", then ".join(faults.deaths)
        if total > len(faults.deaths):  # the body killed engines in earlier requests too
            deaths = (f"{total - len(faults.deaths)} engine(s) in earlier requests with this "
                      f"body, then {deaths}")
        log.error("request %s is poison: engines died while serving it (%s); not retried, "
                  "its body refused for %.0f s", faults.rid, deaths, self._poison_ttl)
        return ProxyError(502, f"request {faults.rid} was not served: engines died in a row "
                               f"serving this body ({deaths}); it is not retried, and the "
                               f"same body is refused for {self._poison_ttl:.0f} s",
                          code="poison_request")
