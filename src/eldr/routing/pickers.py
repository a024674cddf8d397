"""Pickers: the last scheduling stage, one decoder out of the scored candidates."""

from __future__ import annotations

import numpy as np

__all__ = ["lowest"]


def lowest(candidates: np.ndarray, score: np.ndarray,
           tiebreak: np.ndarray | None = None) -> int:
    """Candidate with the lowest ``score``; ties → lowest ``tiebreak``, then lowest index.

    ``candidates`` (K,) bool with at least one True; ``score``, ``tiebreak`` (K,) float.
    Deterministic (no randomness): the same state always gives the same decoder.
    """
    key = np.where(candidates, score, np.inf)
    best = key == key.min()
    if tiebreak is not None and np.count_nonzero(best) > 1:
        return int(np.argmin(np.where(best, tiebreak, np.inf)))
    return int(np.argmax(best))
