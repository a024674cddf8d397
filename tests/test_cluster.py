import itertools

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

import eldr.fit.assign as assign_impl
from eldr.fit.cluster import BalancedKMeans, balanced_assign


def _optimum(cost, cap):
    """Exact optimum by the Hungarian method on the (N, K·cap) expanded matrix."""
    expanded = np.repeat(cost, cap, axis=1)
    rows, cols = linear_sum_assignment(expanded)
    return expanded[rows, cols].sum()


def _total(cost, labels):
    return cost[np.arange(cost.shape[0]), labels].sum()


def _random_cost(rng, N, K, kind):
    if kind == "uniform":
        return rng.random((N, K))
    if kind == "ties":  # few distinct values: many exact ties
        return rng.integers(0, 3, (N, K)).astype(np.float64)
    if kind == "skewed":  # one column attracts most rows
        cost = rng.random((N, K))
        cost[:, 0] -= 0.5
        return cost
    return rng.random((N, K)) * 1e6 - 3e5  # large magnitudes, negative values


@pytest.mark.parametrize("seed, kind", list(enumerate(["uniform", "ties", "skewed", "large"])))
def test_balanced_assign_is_optimal_on_small_instances(seed, kind):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        N, K = int(rng.integers(1, 30)), int(rng.integers(1, 6))
        cap = int(rng.integers(-(-N // K), -(-N // K) + 3))
        cost = _random_cost(rng, N, K, kind)
        labels = balanced_assign(cost, cap)
        assert labels.dtype == np.int64 and labels.shape == (N,)
        assert np.bincount(labels, minlength=K).max() <= cap
        opt = _optimum(cost, cap)
        assert abs(_total(cost, labels) - opt) <= 1e-9 * max(1.0, abs(opt))


def test_balanced_assign_matches_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(40):
        N, K = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        cap = -(-N // K)
        cost = rng.random((N, K))
        best = min(
            sum(cost[i, k] for i, k in enumerate(lab))
            for lab in itertools.product(range(K), repeat=N)
            if max(np.bincount(lab, minlength=K)) <= cap
        )
        assert _total(cost, balanced_assign(cost)) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_repair_is_exact_from_any_prices_and_small_pools():
    # The exact phase must not depend on how good the entropic prices were.
    rng = np.random.default_rng(5)
    for trial in range(12):
        N, K = int(rng.integers(150, 300)), int(rng.integers(2, 7))
        cap = -(-N // K)
        cost = rng.random((N, K))
        cost[:, :2] -= 0.3
        if trial % 2:
            cost = np.round(cost, 2)  # ties
        prices = rng.random(K) * 0.2 if trial % 3 else np.zeros(K)
        labels, _ = assign_impl.repair(cost, np.full(K, cap), prices)
        assert np.bincount(labels, minlength=K).max() <= cap
        opt = _optimum(cost, cap)
        assert abs(_total(cost, labels) - opt) <= 1e-9 * max(1.0, abs(opt))


def test_balanced_assign_returns_plain_argmin_when_it_fits():
    rng = np.random.default_rng(0)
    cost = rng.random((40, 4))
    cap = int(np.bincount(cost.argmin(1), minlength=4).max())
    np.testing.assert_array_equal(balanced_assign(cost, cap), cost.argmin(1))
    ties = np.zeros((6, 3))  # all tied: argmin picks column 0, fits capacity 6
    np.testing.assert_array_equal(balanced_assign(ties, 6), np.zeros(6, dtype=np.int64))


def test_balanced_assign_larger_instance_against_lp():
    rng = np.random.default_rng(11)
    N, K = 600, 8
    cost = rng.random((N, K)) ** 3
    cost[: N // 2, 0] -= 0.4  # half the rows want column 0
    labels = balanced_assign(cost)
    assert np.bincount(labels, minlength=K).max() <= N // K
    opt = _optimum(cost, N // K)
    assert abs(_total(cost, labels) - opt) <= 1e-9 * abs(opt)


def test_balanced_assign_is_deterministic():
    cost = np.random.default_rng(2).random((500, 7))
    cost[:, 3] -= 0.3
    np.testing.assert_array_equal(balanced_assign(cost), balanced_assign(cost.copy()))


def test_balanced_assign_rejects_bad_input():
    with pytest.raises(ValueError, match="do not fit"):
        balanced_assign(np.zeros((10, 3)), 3)
    with pytest.raises(ValueError, match="NaN or Inf"):
        balanced_assign(np.array([[0.0, np.nan]]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        balanced_assign(np.array([[0.0, np.inf]]))
    with pytest.raises(ValueError, match="shape"):
        balanced_assign(np.zeros(4))
    with pytest.raises(ValueError, match="capacity"):
        balanced_assign(np.zeros((2, 2)), 1.5)
    with pytest.raises(ValueError, match="capacity"):
        balanced_assign(np.zeros((2, 2)), np.array([1, 1, 1]))
    with pytest.raises(ValueError, match="do not fit"):
        balanced_assign(np.zeros((5, 2)), np.array([2, 2]))
    with pytest.raises(ValueError, match="prices"):
        balanced_assign(np.zeros((2, 2)), prices=np.array([0.0, np.nan]))
    with pytest.raises(ValueError, match="prices"):
        balanced_assign(np.zeros((2, 2)), prices=np.zeros(3))
    assert balanced_assign(np.zeros((0, 3))).shape == (0,)


# -- BalancedKMeans --------------------------------------------------------------------------
def _planted(rng, sizes, d=24, noise=0.15):
    """Unit rows around len(sizes) random non-negative directions; returns (X, truth)."""
    centers = rng.random((len(sizes), d)) ** 4
    truth = np.repeat(np.arange(len(sizes)), sizes)
    X = centers[truth] + noise * rng.random((truth.size, d))
    return X / np.linalg.norm(X, axis=1, keepdims=True), truth


def _same_partition(a, b):
    pairs = set(zip(a.tolist(), b.tolist(), strict=True))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_kmeans_recovers_planted_balanced_clusters():
    X, truth = _planted(np.random.default_rng(0), [30, 30, 30, 30])
    km = BalancedKMeans(4, random_state=0).fit(X)
    assert _same_partition(km.labels_, truth)
    assert np.bincount(km.labels_).max() <= 30
    np.testing.assert_allclose(np.linalg.norm(km.cluster_centers_, axis=1), 1.0)
    cos = np.einsum("ij,ij->i", X, km.cluster_centers_[km.labels_])
    assert km.inertia_ == pytest.approx(np.sum(1 - cos))
    assert km.n_iter_ >= 1
    np.testing.assert_array_equal(km.predict(X), km.labels_)


def test_kmeans_is_deterministic_per_seed():
    X, _ = _planted(np.random.default_rng(1), [50, 20, 20, 10], noise=0.6)
    a = BalancedKMeans(4, random_state=7).fit(X)
    b = BalancedKMeans(4, random_state=7).fit(X)
    np.testing.assert_array_equal(a.labels_, b.labels_)
    np.testing.assert_array_equal(a.cluster_centers_, b.cluster_centers_)


def test_vanilla_is_unequal_on_skewed_data_and_balanced_is_not():
    X, _ = _planted(np.random.default_rng(2), [120, 40, 20, 20])
    vanilla = BalancedKMeans(4, balanced=False, random_state=0).fit(X)
    balanced = BalancedKMeans(4, random_state=0).fit(X)
    assert np.bincount(vanilla.labels_, minlength=4).max() > 60
    assert np.bincount(balanced.labels_, minlength=4).max() <= 50
    assert balanced.inertia_ >= vanilla.inertia_ - 1e-9  # balance costs locality


def test_kmeans_handles_zero_rows_and_custom_capacity():
    X, _ = _planted(np.random.default_rng(3), [10, 10, 10])
    X = np.vstack([X, np.zeros((3, X.shape[1]))])
    km = BalancedKMeans(3, capacity=12, random_state=0).fit(X)
    assert np.bincount(km.labels_, minlength=3).max() <= 12
    assert np.isfinite(km.cluster_centers_).all()


def test_kmeans_validation_and_fitted_check():
    X = np.random.default_rng(0).random((5, 3))
    with pytest.raises(ValueError, match="not fitted"):
        BalancedKMeans(2).predict(X)
    with pytest.raises(ValueError, match="exceeds"):
        BalancedKMeans(6).fit(X)
    with pytest.raises(ValueError, match="do not fit"):
        BalancedKMeans(2, capacity=2).fit(X)
    with pytest.raises(ValueError, match="NaN"):
        BalancedKMeans(2).fit(np.full((5, 3), np.nan))
    with pytest.raises(ValueError, match="n_init"):
        BalancedKMeans(2, n_init=0).fit(X)
    km = BalancedKMeans(2, random_state=0).fit(X)
    with pytest.raises(ValueError, match="features"):
        km.predict(np.ones((2, 4)))


def test_balanced_assign_massive_ties():
    # Every row indifferent: any balanced split is optimal; the repair deals ties in bulk.
    labels = balanced_assign(np.ones((3000, 16)))
    assert np.bincount(labels, minlength=16).max() == 188
    # Half the rows prefer column 3 by 0.5, the rest are indifferent: only 188 fit there.
    cost = np.ones((3000, 16))
    cost[:1500, 3] = 0.5
    labels = balanced_assign(cost)
    assert np.bincount(labels, minlength=16).max() == 188
    assert _total(cost, labels) == 188 * 0.5 + (3000 - 188)
