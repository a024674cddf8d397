"""The tiny MoE and the real trace shipped as package data (``eldr.capture`` paths)."""

import json

import numpy as np
import pytest

from eldr.capture import tiny_moe_dir, tiny_moe_trace_path
from eldr.trace import load


def test_shipped_model_folder_is_servable():
    d = tiny_moe_dir()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (d / name).is_file(), name
    assert (d / "model.safetensors").stat().st_size < 16 * 2**20


def test_shipped_trace_matches_the_model():
    cfg = json.loads((tiny_moe_dir() / "config.json").read_text())
    t = load(tiny_moe_trace_path())
    assert t.meta.source == "captured:transformers"
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k) == (
        cfg["num_hidden_layers"], cfg.get("num_experts", cfg.get("num_local_experts")),
        cfg["num_experts_per_tok"])
    assert t.domain_names is not None and len(t.domain_names) >= 6
    assert t.prefill_topk is not None and t.decode_topk is not None
    assert t.prompt_token_ids.max() < cfg["vocab_size"]
    assert tiny_moe_trace_path().stat().st_size < 2.5 * 2**20


def test_shipped_trace_reproduces_from_the_model():
    """Re-capturing two shipped prompts with transformers gives the shipped routing."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from eldr.capture.hf import capture_ids

    t = load(tiny_moe_trace_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe_dir(),
                                                              dtype=torch.float32)
    rows = [0, t.num_requests - 1]
    n = int(t.output_lens[rows].min())
    res = capture_ids(model, [t.prompt_tokens(r) for r in rows], max_new_tokens=n,
                      progress=False)
    off = t.prefill_offsets
    for r, got in zip(rows, res, strict=True):
        np.testing.assert_array_equal(got.prefill_topk, t.prefill_topk[off[r]:off[r + 1]])


def test_missing_data_is_a_clear_error(monkeypatch, tmp_path):
    import eldr.capture as cap

    monkeypatch.setattr(cap, "_DATA", tmp_path)
    with pytest.raises(ValueError, match="tiny MoE is not installed"):
        cap.tiny_moe_dir()
    with pytest.raises(ValueError, match="trace is not installed"):
        cap.tiny_moe_trace_path()
