"""Model presets: docs/method.md#model-facts numbers, derived bytes, lookup and validation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from eldr.traces.models import PRESETS, ModelPreset, get_preset


def test_four_presets_with_routing_shapes_from_the_design_table():
    shapes = {name: (p.num_layers, p.num_experts, p.top_k, p.hidden_size,
                     p.expert_intermediate_size) for name, p in PRESETS.items()}
    assert shapes == {
        "qwen3-30b-a3b": (48, 128, 8, 2048, 768),
        "gpt-oss-120b": (36, 128, 4, 2880, 2880),
        "gemma-4-26b-a4b": (30, 128, 8, 2816, 704),
        "qwen3-235b-a22b": (94, 128, 8, 4096, 1536),
    }


@pytest.mark.parametrize(("name", "mb"), [
    ("qwen3-30b-a3b", 9.44), ("gpt-oss-120b", 13.2), ("gemma-4-26b-a4b", 11.9),
    ("qwen3-235b-a22b", 37.7),
])
def test_expert_bytes_match_the_design_table(name, mb):
    assert round(PRESETS[name].expert_bytes / 1e6, 2 if mb < 10 else 1) == mb


def test_expert_bytes_exact_for_bf16_and_mxfp4():
    assert PRESETS["qwen3-30b-a3b"].expert_bytes == 3 * 2048 * 768 * 2
    # 3 x 2880^2 weights at 4 bits + one scale byte per 32 weights + bf16 biases
    w = 3 * 2880 * 2880
    assert PRESETS["gpt-oss-120b"].expert_bytes == w // 2 + w // 32 + 3 * 2880 * 2


@pytest.mark.parametrize(("name", "kib", "fixed_mib"), [
    ("qwen3-30b-a3b", 96, 0), ("gpt-oss-120b", 36, 4.5), ("gemma-4-26b-a4b", 20, 200),
    ("qwen3-235b-a22b", 188, 0),
])
def test_kv_bytes_match_the_design_table(name, kib, fixed_mib):
    p = PRESETS[name]
    assert p.kv_bytes_per_token == kib * 1024
    assert p.kv_fixed_bytes_per_request == fixed_mib * 2**20


def test_kv_bytes_caps_sliding_layers_at_the_window():
    p = PRESETS["gpt-oss-120b"]  # window 128
    assert p.kv_bytes(0) == 0
    assert p.kv_bytes(100) == 100 * (p.kv_bytes_per_token + p.kv_sliding_bytes_per_token)
    assert p.kv_bytes(1000) == 1000 * p.kv_bytes_per_token + p.kv_fixed_bytes_per_request
    assert PRESETS["qwen3-30b-a3b"].kv_bytes(10) == 10 * 96 * 1024
    with pytest.raises(ValueError, match="context_tokens"):
        p.kv_bytes(-1)


def test_dense_bytes_exceed_attention_and_include_the_lm_head():
    for p in PRESETS.values():
        assert p.dense_bytes_per_step > p.num_layers * p.attn_bytes_per_layer
        assert p.dense_bytes_per_step > p.vocab_size * p.hidden_size  # LM head >= 1 B/param
    q = PRESETS["qwen3-30b-a3b"]
    assert q.attn_bytes_per_layer == (2048 * 4096 * 2 + 2 * 2048 * 512) * 2
    assert q.dense_bytes_per_step == 2_459_435_008


def test_moe_layer_fits_from_the_design():
    assert PRESETS["qwen3-30b-a3b"].moe_layer_fixed_us == 18.7
    assert PRESETS["qwen3-30b-a3b"].moe_layer_per_expert_us == 2.22


def test_get_preset_is_case_insensitive_and_passes_presets_through():
    p = get_preset("Qwen3-30B-A3B")
    assert p is PRESETS["qwen3-30b-a3b"]
    assert get_preset(p) is p


def test_get_preset_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="qwen3-30b-a3b, gpt-oss-120b") as exc:
        get_preset("mixtral")
    assert "'mixtral'" in str(exc.value)


@pytest.mark.parametrize(("field", "value", "msg"), [
    ("num_layers", 0, "num_layers"),
    ("top_k", 200, "top_k"),
    ("expert_bytes", 1.5, "expert_bytes"),
    ("sliding_window", 0, "sliding_window"),
])
def test_invalid_presets_are_refused(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        replace(PRESETS["qwen3-30b-a3b"], **{field: value})


def test_sliding_window_needs_its_bytes():
    with pytest.raises(ValueError, match="together"):
        replace(PRESETS["qwen3-30b-a3b"], sliding_window=128)
    assert isinstance(PRESETS["gemma-4-26b-a4b"], ModelPreset)


# -- the shipped tiny MoE ---------------------------------------------------------------------
def _tiny_config() -> dict:
    import json

    from eldr.capture import tiny_moe_dir

    return json.loads((tiny_moe_dir() / "config.json").read_text())


def test_tiny_moe_preset_is_derived_from_its_config_json():
    c, p = _tiny_config(), get_preset("tiny-moe")
    h, hd, bf16 = c["hidden_size"], c["head_dim"], 2
    q, kv, L, E = c["num_attention_heads"], c["num_key_value_heads"], \
        c["num_hidden_layers"], c["num_local_experts"]
    assert (p.num_layers, p.num_experts, p.top_k, p.hidden_size, p.vocab_size) == (
        L, E, c["num_experts_per_tok"], h, c["vocab_size"])
    assert p.expert_bytes == 3 * h * c["moe_intermediate_size"] * bf16 == 24_576
    attn = (2 * h * q * hd + 2 * h * kv * hd) * bf16
    assert p.attn_bytes_per_layer == attn
    assert c["tie_word_embeddings"]  # the LM head is the embedding matrix, read once
    assert p.dense_bytes_per_step == L * (attn + h * E * bf16) + c["vocab_size"] * h * bf16
    assert p.kv_bytes_per_token == L * 2 * kv * hd * bf16 == 1_536
    assert p.max_context_tokens == c["max_position_embeddings"]
    assert p.sliding_window is None and c["sliding_window"] is None


def test_tiny_moe_resolves_from_its_trace_name_and_stays_out_of_the_paper_presets():
    from eldr.capture import tiny_moe_trace_path
    from eldr.traces.models import ALL_PRESETS, TINY_MOE
    from eldr.traces.trace import load

    assert get_preset(load(tiny_moe_trace_path()).meta.model) is TINY_MOE  # "tiny_moe"
    assert "tiny-moe" in ALL_PRESETS and "tiny-moe" not in PRESETS  # no synth calibration


def test_tiny_moe_step_constants_are_derived_from_the_expert_bytes():
    from eldr.sim import get_hardware, moe_constants
    from eldr.sim.config import _ETA, A_OVER_B_MI300X

    p = get_preset("tiny-moe")
    for hw in ("h200", "mi300x"):
        h = get_hardware(hw)
        a, b = moe_constants(h, p)
        assert b == pytest.approx(p.expert_bytes / (h.hbm_bandwidth * _ETA), rel=1e-12)
        assert a == pytest.approx(A_OVER_B_MI300X * b, rel=1e-12)


def test_tiny_moe_round_trip_simulates_the_shipped_trace_and_every_request_finishes():
    import numpy as np

    from eldr.capture import tiny_moe_trace_path
    from eldr.routing import make_policy
    from eldr.sim import SimConfig, simulate
    from eldr.traces.trace import load

    trace = load(tiny_moe_trace_path())
    cfg = SimConfig(model=trace.meta.model, num_prefill=2, num_decode=4, qps=50.0,
                    warmup_s=1.0, duration_s=5.0, seed=3)
    n = trace.num_requests
    times = np.arange(n) / 50.0  # every captured request once
    res = simulate(trace, cfg, make_policy("jsq", num_workers=4),
                   arrivals=(times, np.arange(n)))
    rec = res.requests
    np.testing.assert_array_equal(rec["finishes"], np.ones(n))
    np.testing.assert_array_equal(rec["tokens_out"], trace.output_lens)
    assert np.isfinite(rec["t_last"]).all() and res.summary()["tpot_median_ms"] > 0
