"""The tiny MoE and the real trace shipped as package data (``eldr.capture`` paths)."""

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import eldr
from eldr.capture import tiny_moe_dir, tiny_moe_prompt_trace_path, tiny_moe_trace_path
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


def test_shipped_prompt_trace_has_every_prompt():
    t = load(tiny_moe_prompt_trace_path())
    assert t.meta.source == "captured:transformers"
    assert t.domain_names == ("code", "legal", "math", "medical", "en", "fr", "ru", "de",
                              "es", "zh")
    assert np.bincount(t.domains).tolist() == [32, 32, 26, 32, 32, 32, 32, 32, 32, 32]
    assert t.prompt_token_ids is not None
    assert (t.prompt_lens >= 1).all() and t.prompt_lens.max() <= 256
    assert t.prompt_token_ids.shape == (int(t.prompt_lens.sum()),)
    vocab = json.loads((tiny_moe_dir() / "config.json").read_text())["vocab_size"]
    assert 0 <= t.prompt_token_ids.min() and t.prompt_token_ids.max() < vocab
    assert tiny_moe_prompt_trace_path().stat().st_size < 2.7 * 2**20


def _eldr_source_at(commit: str) -> str:
    """All ``src/eldr/**/*.py`` of ``commit``, concatenated (skips outside a git checkout
    that has the commit, e.g. an installed package or a shallow clone)."""
    repo = Path(eldr.__file__).resolve().parents[2]
    git = ["git", "-C", str(repo)]
    try:
        names = subprocess.run([*git, "ls-tree", "-r", "--name-only", commit, "--",
                                "src/eldr"], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"no git checkout with commit {commit}")
    wanted = "".join(f"{commit}:{n}\n" for n in names.stdout.split() if n.endswith(".py"))
    out = subprocess.run([*git, "cat-file", "--batch"], input=wanted.encode(),
                         check=True, capture_output=True)
    return out.stdout.decode("utf-8")


def test_prompt_trace_code_is_eldr_source():
    """The code prompts are eldr's own source at the commit data/traces/README.md names,
    not another project's: each decodes to text found verbatim in that commit's src/eldr."""
    tokenizers = pytest.importorskip("tokenizers")
    readme = (tiny_moe_prompt_trace_path().parent / "README.md").read_text()
    commit = re.search(r"at commit `([0-9a-f]{40})`", readme).group(1)
    source = _eldr_source_at(commit)
    tok = tokenizers.Tokenizer.from_file(str(tiny_moe_dir() / "tokenizer.json"))
    t = load(tiny_moe_prompt_trace_path())
    code = np.flatnonzero(t.domains == t.domain_names.index("code"))
    assert code.size == 32
    for r in code:
        # a 256-token cut can split a multi-byte character: its stub decodes to U+FFFD
        text = tok.decode(t.prompt_tokens(r).tolist()).rstrip("\ufffd")
        assert len(text) >= 120 and text in source, text


def test_missing_data_is_a_clear_error(monkeypatch, tmp_path):
    import eldr.capture as cap

    monkeypatch.setattr(cap, "_DATA", tmp_path)
    with pytest.raises(ValueError, match="tiny MoE is not installed"):
        cap.tiny_moe_dir()
    with pytest.raises(ValueError, match="trace is not installed"):
        cap.tiny_moe_trace_path()
    with pytest.raises(ValueError, match="prompt trace is not installed"):
        cap.tiny_moe_prompt_trace_path()
