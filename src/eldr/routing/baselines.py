"""Load-only and oracle-domain baseline policies (the registry lives in ``eldr.routing``).

``random``, ``round_robin``, ``jsq``, ``p2c`` balance load only; ``domain`` sends each
oracle domain label to a fixed worker group sized by the domain's calibration share.
Stateless: they ignore the dispatch/release events of :mod:`eldr.routing.protocol`; a
decoder added or removed at run time (``add_worker``/``remove_worker``) only changes K
(round robin keeps its turn, ``domain`` its groups).
"""

from __future__ import annotations

import numpy as np

from eldr.routing._common import _check, _check_num_workers, _jsq, _no_healthy, _Uniforms
from eldr.routing.protocol import PolicyBase, RouteRequest

__all__ = [
    "DomainPolicy",
    "JSQPolicy",
    "P2CPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "domain_groups",
]


class RandomPolicy(PolicyBase):
    """Uniform over healthy workers."""

    def __init__(self, num_workers: int, *, random_state=None, name: str = "random") -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0
        self._u = _Uniforms(random_state)

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int:
        _check(self.name, self.num_workers, loads, healthy)
        if healthy is None:
            return int(self._u.next() * self.num_workers)
        idx = np.flatnonzero(healthy)
        if idx.size == 0:
            raise _no_healthy(self.name)
        return int(idx[int(self._u.next() * idx.size)])


class RoundRobinPolicy(PolicyBase):
    """Cycles through workers in index order, skipping unhealthy ones."""

    def __init__(self, num_workers: int, *, name: str = "round_robin") -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0
        self._next = 0  # index tried first by the next decision

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int:
        _check(self.name, self.num_workers, loads, healthy)
        K = self.num_workers
        for step in range(K):
            k = (self._next + step) % K
            if healthy is None or healthy[k]:
                self._next = (k + 1) % K
                return k
        raise _no_healthy(self.name)

    def remove_worker(self, worker: int) -> None:
        super().remove_worker(worker)
        if self._next > worker:  # the decoder due next keeps its turn under its new index
            self._next -= 1
        self._next %= self.num_workers


class JSQPolicy(PolicyBase):
    """Join the shortest queue: least-loaded healthy worker, ties → lowest index."""

    def __init__(self, num_workers: int, *, name: str = "jsq") -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int:
        _check(self.name, self.num_workers, loads, healthy)
        return _jsq(self.name, loads, healthy)


class P2CPolicy(PolicyBase):
    """Power of two choices: two distinct random healthy workers, the less loaded wins."""

    def __init__(self, num_workers: int, *, random_state=None, name: str = "p2c") -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0
        self._u = _Uniforms(random_state)

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int:
        _check(self.name, self.num_workers, loads, healthy)
        if healthy is None:
            idx = None
            n = self.num_workers
        else:
            idx = np.flatnonzero(healthy)
            n = idx.size
            if n == 0:
                raise _no_healthy(self.name)
        if n == 1:
            return 0 if idx is None else int(idx[0])
        a = int(self._u.next() * n)
        b = int(self._u.next() * (n - 1))
        if b >= a:
            b += 1  # distinct from a, uniform over the other n - 1
        if idx is not None:
            a, b = int(idx[a]), int(idx[b])
        la, lb = loads[a], loads[b]
        if la < lb or (la == lb and a < b):
            return a
        return b


# -- oracle domain baseline -----------------------------------------------------------------
def domain_groups(domain_shares: np.ndarray, num_workers: int) -> list[np.ndarray]:
    """Split ``num_workers`` workers into one group per domain, sized by share.

    ``domain_shares`` (D,) non-negative (normalised here). With K ≥ D every domain gets a
    contiguous block of ≥ 1 workers, sizes by largest remainder of ``share · K`` (ties →
    lower domain index). With K < D each domain gets one worker: domains in decreasing
    share go to the worker with the least share so far (ties → lower index), so workers
    are shared. Returns D int64 arrays of worker indices.
    """
    K = _check_num_workers(num_workers)
    shares = np.asarray(domain_shares, dtype=np.float64)
    if shares.ndim != 1 or shares.size == 0:
        raise ValueError(f"domain_shares must be a non-empty 1-D array, got shape {shares.shape}")
    if not np.isfinite(shares).all() or (shares < 0).any() or shares.sum() <= 0:
        raise ValueError(f"domain_shares must be finite, >= 0 and not all 0, got {shares}")
    shares = shares / shares.sum()
    D = shares.size
    if K < D:
        held = np.zeros(K)
        groups = [np.empty(0, dtype=np.int64)] * D
        for d in np.argsort(-shares, kind="stable"):
            k = int(np.argmin(held))
            held[k] += shares[d]
            groups[d] = np.array([k], dtype=np.int64)
        return groups
    quota = shares * K
    sizes = np.maximum(1, np.floor(quota)).astype(np.int64)
    while sizes.sum() > K:  # the minimum of 1 overshot: shrink the most over-served domain
        over = np.where(sizes > 1, sizes - quota, -np.inf)
        sizes[int(np.argmax(over))] -= 1
    while sizes.sum() < K:
        sizes[int(np.argmax(quota - sizes))] += 1
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [np.arange(bounds[d], bounds[d + 1], dtype=np.int64) for d in range(D)]


class DomainPolicy(PolicyBase):
    """Oracle domain label → its worker group (:func:`domain_groups`), JSQ inside it.

    A request without a domain, or whose group has no healthy worker, goes to JSQ over
    all healthy workers and counts as a fallback.
    """

    def __init__(self, num_workers: int, *, domain_shares: np.ndarray,
                 name: str = "domain") -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0
        self.inputs = frozenset({"domain"})
        self.groups_ = domain_groups(domain_shares, self.num_workers)
        masks = np.zeros((len(self.groups_), self.num_workers), dtype=bool)
        for d, g in enumerate(self.groups_):
            masks[d, g] = True
        self._masks = masks  # (D, K) bool: workers of each domain's group

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int:
        _check(self.name, self.num_workers, loads, healthy)
        d = request.domain
        if d is None:
            self.num_fallbacks += 1
            return _jsq(self.name, loads, healthy)
        if not 0 <= d < self._masks.shape[0]:
            raise ValueError(f"{self.name}: request {request.request_id!r} has domain {d}, "
                             f"expected 0..{self._masks.shape[0] - 1}")
        allowed = self._masks[d] if healthy is None else self._masks[d] & healthy
        k = int(np.argmin(np.where(allowed, loads, np.inf)))
        if not allowed[k]:
            self.num_fallbacks += 1
            return _jsq(self.name, loads, healthy)
        return k

    def add_worker(self, *, like: int | None = None) -> int:
        """The new decoder joins ``like``'s domain groups (none without ``like``: it gets
        only fallbacks)."""
        k = super().add_worker(like=like)
        column = self._masks[:, like:like + 1] if like is not None else \
            np.zeros((self._masks.shape[0], 1), dtype=bool)
        self._masks = np.concatenate([self._masks, column], axis=1)
        self.groups_ = [np.flatnonzero(m) for m in self._masks]
        return k

    def remove_worker(self, worker: int) -> None:
        """A group left empty sends its domain to JSQ (a fallback)."""
        super().remove_worker(worker)
        self._masks = np.delete(self._masks, worker, axis=1)
        self.groups_ = [np.flatnonzero(m) for m in self._masks]
