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

from eldr._policy_common import (
    NoHealthyWorkerError,
    _check,
    _check_num_workers,
    _jsq,
    _no_healthy,
)
from eldr.baselines import (
    DomainPolicy,
    JSQPolicy,
    P2CPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    domain_groups,
)

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
