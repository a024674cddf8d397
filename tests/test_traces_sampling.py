"""eldr.traces.sampling: the count path's draws (inclusion probabilities, aggregate counts,
per-token top-k, approximate gate sums), checked on their own contracts."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.traces.sampling import aggregate_counts, approx_gate_sums, inclusion_probs, token_topk


def _logits(seed: int = 0, n: int = 40, e: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 1.5, size=(n, e)).astype(np.float32)


def test_inclusion_probabilities_are_probabilities_summing_to_k_and_follow_the_logits():
    z = _logits()
    pi = inclusion_probs(z, 4)
    assert pi.shape == z.shape and pi.dtype == np.float64
    assert np.all((pi >= 0) & (pi <= 1))
    np.testing.assert_allclose(pi.sum(axis=1), 4.0, atol=1e-8)
    order = np.argsort(z, axis=1)  # a larger logit is never less likely to be selected
    assert np.all(np.diff(np.take_along_axis(pi, order, axis=1), axis=1) >= -1e-12)


def test_aggregate_counts_hold_k_selections_per_token_and_at_most_one_per_expert():
    rng = np.random.default_rng(1)
    z = _logits(1)
    n = rng.integers(1, 300, size=z.shape[0])
    c = aggregate_counts(rng, inclusion_probs(z, 8), n, 8)
    assert c.dtype == np.int32 and c.shape == z.shape
    np.testing.assert_array_equal(c.sum(axis=1), 8 * n)
    assert np.all(c >= 0) and np.all(c <= n[:, None])


def test_token_topk_picks_k_distinct_experts_in_descending_logit_order():
    rng = np.random.default_rng(2)
    top, logits, probs = token_topk(rng, _logits(2, n=50), 6, with_gates=True, gate_scale=0.5)
    assert top.shape == (50, 6) and top.dtype == np.int16
    assert all(len(set(row)) == 6 for row in top.tolist())
    picked = np.take_along_axis(logits, top.astype(np.intp), axis=1)
    assert np.all(np.diff(picked, axis=1) <= 0)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert token_topk(rng, _logits(2), 6, with_gates=False)[1:] == (None, None)


def test_gate_sums_without_values_take_the_same_draws():
    z, n = _logits(3), np.full(40, 100)
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    probs, logits = approx_gate_sums(a, z, n, gate_scale=0.3)
    assert probs.shape == logits.shape == z.shape
    assert approx_gate_sums(b, z, n, gate_scale=0.3, values=False) == (None, None)
    assert a.random() == b.random()  # the stream after both is at the same place


@pytest.mark.parametrize("scale", [0.0, 0.6])
def test_gate_sums_refuse_a_scale_the_approximation_does_not_hold_for(scale):
    with pytest.raises(ValueError, match="gate_scale"):
        approx_gate_sums(np.random.default_rng(0), _logits(), np.full(40, 10), gate_scale=scale)
