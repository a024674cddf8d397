"""eldr.routing.pickers: the Python path of ``lowest`` picks what the numpy path picks."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.routing import pickers


def _cases(rng: np.random.Generator, n: int):
    """Random (candidates, score, tiebreak) with ties, non-finite values and dtypes the
    policies pass (float64 costs, float32 similarities, int or float loads)."""
    for _ in range(n):
        k = int(rng.integers(1, 12))
        cand = rng.random(k) < 0.7
        cand[rng.integers(k)] = True  # at least one candidate, as the callers guarantee
        score = rng.integers(0, 4, k).astype(rng.choice([np.float64, np.float32, np.int64]))
        if rng.random() < 0.3 and score.dtype.kind == "f":
            score[rng.integers(k)] = rng.choice([np.inf, -np.inf, np.nan])
        tb = None
        if rng.random() < 0.7:
            tb = rng.integers(0, 3, k).astype(np.float64)
            if rng.random() < 0.2:
                tb[rng.integers(k)] = rng.choice([np.inf, np.nan])
        yield cand, score, tb


def test_the_list_path_agrees_with_numpy_on_ties_and_non_finite_values():
    rng = np.random.default_rng(0)
    for cand, score, tb in _cases(rng, 5000):
        assert pickers.lowest(cand, score, tb) == pickers._lowest_numpy(cand, score, tb), \
            (cand, score, tb)


def test_ties_go_to_the_lowest_tiebreak_then_the_lowest_index():
    cand = np.array([True, True, True, False])
    score = np.array([2.0, 1.0, 1.0, 0.0])  # the non-candidate's 0 never counts
    assert pickers.lowest(cand, score) == 1
    assert pickers.lowest(cand, score, np.array([0.0, 5.0, 3.0, 0.0])) == 2
    assert pickers.lowest(cand, score, np.array([0.0, 3.0, 3.0, 0.0])) == 1


@pytest.mark.parametrize("k", [pickers._SMALL, pickers._SMALL + 1])
def test_both_sides_of_the_size_switch_pick_the_same(k):
    rng = np.random.default_rng(k)
    for _ in range(200):
        cand = rng.random(k) < 0.5
        cand[0] = True
        score = rng.integers(0, 5, k).astype(float)
        tb = rng.random(k)
        assert pickers.lowest(cand, score, tb) == pickers._lowest_numpy(cand, score, tb)


def test_the_listed_pick_takes_every_decoder_without_a_mask_and_declines_non_finite():
    rng = np.random.default_rng(11)
    for cand, score, tb in _cases(rng, 3000):
        s, t = score.tolist(), None if tb is None else tb.tolist()
        every = np.ones(len(score), dtype=bool)
        want = pickers._lowest_numpy(every, score, tb)
        got = pickers.lowest_listed(None, s, t)
        assert got is None or got == want, (score, tb)
        if np.isfinite(score).all() and (tb is None or np.isfinite(tb).all()):
            assert got == want
        got = pickers.lowest_listed(cand.tolist(), s, t)
        assert got is None or got == pickers._lowest_numpy(cand, score, tb)
    assert pickers.lowest_listed(None, [1.0, float("nan")]) is None
