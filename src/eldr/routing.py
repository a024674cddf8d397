"""Online decode routing: the ELDR locality band and the load-only baselines.

Every policy answers one question at the prefill→decode handoff: which of ``K`` decode
workers (indices ``0..K-1``; the artifact maps them to worker ids) gets this request.

API::

    policy = make_policy("eldr", num_workers=K, centroids=C, tau=0.1, random_state=0)
    tracker = LoadTracker(K)       # eldr.loads
    k = policy.choose(RouteRequest("r1", signature=s), tracker.loads, tracker.healthy)
    tracker.on_dispatch(k)     # ... and tracker.on_complete(k) when the decode finishes

``choose(request, loads, healthy) -> int`` takes the live loads ``(K,)`` (in-flight
requests per worker; any non-negative numbers) and an optional health mask ``(K,) bool``
(``None`` = all healthy). Policies never choose an unhealthy worker and raise
:class:`NoHealthyWorkerError` when none is healthy. They hold no load state themselves:
loads live in a :class:`eldr.loads.LoadTracker` (HTTP router) or in the caller (simulator), so one
policy serves both. ``choose`` does O(K·d) work on small arrays and allocates nothing
larger than ``(K,)``: the simulator calls it millions of times.

Policies (registry :data:`POLICIES`, extended with :func:`register_policy`):

- ``random``: uniform over healthy workers (seeded).
- ``round_robin``: the next healthy worker after the last one chosen.
- ``jsq``: join the shortest queue; ties → lowest index.
- ``p2c``: power of two choices: two distinct healthy workers drawn uniformly (seeded),
  the less loaded one wins; ties → lower index.
- ``domain``: oracle domain label → a fixed group of workers sized by the domain's share
  of the calibration trace (largest remainder, ≥ 1 worker each when K ≥ #domains;
  otherwise domains are packed onto workers greedily by share); JSQ inside the group.
- ``eldr``: the locality band (design.md §4). ``sim_k = s · c_k`` over healthy k,
  ``s* = max sim``, band ``B = {k : sim_k ≥ s* − τ}``; inside B the least-loaded worker
  wins; ties → highest ``sim_k``, then lowest index (deterministic, no randomness).
  τ = 0 is top-1 (nearest centroid); τ ≥ 2 is pure JSQ for any unit vectors, and τ ≥ 1
  already is for non-negative representations (counts, probabilities), where all
  cosines lie in [0, 1].
- ``eldr_top1``: ``eldr`` with τ = 0.
- ``oracle_signature``: the ``eldr`` band rule on the request's TRUE decode pattern
  (``RouteRequest.decode_pattern``) against centroids of decode patterns (passed as
  ``centroids``): the upper bound a perfect signature could reach. Evaluation only.

Fallbacks: a request without the vector a policy needs (``signature`` for ``eldr``,
``decode_pattern`` for ``oracle_signature``, ``domain`` for ``domain``) is routed by JSQ
and counted in ``policy.num_fallbacks``. An all-zero signature (a request with no expert
selections) gives every worker sim 0, so the band holds all of them: JSQ, not a fallback.

Similarities are computed in float32 (``centroids`` are stored float32, C-contiguous) and
compared in float32; a band edge exactly at ``s* − τ`` is decided by float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "POLICIES",
    "DomainPolicy",
    "EldrPolicy",
    "JSQPolicy",
    "NoHealthyWorkerError",
    "P2CPolicy",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "decode_patterns",
    "domain_groups",
    "make_policy",
    "register_policy",
]

_RANDOM_BUFFER = 4096  # uniforms drawn per refill: one Generator call per 4096 decisions


class NoHealthyWorkerError(RuntimeError):
    """No decode worker is healthy: the request cannot be routed (HTTP router → 503)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may look at when routing one request to a decode worker."""

    request_id: str  # caller's id, for logs only; policies never branch on it
    signature: np.ndarray | None  # (d,) float32 unit row (SignatureEncoder.transform), or None
    domain: int | None = None  # oracle domain label (the `domain` policy only), or None
    decode_pattern: np.ndarray | None = None  # (d',) unit row of true decode counts (oracle)


@runtime_checkable
class Policy(Protocol):
    """A decode-routing policy. ``choose`` returns a healthy worker index in ``[0, K)``."""

    name: str  # registry name, e.g. "eldr"
    num_workers: int  # K
    num_fallbacks: int  # requests routed by JSQ because their routing input was missing

    def choose(
        self, request: RouteRequest, loads: np.ndarray, healthy: np.ndarray | None = None
    ) -> int: ...


# -- shared helpers -------------------------------------------------------------------------
def _check(policy_name: str, num_workers: int, loads: np.ndarray,
           healthy: np.ndarray | None) -> None:
    if loads.shape != (num_workers,):
        raise ValueError(f"{policy_name}: loads has shape {loads.shape}, "
                         f"expected ({num_workers},)")
    if healthy is not None and healthy.shape != (num_workers,):
        raise ValueError(f"{policy_name}: healthy has shape {healthy.shape}, "
                         f"expected ({num_workers},)")


def _no_healthy(policy_name: str) -> NoHealthyWorkerError:
    return NoHealthyWorkerError(f"{policy_name}: no healthy decode worker to route to")


def _jsq(policy_name: str, loads: np.ndarray, healthy: np.ndarray | None) -> int:
    """Least-loaded healthy worker; ties → lowest index."""
    if healthy is None:
        return int(np.argmin(loads))
    key = np.where(healthy, loads, np.inf)
    k = int(np.argmin(key))
    if not healthy[k]:
        raise _no_healthy(policy_name)
    return k


class _Uniforms:
    """Seeded uniforms in [0, 1), drawn in blocks so one decision costs no Generator call."""

    __slots__ = ("_buf", "_pos", "_rng")

    def __init__(self, random_state: int | np.random.Generator | None) -> None:
        self._rng = np.random.default_rng(random_state)
        self._buf = self._rng.random(_RANDOM_BUFFER).tolist()
        self._pos = 0

    def next(self) -> float:
        if self._pos == _RANDOM_BUFFER:
            self._buf = self._rng.random(_RANDOM_BUFFER).tolist()
            self._pos = 0
        u = self._buf[self._pos]
        self._pos += 1
        return u


def _check_num_workers(num_workers: int) -> int:
    if not isinstance(num_workers, (int, np.integer)) or num_workers <= 0:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    return int(num_workers)


# -- load-only baselines --------------------------------------------------------------------
class RandomPolicy:
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


class RoundRobinPolicy:
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


class JSQPolicy:
    """Join the shortest queue: least-loaded healthy worker, ties → lowest index."""

    def __init__(self, num_workers: int, *, name: str = "jsq") -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int:
        _check(self.name, self.num_workers, loads, healthy)
        return _jsq(self.name, loads, healthy)


class P2CPolicy:
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


class DomainPolicy:
    """Oracle domain label → its worker group (:func:`domain_groups`), JSQ inside it.

    A request without a domain, or whose group has no healthy worker, goes to JSQ over
    all healthy workers and counts as a fallback.
    """

    def __init__(self, num_workers: int, *, domain_shares: np.ndarray,
                 name: str = "domain") -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0
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


# -- ELDR locality band ---------------------------------------------------------------------
class EldrPolicy:
    """Locality band: least-loaded worker among those whose centroid is within τ of best.

    ``centroids`` (K, d) float (stored float32, C-contiguous); row k is worker k's
    centroid. ``use_decode_pattern=True`` makes this the ``oracle_signature`` policy: it
    routes ``request.decode_pattern`` instead of ``request.signature``.
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
        self._dim = c.shape[1]

    def similarities(self, vector: np.ndarray) -> np.ndarray:
        """(K,) float32 ``c_k · vector`` for a (d,) vector."""
        if vector.shape != (self._dim,):
            raise ValueError(f"{self.name}: routing vector has shape {vector.shape}, "
                             f"expected ({self._dim},)")
        return self.centroids @ vector

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int:
        _check(self.name, self.num_workers, loads, healthy)
        v = request.decode_pattern if self.use_decode_pattern else request.signature
        if v is None:
            self.num_fallbacks += 1
            return _jsq(self.name, loads, healthy)
        sim = self.similarities(v)
        if healthy is not None:
            sim = np.where(healthy, sim, -np.inf)
        top = sim.max()
        if top == -np.inf:
            raise _no_healthy(self.name)
        key = np.where(sim >= top - self.tau, loads, np.inf)  # load inside the band
        # least load; among equal loads the highest sim; argmax picks the lowest index
        return int(np.argmax(np.where(key == key.min(), sim, -np.inf)))


# -- helpers for the oracle -----------------------------------------------------------------
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


# -- registry -------------------------------------------------------------------------------
PolicyFactory = Callable[..., Policy]
_REGISTRY: dict[str, PolicyFactory] = {}
POLICIES: Mapping[str, PolicyFactory] = MappingProxyType(_REGISTRY)  # name → factory


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Add a policy. ``factory(*, num_workers, centroids, tau, domain_shares,
    random_state) -> Policy`` receives every option of :func:`make_policy` and uses the
    ones it needs. A name can be registered once."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"policy {name!r} is already registered")
    _REGISTRY[name] = factory


def make_policy(name: str, *, num_workers: int, centroids: np.ndarray | None = None,
                tau: float = 0.1, domain_shares: np.ndarray | None = None,
                random_state: int | np.random.Generator | None = None) -> Policy:
    """Build the registered policy ``name`` for ``num_workers`` decode workers.

    ``centroids`` (K, d): signature centroids (``eldr``, ``eldr_top1``) or decode-pattern
    centroids (``oracle_signature``). ``tau``: band width (``eldr``, ``oracle_signature``).
    ``domain_shares`` (D,): calibration share of each domain (``domain``).
    ``random_state``: seed for ``random`` and ``p2c``.
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(_REGISTRY)}")
    return factory(num_workers=num_workers, centroids=centroids, tau=tau,
                   domain_shares=domain_shares, random_state=random_state)


def _make_domain(*, num_workers, domain_shares, **_) -> DomainPolicy:
    if domain_shares is None:
        raise ValueError("domain: domain_shares are required (share of each domain label)")
    return DomainPolicy(num_workers, domain_shares=domain_shares)


register_policy("random", lambda *, num_workers, random_state, **_:
                RandomPolicy(num_workers, random_state=random_state))
register_policy("round_robin", lambda *, num_workers, **_: RoundRobinPolicy(num_workers))
register_policy("jsq", lambda *, num_workers, **_: JSQPolicy(num_workers))
register_policy("p2c", lambda *, num_workers, random_state, **_:
                P2CPolicy(num_workers, random_state=random_state))
register_policy("domain", _make_domain)
register_policy("eldr", lambda *, num_workers, centroids, tau, **_:
                EldrPolicy(num_workers, centroids=centroids, tau=tau))
register_policy("eldr_top1", lambda *, num_workers, centroids, **_:
                EldrPolicy(num_workers, centroids=centroids, tau=0.0, name="eldr_top1"))
register_policy("oracle_signature", lambda *, num_workers, centroids, tau, **_:
                EldrPolicy(num_workers, centroids=centroids, tau=tau,
                           use_decode_pattern=True, name="oracle_signature"))
