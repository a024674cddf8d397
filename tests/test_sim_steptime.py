"""Step-time formula, bitset unions and the exact deal of decode counts."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.sim import SimConfig
from eldr.sim.steptime import (
    StepModel,
    deal_bitsets,
    expert_bitsets,
    rank_masks,
    topk_bitsets,
    union_distinct,
)
from eldr.traces.models import get_preset

L, E = 48, 128


def _tokens(*expert_lists) -> np.ndarray:
    """(B, L, k) ids: token b selects expert_lists[b] at every layer."""
    return np.stack([np.tile(np.asarray(x, np.int16), (L, 1)) for x in expert_lists])


def test_union_counts_distinct_experts_per_layer():
    bits = topk_bitsets(_tokens(range(8), range(4, 12), range(120, 128)), E)
    assert bits.shape == (3, L, 2) and bits.dtype == np.uint64
    np.testing.assert_array_equal(union_distinct(bits), np.full(L, 20))
    np.testing.assert_array_equal(union_distinct(bits[:1]), np.full(L, 8))
    np.testing.assert_array_equal(union_distinct(bits[:0]), np.zeros(L))


def test_topk_and_mask_bitsets_agree():
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((5, L, E)), axis=2)[:, :, :8]
    mask = np.zeros((5, L, E), bool)
    np.put_along_axis(mask, ids, True, axis=2)
    np.testing.assert_array_equal(topk_bitsets(ids, E), expert_bitsets(mask))


def test_decode_step_time_equals_formula_h200_qwen():
    sm = StepModel(SimConfig())
    m = get_preset("qwen3-30b-a3b")
    D = union_distinct(topk_bitsets(_tokens(range(8), range(4, 12)), E)).sum()  # 48 x 12
    ctx = 100 + 37
    expected = (2.0e-3 + 48 * (18.7e-6 + 2.22e-6 * 12) + m.dense_bytes_per_step / 4.8e12
                + ctx * m.kv_bytes_per_token / 4.8e12)
    assert D == 576
    assert sm.decode_step_time(int(D), ctx) == pytest.approx(expected, rel=1e-12)


def test_overrides_and_tp():
    sm = StepModel(SimConfig(t_fixed_s=0.0, moe_a_s=1e-5, moe_b_s=1e-6, hbm_bandwidth=1e12, tp=2,
                             ep=2))
    m = sm.model
    assert sm.decode_step_time(100, 10) == pytest.approx(
        48e-5 + 100e-6 + (m.dense_bytes_per_step + 10 * m.kv_bytes_per_token) / 2e12)


def test_mi300x_constants_follow_the_papers_ratio():
    sm = StepModel(SimConfig(hardware="mi300x"))
    assert (sm.a + 128 * sm.b) / (sm.a + 16 * sm.b) == pytest.approx(4.7)
    assert sm.t_fixed == 3.0e-3


def test_deal_reproduces_counts_exactly_with_distinct_experts():
    rng = np.random.default_rng(1)
    T, k = 37, 8
    ids = np.argsort(rng.random((T, L, E)) ** 3 * rng.random(E), axis=2)[:, :, :k]
    counts = np.zeros((L, E), np.int64)
    for layer in range(L):
        counts[layer] = np.bincount(ids[:, layer].ravel(), minlength=E)
    bits = deal_bitsets(counts, T, np.random.default_rng(2))
    per_token = np.bitwise_count(bits).sum(axis=2)
    np.testing.assert_array_equal(per_token, np.full((T, L), k))  # k distinct per token
    unpacked = np.unpackbits(bits.view(np.uint8), axis=2, bitorder="little")  # (T, L, E)
    np.testing.assert_array_equal(unpacked.sum(axis=0), counts)


def test_deal_rejects_inconsistent_counts():
    with pytest.raises(ValueError, match="not k x"):
        deal_bitsets(np.ones((2, 4), np.int64) * np.array([[1], [2]]), 2,
                     np.random.default_rng(0))


def test_rank_masks_give_per_rank_distinct():
    placement = np.tile(np.arange(E) // 32, (L, 1))  # 4 ranks, contiguous
    masks = rank_masks(placement, 4)
    u = np.bitwise_or.reduce(topk_bitsets(_tokens(range(8), range(30, 38)), E), axis=0)
    per_rank = np.bitwise_count(u[None] & masks).sum(axis=-1)
    np.testing.assert_array_equal(per_rank[:, 0], [10, 6, 0, 0])
    with pytest.raises(ValueError, match="ranks"):
        rank_masks(placement, 2)
