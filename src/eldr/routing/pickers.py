"""Pickers: the last scheduling stage, one decoder out of the scored candidates."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["lowest", "lowest_listed"]

_SMALL = 64
"""Decoders up to which :func:`lowest` picks in Python lists (the router decides once per
request, the simulator once per arrival). Median µs per pick with a tiebreak, lists
against numpy's five calls, 2026-12-06 on the 2-core development machine: 2 decoders 1.5
against 6–13, 16: 2.0 against 6.4, 48: 4.8 against 6.4, 64: 8.3 against 9.5 (about even),
96: 10.1 against 6.4: past 64 the vectorised path is the faster one."""


def lowest(candidates: np.ndarray, score: np.ndarray,
           tiebreak: np.ndarray | None = None) -> int:
    """Candidate with the lowest ``score``; ties → lowest ``tiebreak``, then lowest index.

    ``candidates`` (K,) bool with at least one True; ``score``, ``tiebreak`` (K,) float.
    Deterministic (no randomness): the same state always gives the same decoder. Up to
    ``_SMALL`` decoders with finite scores the pick is made in Python, with the same
    result as the numpy path (``tests/test_routing_pickers.py`` checks every case);
    non-finite scores or tiebreaks go to the numpy path, whose rules they follow.
    """
    if len(score) <= _SMALL:
        picked = lowest_listed(candidates.tolist(), score.tolist(),
                               None if tiebreak is None else tiebreak.tolist())
        if picked is not None:
            return picked
    return _lowest_numpy(candidates, score, tiebreak)


def lowest_listed(candidates: list | None, score: list, tiebreak: list | None = None
                  ) -> int | None:
    """:func:`lowest` over Python lists (``candidates`` None: every decoder), or None
    where a value is not finite: the caller then asks :func:`lowest`, whose numpy path
    decides those (NaN compares unequal, and an infinite best ties with the
    non-candidates). For a policy that scores in Python floats (the cost policy on a few
    decoders): no arrays made only to be listed again."""
    best, at = math.inf, []
    for k, s in enumerate(score):
        if candidates is not None and not candidates[k]:
            continue
        if not math.isfinite(s):
            return None
        if s < best:
            best, at = s, [k]
        elif s == best:
            at.append(k)
    if not at:
        return None
    if tiebreak is None or len(at) == 1:
        return at[0]
    pick, low = at[0], tiebreak[at[0]]
    for k in at:
        t = tiebreak[k]
        if not math.isfinite(t):
            return None
        if t < low:
            pick, low = k, t
    return pick


def _lowest_numpy(candidates: np.ndarray, score: np.ndarray,
                  tiebreak: np.ndarray | None = None) -> int:
    key = np.where(candidates, score, np.inf)
    best = key == key.min()
    if tiebreak is not None and np.count_nonzero(best) > 1:
        return int(np.argmin(np.where(best, tiebreak, np.inf)))
    return int(np.argmax(best))
