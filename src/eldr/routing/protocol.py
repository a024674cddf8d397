"""The routing contract shared by the simulator and the HTTP router.

A decode-routing policy answers one question at the prefill→decode handoff — which of
``K`` decode workers (indices ``0..K-1``) gets this request — and is told what became of
every request it placed, so it can keep per-decoder state (the marginal-cost policy keeps
each decoder's expected expert footprint):

    d = policy.choose(request, loads, healthy)       # or policy.decide(...) for the why
    policy.on_dispatch(request, d)                   # the request was sent to d
    ...
    policy.on_release(request.request_id, "completed")   # or "failed" / "cancelled"

``loads`` (K,) are in-flight requests per decoder (any non-negative numbers), owned by the
caller (:class:`eldr.routing.loads.LoadTracker` in the router, arrays in the simulator) so
that engine-reported loads can overwrite them; ``healthy`` (K,) bool or ``None``.

Every policy releases each dispatched request exactly once; releasing an unknown id is a
no-op (a request may be released by a timeout and again by its late completion).

The decoder set may change while requests run (the router's elastic pool, docs/serve.md):

    k = policy.add_worker(like=j)      # a new decoder at index K; it may start as j's twin
    policy.remove_worker(k)            # decoder k is gone; indices above k move down by one

A policy that can use the decode engines' own footprints (``eldr_cost``; docs/serve.md,
``--engine-footprint``) names their (L, E) in ``engine_footprint_shape`` (None: it does
not want them) and takes each reading with ``observe_engine(k, freq, age_s, max_age_s)``.

A policy built for a model names its (L, E) in ``shape`` (None: it reads no expert counts,
or does not know them yet) and, when it keeps one, its per-decoder expected footprint in
``footprint`` (an :class:`eldr.routing.cost.ExpertFootprint`, else None). A policy built
before the model's shape was known (:mod:`eldr.routing.lazy`) takes it with
``bind(num_layers, num_experts)``; for every other policy ``bind`` changes nothing.

A decoder is removed only once drained (every request placed there released); a policy
forgets whatever it still held for it, so nothing leaks if one was not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from eldr.routing._common import NoHealthyWorkerError

__all__ = [
    "OUTCOMES",
    "REQUEST_INPUTS",
    "Decision",
    "NoHealthyWorkerError",
    "Outcome",
    "Policy",
    "PolicyBase",
    "RouteRequest",
]

Outcome = Literal["completed", "failed", "cancelled"]
OUTCOMES: tuple[str, ...] = ("completed", "failed", "cancelled")
# what a policy may read from a request; a policy declares the ones it needs in `inputs`
REQUEST_INPUTS: tuple[str, ...] = ("signature", "profile", "domain", "decode_pattern")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may look at when routing one request to a decode worker."""

    request_id: str  # caller's id; keys the policy's per-request state, never branched on
    signature: np.ndarray | None = None  # (d,) float32 unit row (SignatureEncoder), or None
    domain: int | None = None  # oracle domain label (the `domain` policy only), or None
    decode_pattern: np.ndarray | None = None  # (d',) unit row of true decode counts (oracle)
    # (L, E) float32 predicted per-token inclusion probability of each expert (cost policy)
    profile: np.ndarray | None = None
    context_tokens: int = 0  # prompt tokens whose KV the decoder will read every step


@dataclass(frozen=True, slots=True)
class Decision:
    """One routing decision and what it was based on (logs and metrics)."""

    worker: int  # chosen decoder index
    fallback: bool = False  # routed by load because a declared input was missing
    band_size: int | None = None  # |B| of the locality band, when the policy has one
    cost: float | None = None  # the chosen decoder's marginal cost, when the policy has one


@runtime_checkable
class Policy(Protocol):
    """A decode-routing policy (see the module docstring for the event contract)."""

    name: str  # registry name, e.g. "eldr"
    num_workers: int  # K
    num_fallbacks: int  # requests routed by load because their routing input was missing
    inputs: frozenset[str]  # request fields it reads (subset of REQUEST_INPUTS)

    def decide(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> Decision: ...

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int: ...

    def on_dispatch(self, request: RouteRequest, worker: int) -> None: ...

    def on_release(self, request_id: str, outcome: Outcome) -> None: ...

    def add_worker(self, *, like: int | None = None) -> int: ...

    def remove_worker(self, worker: int) -> None: ...

    # (L, E) of the model it routes for, or None (reads no expert counts / not bound yet)
    shape: tuple[int, int] | None
    footprint: object | None  # its per-decoder expected footprint (ExpertFootprint), or None
    engine_footprint_shape: tuple[int, int] | None  # (L, E) of engine footprints it takes

    def bind(self, num_layers: int, num_experts: int) -> None: ...

    def observe_engine(self, worker: int, freq: np.ndarray, age_s: float,
                       max_age_s: float) -> bool: ...


class PolicyBase:
    """Defaults for stateless policies: ``choose`` = ``decide().worker``, no-op events."""

    name: str
    num_workers: int
    num_fallbacks: int = 0
    inputs: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs) -> None:
        # the two defaults below are defined through each other: a subclass that overrides
        # neither would recurse forever on its first request, so it is refused here
        super().__init_subclass__(**kwargs)
        if cls.decide is PolicyBase.decide and cls.choose is PolicyBase.choose:
            raise TypeError(f"{cls.__name__} must override decide() (returning a Decision) "
                            f"or choose() (returning a worker index): PolicyBase's defaults "
                            f"each call the other")

    def decide(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> Decision:
        return Decision(self.choose(request, loads, healthy))

    def choose(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> int:
        return self.decide(request, loads, healthy).worker

    def on_dispatch(self, request: RouteRequest, worker: int) -> None:
        """The request was sent to ``worker`` (stateless policies ignore it)."""

    def on_release(self, request_id: str, outcome: Outcome) -> None:
        """The request left its decoder (stateless policies ignore it)."""

    # (L, E) of the engine footprints the policy routes on; None: it takes none
    engine_footprint_shape: tuple[int, int] | None = None
    shape: tuple[int, int] | None = None  # (L, E) it routes for; None: reads no counts
    footprint: object | None = None  # per-decoder expected footprint, when it keeps one

    def bind(self, num_layers: int, num_experts: int) -> None:
        """The model's (L, E), learned after construction (a policy built without it,
        :mod:`eldr.routing.lazy`); others already have theirs: nothing changes."""

    def observe_engine(self, worker: int, freq: np.ndarray, age_s: float,
                       max_age_s: float) -> bool:
        """Decoder ``worker``'s engine reports ``freq`` (L, E): the share of its last decode
        steps whose batch selected each expert, ``age_s`` seconds old, to be dropped
        ``max_age_s`` after it was taken. Returns whether it was used (here: never)."""
        return False

    def add_worker(self, *, like: int | None = None) -> int:
        """Append a decoder; returns its index (the old ``num_workers``). ``like``: an
        existing decoder whose fitted state (centroid, cluster profile) the new one copies,
        splitting that decoder's cluster until a refit; load-only policies ignore it."""
        if like is not None:
            self._index(like)
        self.num_workers += 1
        return self.num_workers - 1

    def remove_worker(self, worker: int) -> None:
        """Drop decoder ``worker``; decoders above it move down one index. The last decoder
        cannot be removed (``ValueError``)."""
        self._index(worker)
        if self.num_workers == 1:
            raise ValueError(f"{self.name}: the last decode worker cannot be removed")
        self.num_workers -= 1

    def _index(self, worker) -> int:
        if isinstance(worker, bool) or not isinstance(worker, (int, np.integer)) \
                or not 0 <= worker < self.num_workers:
            raise ValueError(f"{self.name}: worker {worker!r} out of range "
                             f"[0, {self.num_workers})")
        return int(worker)
