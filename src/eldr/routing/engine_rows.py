"""Decode engines' own live footprints, for the cost policy (issue 13, item 6).

With several router replicas in front of the same decoders each replica's
:class:`~eldr.routing.cost.ExpertFootprint` holds only the requests it dispatched itself:
its share. A decode engine sees all of its batch, and (with the eldr vLLM plugin) reports
per (layer, expert) the fraction ``f`` of its last W decode steps whose batch selected the
expert (docs/capture.md, ``GET /eldr/footprint``): ``1 − f`` estimates the probability
that a step of the whole batch misses it, the quantity ``S_d`` the policy keeps for its
share. The blend the policy routes on is

    S_eff = min(S_own, 1 − f)       elementwise, per decoder

the union of what this replica holds and what the engine saw covers at least either one; a
product would count this replica's own requests, which the engine also saw, twice.

A reading is only good for a while: the caller says how long (``max_age_s``: a few scrape
intervals in the router) and how old it already is (``age_s``). Past that, the row is
dropped and the policy routes on its own share alone, exactly as with no engine data; an
engine that went idle or unreachable therefore never pins its last busy footprint.

The same reading also stands in for the policy's *online* memory term (the "typical"
batch ``S̄_d = exp(n_d · m_d)``, ``m_d`` a decayed mean of ``log(1 − p)`` over the requests
this replica sent d), which each replica otherwise builds from its own dispatches only.
The engine's batch of ``n̄`` requests over its window gives ``1 − f ≈ Π_r (1 − p_r) ≈
exp(n̄ · m)``, so its per-request typical log-miss is ``m ≈ log(1 − f) / n̄``. The term
wants a batch of ``n_d`` = the router's load for d (running + waiting at the scrape plus
this replica's moves since: all replicas' requests), the same number it is weighed by;
and that load is also the router's only estimate of ``n̄`` (the footprint document
carries the window and its step count, no batch size). Dividing and multiplying by the
same ``n`` cancels: ``S̄_d = 1 − f``, the engine's own miss row, shared by every replica.
No logarithm is taken, so ``f = 1`` needs no clip (the batch selects that expert at every
step: x adds nothing there). Another divisor (the scrape-time running count) would only
scale the exponent by ``n_d / n̄``, off by this replica's moves since the scrape. By
Jensen the mean over steps of ``exp(n_t·m)`` is at least ``exp(n̄·m)``: with a batch that
varies over the window, ``1 − f`` slightly overstates the miss. A fitted memory (the
artifact's cluster profiles, identical in every replica already) is left alone; an
expired row falls back to the replica's own memory, exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

__all__ = ["EngineRows"]


class EngineRows:
    """Per decoder, the last engine-reported miss row ``1 − f`` (K, n) float32 and until
    when (on ``clock``) it holds; ``live`` (K,) marks the rows in force."""

    def __init__(self, num_workers: int, num_cells: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_cells = int(num_cells)
        self.miss = np.ones((num_workers, self.num_cells), dtype=np.float32)
        self.until = np.full(num_workers, -np.inf)  # clock time the row expires at
        self.live = np.zeros(num_workers, dtype=bool)
        self.clock = clock

    def observe(self, worker: int, freq: np.ndarray, age_s: float, max_age_s: float) -> bool:
        """Take decoder ``worker``'s reading ``freq`` (n,) (or (L, E)) in [0, 1], ``age_s``
        seconds old, valid ``max_age_s`` from when it was taken. False (nothing changed):
        wrong size, a value outside [0, 1] or not finite, or already too old."""
        f = np.asarray(freq, dtype=np.float32).reshape(-1)
        if f.shape != (self.num_cells,) or not np.isfinite(f).all() \
                or f.min(initial=0.0) < 0.0 or f.max(initial=0.0) > 1.0:
            return False
        if not (math.isfinite(age_s) and math.isfinite(max_age_s)
                and 0.0 <= age_s < max_age_s):
            return False
        np.subtract(np.float32(1.0), f, out=self.miss[worker])
        self.until[worker] = self.clock() - age_s + max_age_s
        self.live[worker] = True
        return True

    def expire(self) -> list[int]:
        """Drop the rows whose time is up; returns their decoders (to recompute)."""
        if not self.live.any():
            return []
        gone = np.flatnonzero(self.live & (self.until < self.clock()))
        self.live[gone] = False
        self.miss[gone] = 1.0
        return [int(d) for d in gone]

    def added_typical(self, own: np.ndarray, profile: np.ndarray) -> np.ndarray:
        """(K,) float32 experts ``profile`` (n,) adds to a batch of each decoder's usual
        requests: ``own`` (K,) (this replica's online memory) where no row is live, the
        engine's ``(1 − f) · profile`` where one is (module docstring). ``own`` is
        returned unchanged when none is live."""
        if not self.live.any():
            return own
        out = np.array(own, dtype=np.float32)
        out[self.live] = self.miss[self.live] @ profile.reshape(-1)
        return out

    def add_worker(self) -> None:
        """A new decoder: no reading yet."""
        self.miss = np.vstack([self.miss, np.ones((1, self.num_cells), dtype=np.float32)])
        self.until = np.append(self.until, -np.inf)
        self.live = np.append(self.live, False)

    def remove_worker(self, worker: int) -> None:
        """Drop decoder ``worker``'s row; the rows above move down one index with theirs."""
        self.miss = np.delete(self.miss, worker, axis=0)
        self.until = np.delete(self.until, worker)
        self.live = np.delete(self.live, worker)
