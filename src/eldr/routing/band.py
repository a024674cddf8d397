"""The ELDR locality band (docs/fit-and-routing.md): least-loaded decoder among those
whose centroid is within τ of the best match.

    healthy → band(τ) filter → lowest load, ties → highest similarity → lowest index

``sim_k = s · c_k`` over healthy k, ``s* = max sim``, band ``B = {k : sim_k ≥ s* − τ}``.
τ = 0 is top-1 (nearest centroid); τ ≥ 2 is pure JSQ for any unit vectors, and τ ≥ 1
already is for non-negative representations (counts, probabilities), where all cosines lie
in [0, 1]. Similarities are computed and compared in float32 (``centroids`` are stored
float32, C-contiguous); a band edge exactly at ``s* − τ`` is decided by float32 rounding.

A request without its routing vector goes to JSQ and counts as a fallback. An all-zero
signature (no expert selections) gives every worker sim 0, so the band holds all of them:
JSQ, not a fallback.
"""

from __future__ import annotations

import numpy as np

from eldr.routing import filters, pickers, scorers
from eldr.routing._common import _check, _check_num_workers
from eldr.routing.protocol import Decision, PolicyBase, RouteRequest

__all__ = ["EldrPolicy", "decode_patterns"]


class EldrPolicy(PolicyBase):
    """Locality band over ``centroids`` (K, d); row k belongs to worker k.

    ``use_decode_pattern=True`` makes this the ``oracle_signature`` policy: it routes
    ``request.decode_pattern`` (against decode-pattern centroids) instead of the signature.
    """

    def __init__(self, num_workers: int, *, centroids: np.ndarray | None, tau: float = 0.1,
                 use_decode_pattern: bool = False, name: str = "eldr") -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0
        if centroids is None:
            raise ValueError(f"{name}: centroids are required")
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        if c.ndim != 2 or c.shape[0] != self.num_workers or c.shape[1] == 0:
            raise ValueError(f"{name}: centroids have shape {c.shape}, "
                             f"expected ({self.num_workers}, d)")
        if not np.isfinite(c).all():
            raise ValueError(f"{name}: centroids contain NaN or Inf")
        tau = float(tau)
        if not np.isfinite(tau) or tau < 0:
            raise ValueError(f"{name}: tau must be finite and >= 0, got {tau}")
        self.centroids = c
        self.tau = tau
        self.use_decode_pattern = use_decode_pattern
        self.inputs = frozenset({"decode_pattern" if use_decode_pattern else "signature"})

    def similarities(self, vector: np.ndarray) -> np.ndarray:
        """(K,) float32 ``c_k · vector`` for a (d,) vector."""
        return scorers.similarities(self.centroids, vector, self.name)

    def decide(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> Decision:
        _check(self.name, self.num_workers, loads, healthy)
        ok = filters.healthy(self.name, self.num_workers, healthy)
        v = request.decode_pattern if self.use_decode_pattern else request.signature
        if v is None:
            self.num_fallbacks += 1
            return Decision(pickers.lowest(ok, scorers.load(loads)), fallback=True)
        sim = self.similarities(v)
        inside = filters.band(ok, sim, self.tau)
        k = pickers.lowest(inside, scorers.load(loads), tiebreak=-sim)
        return Decision(k, band_size=int(np.count_nonzero(inside)))

    def add_worker(self, *, like: int | None = None) -> int:
        """A new decoder with a copy of ``like``'s centroid (default: decoder 0): the two
        share that cluster (both always in the same band, load decides between them), a
        split of it until a refit fits K + 1 centroids."""
        src = self._index(0 if like is None else like)
        k = super().add_worker(like=src)
        self.centroids = np.ascontiguousarray(
            np.concatenate([self.centroids, self.centroids[src:src + 1]]))
        return k

    def remove_worker(self, worker: int) -> None:
        """Its centroid goes: its cluster's requests now match the next-nearest ones."""
        super().remove_worker(worker)
        self.centroids = np.ascontiguousarray(np.delete(self.centroids, worker, axis=0))


def decode_patterns(decode_counts: np.ndarray) -> np.ndarray:
    """(R, L, E) decode counts → (R, L·E) float32 unit rows (all-zero rows stay zero).

    The routing vectors of ``oracle_signature``; its centroids are usually the
    re-normalised means of these rows per cluster.
    """
    x = np.asarray(decode_counts)
    if x.ndim != 3:
        raise ValueError(f"decode_counts must be (R, L, E), got shape {x.shape}")
    flat = x.reshape(x.shape[0], -1).astype(np.float32)
    norms = np.linalg.norm(flat, axis=1, keepdims=True)
    np.divide(flat, norms, out=flat, where=norms > 0)
    return flat
