"""eldr.fit.assign: exactness of the capacitated assignment against the Hungarian method,
its certifying prices, per-column capacities and warm starts."""

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from eldr.fit.assign import entropic_prices, repair, solve
from eldr.fit.cluster import balanced_assign


def _optimum(cost, caps):
    """Exact optimum by the Hungarian method on the (N, Σ caps) expanded matrix."""
    expanded = cost[:, np.repeat(np.arange(cost.shape[1]), caps)]
    rows, cols = linear_sum_assignment(expanded)
    return expanded[rows, cols].sum()


def _total(cost, labels):
    return cost[np.arange(cost.shape[0]), labels].sum()


def _unit(X):
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def _family(rng, kind, N, K):
    """1 − cos costs to K centres drawn from the rows, as in a K-means step."""
    if kind == "uniform":
        X = _unit(rng.standard_normal((N, 8)))
    elif kind == "blobs":  # well separated, unequal sizes
        centres = _unit(rng.standard_normal((K, 16)))
        X = _unit(centres[rng.choice(K, N, p=rng.dirichlet(np.ones(K)))]
                  + 0.05 * rng.standard_normal((N, 16)))
    elif kind == "gamma":  # a few skewed topics, d = 192
        proto = rng.gamma(0.3, size=(3, 192))
        X = _unit(proto[rng.choice(3, N, p=[0.6, 0.3, 0.1])] + rng.gamma(0.3, 0.3, (N, 192)))
    elif kind == "duplicates":  # few distinct rows, costs rounded: exact ties everywhere
        base = _unit(rng.random((max(2, N // 8), 12)) ** 3)
        X = base[rng.integers(0, base.shape[0], N)]
        return np.round(1.0 - X @ X[rng.choice(N, K, replace=False)].T, 2)
    else:
        raise ValueError(kind)
    return 1.0 - X @ X[rng.choice(N, K, replace=False)].T


def _check(cost, caps, labels, prices):
    """Capacities respected, optimal (Hungarian), and the prices certify it."""
    N, K = cost.shape
    assert labels.shape == (N,) and labels.dtype == np.int64
    counts = np.bincount(labels, minlength=K)
    assert (counts <= caps).all()
    opt = _optimum(cost, caps)
    tol = 1e-9 * max(1.0, abs(opt))
    assert abs(_total(cost, labels) - opt) <= tol
    reduced = cost + prices
    assert (reduced[np.arange(N), labels] <= reduced.min(1) + tol).all()
    assert prices.min() == 0.0
    assert (prices[counts < caps] <= tol).all()  # a column with room has the lowest price


FAMILIES = ["uniform", "blobs", "gamma", "duplicates"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_exact_on_instance_families(kind):
    rng = np.random.default_rng(FAMILIES.index(kind))
    for _ in range(6):
        N, K = int(rng.integers(40, 220)), int(rng.integers(2, 9))
        caps = np.full(K, -(-N // K) + int(rng.integers(0, 2)))
        cost = _family(rng, kind, N, K)
        labels, prices = balanced_assign(cost, caps, return_prices=True)
        _check(cost, caps, labels, prices)


@pytest.mark.parametrize("kind", FAMILIES)
def test_exact_with_unequal_capacities(kind):
    rng = np.random.default_rng(10 + FAMILIES.index(kind))
    for _ in range(5):
        N, K = int(rng.integers(40, 200)), int(rng.integers(2, 8))
        w = rng.uniform(0.2, 2.0, K)
        caps = np.floor(N * w / w.sum()).astype(np.int64)
        caps[rng.integers(K)] += N - caps.sum() + int(rng.integers(0, 3))
        cost = _family(rng, kind, N, K)
        labels, prices = balanced_assign(cost, caps, return_prices=True)
        _check(cost, caps, labels, prices)


def test_exact_on_a_thousand_rows():
    # Large enough for the price phase to run several ε stages before the repair.
    rng = np.random.default_rng(7)
    for kind in ("gamma", "blobs"):
        cost = _family(rng, kind, 1000, 16)
        caps = np.full(16, 63)
        labels, prices = balanced_assign(cost, caps, return_prices=True)
        _check(cost, caps, labels, prices)


@pytest.mark.parametrize("kind", FAMILIES)
def test_warm_start_gives_the_cold_optimum(kind):
    rng = np.random.default_rng(20 + FAMILIES.index(kind))
    N, K = 300, 6
    cost = _family(rng, kind, N, K)
    caps = np.full(K, N // K)
    cold, p_cold = balanced_assign(cost, caps, return_prices=True)
    for prices in (p_cold, p_cold + 0.05 * rng.standard_normal(K), rng.random(K),
                   np.zeros(K), 1e3 * rng.random(K)):
        warm, p_warm = balanced_assign(cost, caps, prices=prices, return_prices=True)
        assert _total(cost, warm) == pytest.approx(_total(cost, cold), rel=1e-12, abs=1e-12)
        _check(cost, caps, warm, p_warm)
    # The next K-means step's costs, warm-started from this step's prices.
    nxt = cost + 0.01 * rng.standard_normal(cost.shape)
    warm, p_warm = balanced_assign(nxt, caps, prices=p_cold, return_prices=True)
    _check(nxt, caps, warm, p_warm)


def test_prices_from_a_fitting_argmin_are_zero_and_certify():
    cost = np.random.default_rng(0).random((40, 4))
    labels, prices = balanced_assign(cost, 40, return_prices=True)
    np.testing.assert_array_equal(labels, cost.argmin(1))
    np.testing.assert_array_equal(prices, np.zeros(4))


def test_repair_is_exact_from_arbitrary_prices_with_ties():
    rng = np.random.default_rng(5)
    for trial in range(10):
        N, K = int(rng.integers(100, 250)), int(rng.integers(2, 7))
        caps = np.full(K, -(-N // K))
        cost = np.round(rng.random((N, K)), 1 + trial % 2)  # many exact ties
        cost[:, 0] -= 0.3
        labels, prices = repair(cost, caps, rng.random(K) * (trial % 3))
        _check(cost, caps, labels, prices)


def test_entropic_prices_bring_the_overfill_down():
    rng = np.random.default_rng(3)
    cost = _family(rng, "gamma", 2000, 16)
    caps = np.full(16, 125)
    before = np.maximum(np.bincount(cost.argmin(1), minlength=16) - caps, 0).sum()
    p = entropic_prices(cost, caps, target_excess=4)
    after = np.maximum(np.bincount((cost + p).argmin(1), minlength=16) - caps, 0).sum()
    assert before > 100 and after <= 4


def test_solve_handles_zero_capacity_columns_and_indifferent_rows():
    rng = np.random.default_rng(1)
    cost = rng.random((30, 4))
    caps = np.array([0, 10, 10, 10])
    labels, prices = solve(cost, caps)
    _check(cost, caps, labels, prices)
    flat = np.ones((30, 4))
    labels, prices = solve(flat, np.array([8, 8, 8, 8]))
    assert np.bincount(labels, minlength=4).max() <= 8
