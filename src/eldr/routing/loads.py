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
    to ``Policy.choose``. ``on_dispatch``/``on_complete`` move a worker's count by ±1;
    ``report`` overwrites it with an externally measured load (e.g. a worker's own
    running + waiting count), after which dispatches and completions move it again until
    the next report. A completion never takes a load below 0 (it may belong to a request
    the last report already excluded).
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = _check_num_workers(num_workers)
        self.loads = np.zeros(self.num_workers, dtype=np.float64)
        self.healthy = np.ones(self.num_workers, dtype=bool)

    def _index(self, worker: int) -> int:
        if not isinstance(worker, (int, np.integer)) or not 0 <= worker < self.num_workers:
            raise ValueError(f"worker index {worker!r} out of range [0, {self.num_workers})")
        return int(worker)

    def on_dispatch(self, worker: int) -> None:
        self.loads[self._index(worker)] += 1.0

    def on_complete(self, worker: int) -> None:
        k = self._index(worker)
        self.loads[k] = max(0.0, self.loads[k] - 1.0)

    def report(self, worker: int, load: float) -> None:
        load = float(load)
        if not np.isfinite(load) or load < 0:
            raise ValueError(f"reported load for worker {worker} must be finite and >= 0, "
                             f"got {load}")
        self.loads[self._index(worker)] = load

    def set_healthy(self, worker: int, is_healthy: bool) -> None:
        self.healthy[self._index(worker)] = bool(is_healthy)

    def add_worker(self) -> int:
        """A new decoder at index K: no load, healthy. Returns its index."""
        self.loads = np.append(self.loads, 0.0)
        self.healthy = np.append(self.healthy, True)
        self.num_workers += 1
        return self.num_workers - 1

    def remove_worker(self, worker: int) -> None:
        """Drop decoder ``worker``; those above it move down one index."""
        k = self._index(worker)
        if self.num_workers == 1:
            raise ValueError("the last decode worker cannot be removed")
        self.loads = np.delete(self.loads, k)
        self.healthy = np.delete(self.healthy, k)
        self.num_workers -= 1
