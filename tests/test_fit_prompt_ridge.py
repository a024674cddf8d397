"""eldr.fit.prompt_ridge: the sparse kernel and the dual ridge of the linear models."""

import numpy as np

from eldr.fit.prompt_ridge import Design, ridge, ridge_fold_predictions


def test_the_sparse_kernel_equals_the_dense_products():
    """Frequent buckets go through a dense block, rare ones through pair expansion."""
    rng = np.random.default_rng(3)
    R, B = 50, 256
    x = np.zeros((R, B))
    x[:, :4] = rng.random((R, 4))  # in every row: dense columns
    for i in range(R):  # a few rare buckets per row
        x[i, rng.choice(np.arange(4, B), 6, replace=False)] = rng.random(6)
    rows = [(np.flatnonzero(x[i]), x[i, np.flatnonzero(x[i])]) for i in range(R)]
    d = Design(rows, B)
    assert set(range(4)) <= set(d.used[d.dense].tolist()) and d.sparse.size > 0
    d._PAIRS_PER_CHUNK = 7  # many chunks
    d._ENTRIES_PER_CHUNK = 5
    np.testing.assert_allclose(d.gram(), x @ x.T, rtol=1e-12, atol=1e-12)
    a = rng.random((R, 3))
    np.testing.assert_allclose(d.transpose_times(a), x.T @ a, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(d.mean_row(), x.mean(axis=0), rtol=1e-12, atol=1e-12)


def test_the_dual_ridge_is_the_primal_one():
    """ridge's stored weights are the primal solution of the same penalised least squares
    (features centred, penalty alpha times the mean squared norm of the centred rows), and
    the fold predictions of every alpha are its predictions on held-out rows."""
    rng = np.random.default_rng(5)
    R, B, n = 40, 64, 6
    x = np.zeros((R, B))
    for i in range(R):
        cols = rng.choice(B, 5, replace=False)
        x[i, cols] = rng.random(5)
    rows = [(np.flatnonzero(x[i]), x[i, np.flatnonzero(x[i])].astype(np.float32))
            for i in range(R)]
    x = np.zeros((R, B))
    for i, (b, w) in enumerate(rows):
        x[i, b] = w
    target = rng.random((R, n))
    mean = target.mean(axis=0)
    basis = np.linalg.qr(rng.standard_normal((n, 3)))[0].T  # (3, n) orthonormal rows
    yc, alpha = target - mean, 0.1
    idf = np.full(B, 2.0)
    weights, intercept, same = ridge((idf, rows), 6, yc, basis, mean, alpha)
    assert same is idf
    xc = x - x.mean(axis=0)
    scale = np.trace(xc @ xc.T) / R
    primal = np.linalg.solve(xc.T @ xc + alpha * scale * np.eye(B), xc.T @ (yc @ basis.T))
    np.testing.assert_allclose(weights, primal, atol=1e-8)
    np.testing.assert_allclose(intercept + (x @ weights) @ basis,
                               mean + (xc @ primal) @ basis, atol=1e-8)
    train, held = np.arange(30), np.arange(30, 40)
    k = Design(rows, B).gram()
    got = dict(ridge_fold_predictions(k, target, (0.1, 1.0), train, held,
                                      target[train].mean(axis=0), basis))
    assert set(got) == {0.1, 1.0} and got[0.1].shape == (10, 3)
    xt = x[train] - x[train].mean(axis=0)
    s = np.trace(xt @ xt.T) / 30
    w = np.linalg.solve(xt.T @ xt + 0.1 * s * np.eye(B),
                        xt.T @ ((target[train] - target[train].mean(axis=0)) @ basis.T))
    np.testing.assert_allclose(got[0.1], (x[held] - x[train].mean(axis=0)) @ w, atol=1e-8)
