"""A policy served before the model's shape is known: load balancing until ``bind``.

``eldr_cost`` needs nothing fitted, only the model's (L, E), which a router without an
artifact learns from the first prefill payload it reads. :class:`LazyShapePolicy` stands
in for such a policy (any registered policy whose only needs are the shape,
:attr:`eldr.routing.registry.PolicySpec.needs_only_shape`) until then: every request goes
to the least-loaded decoder and counts as a fallback, and its dispatch and release events
are dropped (the inner policy's footprint starts empty when it is built, and releasing an
id it never saw is a no-op). :meth:`LazyShapePolicy.bind` builds the inner policy; from
then on every call goes to it.

The registry builds these (:func:`eldr.routing.registry.make_unbound_policy`); this
module takes the factory it is given, so it imports no registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from eldr.routing.baselines import JSQPolicy
from eldr.routing.protocol import Decision, Policy, PolicyBase, RouteRequest

__all__ = ["LazyShapePolicy"]

log = logging.getLogger("eldr.routing")


class LazyShapePolicy(PolicyBase):
    """Policy ``name``, built by ``build(num_workers, num_layers, num_experts)`` once
    :meth:`bind` gives the shape; JSQ until then. ``inputs``: what the inner policy
    reads (the router asks the engines for it from the start)."""

    def __init__(self, name: str, num_workers: int, inputs: frozenset[str],
                 build: Callable[[int, int, int], Policy]) -> None:
        self.name = name
        self.inputs = frozenset(inputs)
        self._jsq = JSQPolicy(num_workers)
        self.num_workers = self._jsq.num_workers
        self._build = build
        self._unbound_fallbacks = 0
        self.inner: Policy | None = None  # the policy itself, once bound

    @property
    def num_fallbacks(self) -> int:  # type: ignore[override]
        inner = 0 if self.inner is None else self.inner.num_fallbacks
        return self._unbound_fallbacks + inner

    @property
    def shape(self) -> tuple[int, int] | None:  # type: ignore[override]
        """(L, E) of the bound policy, or None."""
        return None if self.inner is None else self.inner.shape

    @property
    def footprint(self):  # type: ignore[override]
        """The bound policy's footprint, or None."""
        return None if self.inner is None else self.inner.footprint

    @property
    def engine_footprint_shape(self) -> tuple[int, int] | None:  # type: ignore[override]
        """The bound policy's: engine footprints are taken from the bind on."""
        return None if self.inner is None else self.inner.engine_footprint_shape

    @property
    def priced_layers(self) -> np.ndarray | None:
        """The bound policy's priced layers (``eldr_cost`` on a subset), or None."""
        return None if self.inner is None else getattr(self.inner, "priced_layers", None)

    def observe_engine(self, worker: int, freq: np.ndarray, age_s: float,
                       max_age_s: float) -> bool:
        return self.inner is not None and self.inner.observe_engine(worker, freq, age_s,
                                                                    max_age_s)

    def bind(self, num_layers: int, num_experts: int) -> None:
        """Build the policy for this (L, E); later calls change nothing."""
        if self.inner is None:
            self.inner = self._build(self.num_workers, int(num_layers), int(num_experts))
            log.info("%s: model shape L=%d E=%d learned from the first prefill payload",
                     self.name, num_layers, num_experts)

    def decide(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> Decision:
        if self.inner is None:
            k = self._jsq.choose(request, loads, healthy)
            self._unbound_fallbacks += 1
            return Decision(k, fallback=True)
        return self.inner.decide(request, loads, healthy)

    def on_dispatch(self, request: RouteRequest, worker: int) -> None:
        if self.inner is not None:
            self.inner.on_dispatch(request, worker)

    def on_release(self, request_id: str, outcome) -> None:
        if self.inner is not None:
            self.inner.on_release(request_id, outcome)

    def add_worker(self, *, like: int | None = None) -> int:
        k = self._jsq.add_worker(like=like)
        if self.inner is not None:
            self.inner.add_worker(like=like)
        self.num_workers = self._jsq.num_workers
        return k

    def remove_worker(self, worker: int) -> None:
        self._jsq.remove_worker(worker)
        if self.inner is not None:
            self.inner.remove_worker(worker)
        self.num_workers = self._jsq.num_workers
