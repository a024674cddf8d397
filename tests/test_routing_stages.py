"""Filters and pickers on their own (table-driven)."""

import numpy as np
import pytest

from eldr.routing import NoHealthyWorkerError, filters, pickers

T, F = True, False


@pytest.mark.parametrize("mask, expected", [
    (None, [T, T, T]), (np.array([T, F, T]), [T, F, T]),
])
def test_healthy(mask, expected):
    assert filters.healthy("p", 3, mask).tolist() == expected


def test_healthy_refuses_an_empty_pool():
    with pytest.raises(NoHealthyWorkerError):
        filters.healthy("p", 3, np.zeros(3, bool))


@pytest.mark.parametrize("loads, capacity, expected", [
    ([1, 2, 3], None, [T, T, T]),
    ([1, 2, 3], 2, [T, F, F]),
    ([2, 2, 3], 2, [T, T, T]),  # all full: the request waits somewhere, later stages decide
])
def test_with_capacity(loads, capacity, expected):
    got = filters.with_capacity(np.ones(3, bool), np.array(loads, float), capacity)
    assert got.tolist() == expected


@pytest.mark.parametrize("cand, sim, tau, expected", [
    ([T, T, T], [0.9, 0.85, 0.5], 0.1, [T, T, F]),
    ([F, T, T], [0.9, 0.85, 0.5], 0.1, [F, T, F]),  # the best is taken over candidates
    ([T, T, T], [0.9, 0.85, 0.5], 0.0, [T, F, F]),
    ([T, T, T], [0.9, 0.85, 0.5], 1.0, [T, T, T]),
])
def test_band(cand, sim, tau, expected):
    got = filters.band(np.array(cand), np.array(sim, np.float32), tau)
    assert got.tolist() == expected


@pytest.mark.parametrize("cand, score, tiebreak, expected", [
    ([T, T, T], [3, 1, 2], None, 1),
    ([T, F, T], [3, 1, 2], None, 2),
    ([T, T, T], [1, 1, 2], None, 0),  # tie → lowest index
    ([T, T, T], [1, 1, 2], [5, 4, 0], 1),  # tie → lowest tiebreak among the tied
])
def test_lowest(cand, score, tiebreak, expected):
    tb = None if tiebreak is None else np.array(tiebreak, float)
    assert pickers.lowest(np.array(cand), np.array(score, float), tb) == expected


@pytest.mark.parametrize("loads, slack, expected", [
    ([0, 1, 2], None, [T, T, T]),
    ([0, 1, 2], 0.0, [T, T, T]),  # mean 1: loads <= 1·1 + 1 = 2
    ([0, 0, 4], 0.0, [T, T, F]),  # mean 4/3: loads <= 2.33
    ([10, 12, 20], 0.1, [T, T, F]),  # mean 14: <= 16.4
    ([1, 1, 1], 0.0, [T, T, T]),
])
def test_bounded_load(loads, slack, expected):
    got = filters.bounded_load(np.ones(3, bool), np.array(loads, float), slack)
    assert got.tolist() == expected
