"""Live decode loads and health, as routing policies read them.

A :class:`LoadTracker` holds the in-flight request count and the health flag of each of
``K`` decode workers, as arrays that go straight into ``Policy.choose`` (``eldr.routing``).
The HTTP router moves the counts on dispatch/completion and overwrites them with the
engines' own reported loads when it scrapes them; the simulator keeps its own arrays.
"""

from __future__ import annotations

import numpy as np

from eldr.routing._common import _check_num_workers

__all__ = ["LoadTracker"]


class LoadTracker:
    """In-flight requests per decode worker, plus a health mask.

    ``loads`` (K,) float64 and ``healthy`` (K,) bool are live arrays: pass them straight
    to ``Policy.choose``. ``on_dispatch``/``on_complete`` move a worker's count of this
    router's requests in flight (``own``) by ±1; ``report`` gives an externally measured
    load (a worker's own running + waiting count, which also holds other routers'
    requests), after which dispatches and completions move it again until the next
    report.

    A report never takes a worker's load below this router's own requests in flight
    there: ``loads = max(own, reported + own − own at the report)``. They are a lower
    bound on its load, and an engine does not yet count a request the router has just
    dispatched (still in transit, or waiting for its KV): an overwrite took such requests
    out of the load until the next report. Without a report, ``loads = own``.

    "Own at the report" is the larger of ``own`` when the scrape was SENT (``in_flight_then``
    from :meth:`in_flight_at`) and when its answer arrived. Requests that complete while a
    scrape is in flight are in the engine's count but no longer in ``own``; with only the
    count at arrival they stayed in the load after they ended (a decoder that had just
    finished a burst of 8 read as busy until the next scrape, and the next burst went
    elsewhere). Requests dispatched while it is in flight are in ``own`` at arrival and
    perhaps not in the engine's count: the larger of the two never counts one twice.
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = _check_num_workers(num_workers)
        K = self.num_workers
        self.loads = np.zeros(K, dtype=np.float64)
        self.healthy = np.ones(K, dtype=bool)
        self.own = np.zeros(K, dtype=np.float64)  # this router's requests in flight
        self._reported = np.zeros(K, dtype=np.float64)  # the last report
        self._own_at_report = np.zeros(K, dtype=np.float64)
        self._has_report = np.zeros(K, dtype=bool)

    def _index(self, worker: int) -> int:
        if not isinstance(worker, (int, np.integer)) or not 0 <= worker < self.num_workers:
            raise ValueError(f"worker index {worker!r} out of range [0, {self.num_workers})")
        return int(worker)

    def _update(self, k: int) -> None:
        own = self.own[k]
        self.loads[k] = max(own, self._reported[k] + own - self._own_at_report[k]) \
            if self._has_report[k] else own

    def on_dispatch(self, worker: int) -> None:
        k = self._index(worker)
        self.own[k] += 1.0
        self._update(k)

    def on_complete(self, worker: int) -> None:
        k = self._index(worker)
        self.own[k] = max(0.0, self.own[k] - 1.0)
        self._update(k)

    def _removable(self, worker: int) -> int:
        """The index of decoder ``worker``, which may be removed (it is not the last)."""
        k = self._index(worker)
        if self.num_workers == 1:
            raise ValueError("the last decode worker cannot be removed")
        return k

    @staticmethod
    def _checked_load(worker: int, load: float) -> float:
        load = float(load)
        if not np.isfinite(load) or load < 0:
            raise ValueError(f"reported load for worker {worker} must be finite and >= 0, "
                             f"got {load}")
        return load

    def in_flight_at(self, worker: int) -> float:
        """This router's requests in flight at ``worker`` now: what a scrape sent now
        passes back to :meth:`report` as ``in_flight_then``."""
        return float(self.own[self._index(worker)])

    def report(self, worker: int, load: float, in_flight_then: float | None = None) -> None:
        """An engine-measured ``load`` of ``worker``; ``in_flight_then``: this router's
        requests in flight there when the measurement was asked for (None: now)."""
        load = self._checked_load(worker, load)
        k = self._index(worker)
        at = self.own[k] if in_flight_then is None else max(float(in_flight_then), self.own[k])
        self._reported[k], self._own_at_report[k], self._has_report[k] = load, at, True
        self._update(k)

    def set_healthy(self, worker: int, is_healthy: bool) -> None:
        self.healthy[self._index(worker)] = bool(is_healthy)

    _ARRAYS = ("loads", "healthy", "own", "_reported", "_own_at_report", "_has_report")

    def add_worker(self) -> int:
        """A new decoder at index K: no load, healthy. Returns its index."""
        for name in self._ARRAYS:
            value = getattr(self, name)
            setattr(self, name, np.append(value, value.dtype.type(name == "healthy")))
        self.num_workers += 1
        return self.num_workers - 1

    def remove_worker(self, worker: int) -> None:
        """Drop decoder ``worker``; those above it move down one index."""
        k = self._removable(worker)
        for name in self._ARRAYS:
            setattr(self, name, np.delete(getattr(self, name), k))
        self.num_workers -= 1
