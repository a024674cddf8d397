"""Scorers: what each candidate decoder would cost (lower is better).

Load and locality are stateless functions of the decision's inputs; the marginal expert
cost keeps per-decoder state and lives in :mod:`eldr.routing.cost`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["load", "similarities"]


def load(loads: np.ndarray) -> np.ndarray:
    """(K,) in-flight requests per decoder: the load balancers' score."""
    return loads


def similarities(centroids: np.ndarray, vector: np.ndarray, policy_name: str) -> np.ndarray:
    """(K,) float32 ``c_k · vector``: the locality score (higher = closer)."""
    if vector.shape != (centroids.shape[1],):
        raise ValueError(f"{policy_name}: routing vector has shape {vector.shape}, "
                         f"expected ({centroids.shape[1]},)")
    return centroids @ vector
