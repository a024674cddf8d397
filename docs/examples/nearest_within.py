"""An example locality policy (docs/adding-a-policy.md): the nearest centroid among the
decoders within ``slack`` requests of the least-loaded one.

The band (``eldr``) filters by similarity and then picks by load; this policy does the
reverse: it bounds how far a decoder may run ahead of the least-loaded one, then sends the
request to the closest centroid inside that bound. ``slack = 0`` is JSQ (ties → the
closer centroid); a slack larger than any load is the nearest centroid (top-1).

tests/test_adding_a_policy.py registers it and runs it through the simulator, the router
and the report.
"""

from __future__ import annotations

import numpy as np

from eldr.routing import (
    Decision,
    PolicyBase,
    ReportRole,
    RouteRequest,
    filters,
    pickers,
    register_policy,
    scorers,
)

__all__ = ["NearestWithinPolicy"]


class NearestWithinPolicy(PolicyBase):
    """Nearest of ``centroids`` (K, d) among healthy decoders whose load is at most the
    least healthy load + ``slack``; row k belongs to decoder k. A request without a
    signature goes to JSQ and counts as a fallback."""

    def __init__(self, num_workers: int, *, centroids: np.ndarray, slack: float = 2.0,
                 name: str = "nearest_within") -> None:
        self.name = name
        self.num_workers = int(num_workers)
        self.num_fallbacks = 0
        self.inputs = frozenset({"signature"})  # what it reads of a request
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        if c.ndim != 2 or c.shape[0] != self.num_workers:
            raise ValueError(f"{name}: centroids have shape {c.shape}, expected "
                             f"({self.num_workers}, d)")
        if not slack >= 0:
            raise ValueError(f"{name}: slack must be >= 0, got {slack}")
        self.centroids, self.slack = c, float(slack)

    def decide(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> Decision:
        ok = filters.healthy(self.name, self.num_workers, healthy)
        if request.signature is None:
            self.num_fallbacks += 1
            return Decision(pickers.lowest(ok, scorers.load(loads)), fallback=True)
        sim = scorers.similarities(self.centroids, request.signature, self.name)
        near = ok & (loads <= loads[ok].min() + self.slack)
        k = pickers.lowest(near, -sim, tiebreak=loads)  # closest, then least loaded
        return Decision(k, band_size=int(np.count_nonzero(near)))

    def add_worker(self, *, like: int | None = None) -> int:
        """A new decoder shares ``like``'s centroid (decoder 0's without one)."""
        src = self._index(0 if like is None else like)
        k = super().add_worker(like=src)
        self.centroids = np.concatenate([self.centroids, self.centroids[src:src + 1]])
        return k

    def remove_worker(self, worker: int) -> None:
        super().remove_worker(worker)
        self.centroids = np.delete(self.centroids, worker, axis=0)


register_policy(
    "nearest_within",
    lambda K, centroids: NearestWithinPolicy(K, centroids=centroids),
    needs={"centroids"},  # fitted by `eldr fit`, one per decoder
    role="locality",
    report=ReportRole(
        order=8,  # after the registered policies: its rows, columns and plot line come last
        key="nearest",  # results.json: nearest_d_p50, nearest_tpot_p99, ...
        title="The nearest-within-slack example",
        about="`nearest_within` sends a request to the nearest centroid among the decoders "
              "within two requests of the least-loaded one (docs/adding-a-policy.md).",
        grid=True,  # held to the never-worse grid
    ),
)
