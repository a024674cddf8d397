"""The real-routing models' presets (gpt-oss-20b, deepseek-v2-lite) from their public
configurations, the h100 hardware preset (H200 fits with b scaled by bandwidth), and the
simulator on a decode-only trace (no prefill routing)."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.sim import HARDWARE, SimConfig, get_hardware, moe_constants, simulate
from eldr.sim.tokens import TokenBank, prefill_bitsets
from eldr.traces.models import ALL_PRESETS, PRESETS, REAL_PRESETS, get_preset
from eldr.traces.trace import Trace, TraceMeta

BF16 = 2


def test_gpt_oss_20b_bytes_from_its_config():
    p = get_preset("gpt-oss-20b")
    assert (p.num_layers, p.num_experts, p.top_k, p.hidden_size,
            p.expert_intermediate_size, p.vocab_size) == (24, 32, 4, 2880, 2880, 201088)
    w = 3 * 2880 * 2880  # gate_up (fused) + down weights of one expert
    assert p.expert_bytes == w // 2 + w // 32 + 3 * 2880 * BF16  # MXFP4: 4.25 bits + biases
    assert p.expert_bytes * 8 / w == pytest.approx(4.25, abs=0.01)
    attn = (2880 * 64 * 64 + 64 * 64 + 2 * (2880 * 8 * 64 + 8 * 64) + 64 * 64 * 2880 + 2880
            + 64) * BF16
    assert p.attn_bytes_per_layer == attn
    assert p.dense_bytes_per_step == 24 * (attn + (2880 * 32 + 32) * BF16) + 201088 * 2880 * BF16
    # 12 full and 12 sliding (128-token window) layers, 8 KV heads of dim 64, bf16
    assert p.kv_bytes_per_token == 12 * 2 * 8 * 64 * BF16 == 24 * 1024
    assert p.sliding_window == 128 and p.kv_fixed_bytes_per_request == 3 * 2**20
    # the expert is GPT-OSS-120B's: its measured H200 constants carry over
    big = PRESETS["gpt-oss-120b"]
    assert p.expert_bytes == big.expert_bytes
    assert (p.moe_layer_fixed_us, p.moe_layer_per_expert_us) == (
        big.moe_layer_fixed_us, big.moe_layer_per_expert_us)


def test_deepseek_v2_lite_bytes_from_its_config():
    p = get_preset("deepseek-v2-lite")
    assert (p.num_layers, p.num_experts, p.top_k, p.hidden_size,
            p.expert_intermediate_size, p.vocab_size) == (26, 64, 6, 2048, 1408, 102400)
    assert p.expert_bytes == 3 * 2048 * 1408 * BF16
    # MLA: q_proj (16 heads x 192), kv_a (512 latent + 64 rope), kv_b, o_proj
    attn = (2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048) * BF16
    assert p.attn_bytes_per_layer == attn
    shared = 3 * 2048 * 2816 * BF16  # 2 shared experts of 1408 every token uses
    dense_ffn = 3 * 2048 * 10944 * BF16  # layer 0
    assert p.dense_bytes_per_step == (27 * attn + 26 * (2048 * 64 * BF16 + shared)
                                      + dense_ffn + 102400 * 2048 * BF16)
    assert p.kv_bytes_per_token == 27 * (512 + 64) * BF16  # MLA latent + rope key, 27 layers
    assert p.sliding_window is None
    assert p.moe_layer_fixed_us is None  # no measured fit: derived from bandwidth


@pytest.mark.parametrize(("name", "preset"), [
    ("openai/gpt-oss-20b", "gpt-oss-20b"), ("GPT-OSS-20B", "gpt-oss-20b"),
    ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-v2-lite"),
    ("esft-vanilla-lite", "deepseek-v2-lite"), ("deepseek-ai/ESFT-vanilla-lite",
                                                "deepseek-v2-lite"),
    ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"), ("tiny_moe", "tiny-moe"),
])
def test_presets_resolve_from_trace_model_names(name, preset):
    assert get_preset(name).name == preset


def test_real_presets_are_not_synthetic_presets():
    assert set(REAL_PRESETS) == {"gpt-oss-20b", "deepseek-v2-lite"}
    assert not set(REAL_PRESETS) & set(PRESETS)
    assert set(REAL_PRESETS) <= set(ALL_PRESETS)


def test_h100_scales_the_h200_per_expert_time_by_bandwidth_and_keeps_a():
    h100, h200 = HARDWARE["h100"], HARDWARE["h200"]
    assert (h100.hbm_bandwidth, h100.hbm_bytes) == (3.35e12, 80e9)
    assert (h100.peak_flops, h100.t_fixed_s) == (h200.peak_flops, h200.t_fixed_s)
    for name in ("qwen3-30b-a3b", "gpt-oss-20b"):
        a200, b200 = moe_constants(h200, get_preset(name))
        a100, b100 = moe_constants(h100, get_preset(name))
        assert a100 == a200
        assert b100 == pytest.approx(b200 * 4.8 / 3.35, rel=1e-12)
    # no fit: derived at the H100's bandwidth
    p = get_preset("deepseek-v2-lite")
    _, b = moe_constants(h100, p)
    _, b200 = moe_constants(h200, p)
    assert b == pytest.approx(b200 * 4.8 / 3.35, rel=1e-12)


def test_h100_steps_are_slower_than_h200_steps():
    from eldr.sim.steptime import StepModel

    t = {hw: StepModel(SimConfig(model="gpt-oss-20b", hardware=hw)).decode_step_time(
        24 * 20, 16 * 1000, 16 * 128) for hw in ("h100", "h200")}
    assert t["h100"] > t["h200"]


def test_hardware_fit_bandwidth_must_be_positive():
    from dataclasses import replace

    with pytest.raises(ValueError, match="fit_bandwidth"):
        replace(get_hardware("h100"), fit_bandwidth=0.0)


def _decode_only(R=24, L=24, E=32, k=4, seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 40, R)
    out = rng.integers(2, 30, R)
    topk = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)])
                     for _ in range(int((out - 1).sum()))]).astype(np.int16)
    req = np.repeat(np.arange(R), out - 1)
    counts = np.zeros((R, L, E), np.int32)
    np.add.at(counts, (req[:, None, None], np.arange(L)[None, :, None], topk), 1)
    return Trace(meta=TraceMeta(model="gpt-oss-20b", num_layers=L, num_experts=E, top_k=k),
                 prefill_counts=None, decode_counts=counts, prompt_lens=prompt.astype(np.int64),
                 output_lens=out.astype(np.int64), decode_topk=topk)


def test_decode_only_prefill_stand_in_is_min_of_e_and_k_times_prompt():
    t = _decode_only()
    bits = prefill_bitsets(t)
    n = np.bitwise_count(bits).sum(axis=2)  # (R, L)
    want = np.minimum(32, 4 * t.prompt_lens)
    assert (n == want[:, None]).all()


def test_simulator_runs_a_decode_only_trace():
    from eldr.routing import make_policy

    t = _decode_only()
    cfg = SimConfig(model="gpt-oss-20b", num_prefill=2, num_decode=2, qps=20.0,
                    warmup_s=0.5, duration_s=2.0, seed=1)
    res = simulate(t, cfg, make_policy("jsq", num_workers=2), tokens=TokenBank(t))
    assert res.summary()["requests"] > 0
    assert (res.requests["finishes"] == 1).all()
