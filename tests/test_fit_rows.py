"""eldr.fit.rows.unit_rows: the one row normalisation of the encoder, K-means and the
locality analysis (three copies before, two of them by np.linalg.norm)."""

import numpy as np
import pytest

from eldr.fit import cluster, signature
from eldr.fit.artifact import fit_artifact
from eldr.fit.rows import unit_rows


def _by_linalg_norm(x):
    """What K-means, the locality analysis and the token TF-IDF computed before."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def test_rows_are_unit_and_zero_rows_stay_zero():
    x = np.array([[3.0, 4.0], [0.0, 0.0], [0.0, -2.0]], dtype=np.float32)
    u = unit_rows(x)
    assert u.dtype == np.float64 and u.shape == (3, 2)
    np.testing.assert_array_equal(u, [[0.6, 0.8], [0.0, 0.0], [0.0, -1.0]])
    assert x[0, 0] == 3.0  # the input is not touched
    with pytest.raises(ValueError, match=r"expects \(N, d\) rows"):
        unit_rows(np.ones(3))


def test_rows_agree_with_the_replaced_norms_but_for_rounding():
    rng = np.random.default_rng(0)
    for d in (8, 96, 1536):
        x = rng.random((300, d)) * rng.integers(0, 3, (300, 1))  # a third of rows zero
        u, v = unit_rows(x), _by_linalg_norm(x)
        np.testing.assert_allclose(u, v, rtol=1e-14, atol=0)
        assert np.array_equal(u == 0, v == 0)


def test_a_fit_is_unchanged_by_the_fold(monkeypatch):
    """The routing artifact of the shipped tiny-MoE trace: the same layer mask, ρ,
    cluster sizes and float32 centroids whether the encoder and K-means normalise with
    :func:`unit_rows` or with the norms K-means used before."""
    from eldr.capture import tiny_moe_trace_path
    from eldr.traces.trace import load

    trace = load(tiny_moe_trace_path())

    def fit():
        return fit_artifact(trace, worker_ids=["a", "b", "c", "d"], n_init=1,
                            prompt_predictor=False)

    now = fit()
    monkeypatch.setattr(signature, "unit_rows", _by_linalg_norm)
    monkeypatch.setattr(cluster, "unit_rows", _by_linalg_norm)
    before = fit()
    np.testing.assert_array_equal(now.layers, before.layers)
    assert now.rho == pytest.approx(before.rho, abs=1e-12)
    assert now.fit_stats["cluster_sizes"] == before.fit_stats["cluster_sizes"]
    np.testing.assert_array_equal(now.centroids, before.centroids)
