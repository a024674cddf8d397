"""The tiny MoE and the real trace shipped as package data (``eldr.capture`` paths)."""

import json

import pytest

from eldr.capture import tiny_moe_dir, tiny_moe_trace_path
from eldr.traces.trace import load


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
    # The prompts are held-out text from Debian/PyPI packages: their token ids would let
    # anyone decode that third-party text, so the shipped trace carries routing only.
    assert t.prompt_token_ids is None
    assert tiny_moe_trace_path().stat().st_size < 2.5 * 2**20


def test_missing_data_is_a_clear_error(monkeypatch, tmp_path):
    import eldr.capture as cap

    monkeypatch.setattr(cap, "_DATA", tmp_path)
    with pytest.raises(ValueError, match="tiny MoE is not installed"):
        cap.tiny_moe_dir()
    with pytest.raises(ValueError, match="trace is not installed"):
        cap.tiny_moe_trace_path()
