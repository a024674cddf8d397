"""Step-time model and the per-step expert union, vectorised with bitsets.

Decode step time of one worker (docs/method.md#step-time-model)::

    t_step = t_fixed + Σ_l (a + b · D_l) + dense_bytes / BW + Σ_req kv_bytes(ctx_req) / BW

``D_l`` = distinct experts the batch selects at MoE layer ``l`` in THIS step. With expert
parallelism over ``ep`` ranks the MoE layer waits for its slowest rank, so
``a + b · D_l`` becomes ``a + b · max_r D_{l,r}``, ``D_{l,r}`` = distinct experts of rank
``r`` under an expert placement. Dense weights and KV are split over ``tp`` GPUs.

Prefill (compute bound): ``t_fixed + Σ_l (a + b · D_l) + dense/BW + 2 · active_params ·
tokens / (peak_flops · mfu · tp)`` with ``D_l`` the union over the prefill batch (the
weight read of a large prefill batch is mostly hidden by compute, so the MoE term is a
lower bound that matters only for small batches). Attention FLOPs (quadratic in context)
are ignored: prompts here are ≤ 2k tokens, where they stay below ~5% of the GEMM FLOPs.

Expert sets are bitsets: ``W = ceil(E / 64)`` uint64 words per layer, expert ``e`` is bit
``e % 8`` of byte ``e // 8`` (little-endian bytes viewed as uint64). The union of a batch
is an OR-reduce over its tokens, ``D_l`` a popcount (``np.bitwise_count``, numpy ≥ 2).
"""

from __future__ import annotations

import numpy as np

from eldr.sim.config import SimConfig, get_hardware, moe_constants
from eldr.traces.models import get_preset

__all__ = [
    "StepModel",
    "deal_bitsets",
    "expert_bitsets",
    "num_words",
    "rank_masks",
    "routing_resources",
    "topk_bitsets",
    "union_distinct",
]


def num_words(num_experts: int) -> int:
    """uint64 words per layer bitset."""
    return -(-int(num_experts) // 64)


def _pack(flat_byte: np.ndarray, bit: np.ndarray, num_rows: int, L: int, W: int) -> np.ndarray:
    """OR bits into (num_rows, L, W) uint64; each (row, layer) must set each bit at most once."""
    nbytes = num_rows * L * W * 8
    out = np.bincount(flat_byte, weights=np.left_shift(1, bit).astype(np.float64),
                      minlength=nbytes)
    return out.astype(np.uint8).view(np.uint64).reshape(num_rows, L, W)


def topk_bitsets(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """(T, L, k) distinct expert ids per token and layer → (T, L, W) uint64 bitsets."""
    topk = np.asarray(topk)
    if topk.ndim != 3:
        raise ValueError(f"topk must be (T, L, k), got shape {topk.shape}")
    T, L, _ = topk.shape
    W = num_words(num_experts)
    e = topk.astype(np.int64)
    row = (np.arange(T, dtype=np.int64)[:, None] * L + np.arange(L)[None, :])[:, :, None]
    return _pack((row * (W * 8) + (e >> 3)).ravel(), (e & 7).ravel(), T, L, W)


def expert_bitsets(mask: np.ndarray) -> np.ndarray:
    """(..., L, E) bool → (..., L, W) uint64 bitsets (same bit layout as the tokens')."""
    mask = np.asarray(mask, dtype=bool)
    E = mask.shape[-1]
    W = num_words(E)
    if E != W * 64:
        pad = np.zeros((*mask.shape[:-1], W * 64 - E), dtype=bool)
        mask = np.concatenate([mask, pad], axis=-1)
    packed = np.packbits(mask, axis=-1, bitorder="little")  # (..., L, W*8) uint8
    return np.ascontiguousarray(packed).view(np.uint64)


def _ids_to_words(ids: np.ndarray, W: int, axis: int) -> np.ndarray:
    """Distinct expert ids along ``axis`` → their OR as W uint64 words (new last axis)."""
    e = ids.astype(np.uint64)
    word = e >> np.uint64(6)
    bit = np.left_shift(np.uint64(1), e & np.uint64(63))
    zero = np.uint64(0)
    return np.stack([np.bitwise_or.reduce(np.where(word == w, bit, zero), axis=axis)
                     for w in range(W)], axis=-1)


def deal_bitsets(counts: np.ndarray, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Per-token expert sets that reproduce a request's decode counts EXACTLY.

    ``counts`` (L, E) integers with every layer summing to ``k · num_tokens`` and no count
    above ``num_tokens`` (what a valid trace guarantees). Per layer, the ``k · T``
    selections sorted by expert are dealt round-robin to the T tokens (item i → token
    i mod T): an expert's ≤ T consecutive items land on distinct tokens, so every token
    gets k DISTINCT experts, and the counts are reproduced exactly. The tokens are then
    shuffled independently per layer (seeded). Each token's inclusion probability of
    expert e is exactly ``counts[l, e] / T``: the union over a batch (one token per
    request) has the right expectation without the variance of re-sampling.
    Returns (T, L, W) uint64.
    """
    counts = np.asarray(counts, dtype=np.int64)
    L, E = counts.shape
    T = int(num_tokens)
    W = num_words(E)
    if T == 0:
        return np.zeros((0, L, W), dtype=np.uint64)
    per_layer = counts.sum(axis=1)
    if (per_layer != per_layer[0]).any() or per_layer[0] % T:
        raise ValueError(f"deal_bitsets: layer counts {per_layer.tolist()} are not k x {T}")
    k = int(per_layer[0]) // T
    # (L, k, T): item j*T + t of a layer's sorted selections is slot j of token t
    items = np.repeat(np.tile(np.arange(E, dtype=np.int64), L), counts.ravel())
    items = items.reshape(L, k, T)
    perm = rng.permuted(np.tile(np.arange(T, dtype=np.int64), (L, 1)), axis=1)  # (L, T)
    items = np.take_along_axis(items, perm[:, None, :], axis=2)
    return np.ascontiguousarray(_ids_to_words(items, W, axis=1).transpose(1, 0, 2))


def union_distinct(rows: np.ndarray) -> np.ndarray:
    """(B, L, W) uint64 token bitsets → (L,) int64 distinct experts of the batch per layer."""
    if rows.shape[0] == 0:
        return np.zeros(rows.shape[1], dtype=np.int64)
    u = np.bitwise_or.reduce(rows, axis=0)
    return np.bitwise_count(u).sum(axis=-1, dtype=np.int64)


def rank_masks(placement: np.ndarray, ep: int) -> np.ndarray:
    """(L, E) int EP rank of each expert → (ep, L, W) uint64 bitsets of each rank's experts."""
    placement = np.asarray(placement)
    if placement.ndim != 2:
        raise ValueError(f"placement must be (L, E), got shape {placement.shape}")
    if placement.size and (placement.min() < 0 or placement.max() >= ep):
        raise ValueError(f"placement ranks must lie in [0, {ep}), got "
                         f"[{placement.min()}, {placement.max()}]")
    return expert_bitsets(placement[None, :, :] == np.arange(ep)[:, None, None])


class StepModel:
    """Resolved step-time constants of one :class:`SimConfig` (seconds, bytes)."""

    def __init__(self, config: SimConfig) -> None:
        model = get_preset(config.model)
        hw = get_hardware(config.hardware)
        a, b = moe_constants(hw, model)
        self.model = model
        self.num_layers = model.num_layers
        self.num_experts = model.num_experts
        self.a = a if config.moe_a_s is None else config.moe_a_s  # s per MoE layer
        self.b = b if config.moe_b_s is None else config.moe_b_s  # s per distinct expert
        self.t_fixed = hw.t_fixed_s if config.t_fixed_s is None else config.t_fixed_s
        bw = hw.hbm_bandwidth if config.hbm_bandwidth is None else config.hbm_bandwidth
        self.bandwidth = bw
        tp = config.tp
        self.dense_s = model.dense_bytes_per_step / (bw * tp)  # dense weight read per step
        self.kv_s_per_token = model.kv_bytes_per_token / (bw * tp)  # full-attention KV
        self.kv_sliding_s_per_token = model.kv_sliding_bytes_per_token / (bw * tp)
        self.sliding_window = model.sliding_window  # None: no sliding layers
        expert_params = 3 * model.hidden_size * model.expert_intermediate_size
        # bf16 dense weights: 2 bytes per parameter; routed: k experts per layer per token
        self.active_params = (model.dense_bytes_per_step / 2
                              + model.num_layers * model.top_k * expert_params)
        self.prefill_s_per_token = 2 * self.active_params / (hw.peak_flops * config.prefill_mfu
                                                             * tp)
        self.link_bandwidth = config.link_bandwidth
        self.link_latency = config.link_latency_s
        self.weight_bytes = (model.dense_bytes_per_step
                             + model.num_layers * model.num_experts * model.expert_bytes)
        gpus = max(config.tp, config.ep)
        if config.kv_capacity_tokens is not None:
            self.kv_capacity_bytes = float(config.kv_capacity_tokens * model.kv_bytes_per_token)
        else:
            self.kv_capacity_bytes = (config.gpu_memory_utilization * hw.hbm_bytes * gpus
                                      - self.weight_bytes)
            if self.kv_capacity_bytes <= 0:
                raise ValueError(
                    f"{model.name} weights ({self.weight_bytes / 1e9:.0f} GB) do not fit in "
                    f"{gpus} x {hw.name} at utilisation {config.gpu_memory_utilization}; "
                    "raise --tp/--ep")

    def moe_time(self, distinct_sum: int) -> float:
        """Σ_l (a + b·D_l) given Σ_l D_l (or Σ_l max_r D_{l,r} under EP)."""
        return self.num_layers * self.a + self.b * distinct_sum

    def decode_step_time(self, distinct_sum: int, ctx_tokens: int,
                         sliding_tokens: int = 0) -> float:
        """One decode step. ``ctx_tokens`` = Σ_req context; ``sliding_tokens`` =
        Σ_req min(context, window) for models with sliding-window layers."""
        return (self.t_fixed + self.moe_time(distinct_sum) + self.dense_s
                + ctx_tokens * self.kv_s_per_token
                + sliding_tokens * self.kv_sliding_s_per_token)

    def prefill_time(self, distinct_sum: int, num_tokens: int) -> float:
        """One prefill step computing ``num_tokens`` prompt tokens."""
        return (self.t_fixed + self.moe_time(distinct_sum) + self.dense_s
                + num_tokens * self.prefill_s_per_token)

    def kv_transfer_time(self, prompt_tokens: int) -> float:
        """KV of a prompt from a prefill to a decode worker: latency + bytes / link BW."""
        return self.link_latency + self.model.kv_bytes(prompt_tokens) / self.link_bandwidth


def routing_resources(config: SimConfig) -> dict:
    """What the cost policy (``eldr_cost``) needs to know of this cluster's step time.

    ``context_weight`` = decode-step seconds per context token (its KV read) divided by
    seconds per distinct expert (``b``); ``capacity`` = the running-batch limit.
    """
    sm = StepModel(config)
    return {"context_weight": sm.kv_s_per_token / sm.b,
            "capacity": float(min(config.max_batch, config.max_batch_tokens))}
