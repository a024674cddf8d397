"""Filters: which decoders may take a request (llm-d's first scheduling stage).

A filter maps the candidate mask (K,) bool to a narrower one; it never empties a
non-empty mask unless the request cannot be served at all (health). Each is a small pure
function so it can be tested on its own.
"""

from __future__ import annotations

import numpy as np

from eldr.routing._common import _no_healthy

__all__ = ["band", "bounded_load", "healthy", "with_capacity"]


def healthy(policy_name: str, num_workers: int, mask: np.ndarray | None) -> np.ndarray:
    """(K,) bool of healthy decoders; raises NoHealthyWorkerError when there is none."""
    if mask is None:
        return np.ones(num_workers, dtype=bool)
    if not mask.any():
        raise _no_healthy(policy_name)
    return mask


def with_capacity(candidates: np.ndarray, loads: np.ndarray, capacity: float | None
                  ) -> np.ndarray:
    """Candidates with a free batch slot (``loads < capacity``); all of them when none has.

    A decoder at its batch limit makes a new request wait for a slot: queueing no
    locality can repay. When every candidate is full the request has to wait somewhere,
    and the later stages decide where.
    """
    if capacity is None:
        return candidates
    free = candidates & (loads < capacity)
    return free if free.any() else candidates


def band(candidates: np.ndarray, similarities: np.ndarray, tau: float) -> np.ndarray:
    """The locality band: candidates whose similarity is within ``tau`` of the best one.

    ``similarities`` (K,) float32 ``c_k · s``; the best is taken over candidates only.
    """
    sim = np.where(candidates, similarities, -np.inf)
    return sim >= sim.max() - np.float32(tau)


def bounded_load(candidates: np.ndarray, loads: np.ndarray, slack: float | None
                 ) -> np.ndarray:
    """Candidates whose load is at most ``(1 + slack)`` × the candidates' mean load, + 1.

    Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018):
    affinity may choose among decoders, but none may run more than a bounded share above
    the mean, so the slowest decoder (the p99) cannot drift away from the rest. The + 1
    keeps every decoder eligible while loads are small (a batch of one is never a
    reason to refuse). Never empties the mask: the least-loaded candidate always passes.
    """
    if slack is None:
        return candidates
    mean = float(loads[candidates].mean())
    return candidates & (loads <= (1.0 + slack) * mean + 1.0)
