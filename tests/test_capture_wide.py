"""The wide tiny MoE: zero-padded experts, the cached folder, and the same function."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from eldr.capture import tiny_moe_dir, wide, wide_engine_bytes, wide_tiny_moe_dir
from eldr.capture.wide import check_width, default_cache_dir, pad_expert_tensor

PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "wide_prompts.jsonl"


def _header(path: Path) -> dict:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n))


def _tensor_bits(path: Path) -> dict[str, np.ndarray]:
    return {name: np.array(bits) for name, _, bits in wide._tensors(path)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{width: folder} for the two widths the tests build."""
    root = tmp_path_factory.mktemp("wide")
    return {w: wide_tiny_moe_dir(w, root) for w in (64, 256)}


@pytest.mark.parametrize("width", [0, 16, 31, 48, 100, 8192 + 32, -64])
def test_bad_widths_are_refused_naming_the_width(width, tmp_path):
    with pytest.raises(ValueError, match=rf"multiple of 32 in \[32, 8192\].*got {width}$"):
        wide_tiny_moe_dir(width, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("width", ["64", 64.0, True, None])
def test_non_int_widths_are_refused(width):
    with pytest.raises(ValueError, match="width must be an int"):
        check_width(width)


def test_width_32_is_the_shipped_model(tmp_path):
    assert wide_tiny_moe_dir(32, tmp_path) == tiny_moe_dir()
    assert not any(tmp_path.iterdir())


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ELDR_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ELDR_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "eldr"


def test_config_fields_and_copied_files(built):
    folder = built[256]
    assert folder.name == "tiny-moe-w256"
    src = json.loads((tiny_moe_dir() / "config.json").read_text())
    got = json.loads((folder / "config.json").read_text())
    assert got["moe_intermediate_size"] == 256
    assert {k: v for k, v in got.items() if k != "moe_intermediate_size"} == \
        {k: v for k, v in src.items() if k != "moe_intermediate_size"}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / name).read_bytes() == (tiny_moe_dir() / name).read_bytes()
    manifest = json.loads((folder / "eldr-wide.json").read_text())
    assert manifest["width"] == 256 and manifest["source_intermediate"] == 32
    assert manifest["source_sha256"] == wide._sha256(tiny_moe_dir() / "model.safetensors")
    assert manifest["files"]["model.safetensors"] == wide._sha256(folder / "model.safetensors")
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_experts_are_zero_padded_and_the_rest_is_the_same(built):
    src_h, wide_h = (_header(p / "model.safetensors") for p in (tiny_moe_dir(), built[64]))
    assert set(src_h) == set(wide_h)
    src, got = (_tensor_bits(p / "model.safetensors") for p in (tiny_moe_dir(), built[64]))
    num_padded = 0
    for name, a in src.items():
        b = got[name]
        assert wide_h[name]["dtype"] == src_h[name]["dtype"] == "BF16"
        if ".mlp.experts." not in name:
            assert np.array_equal(a, b), name
        elif name.endswith("down_proj.weight"):
            assert b.shape == (128, 64)
            assert np.array_equal(b[:, :32], a) and not b[:, 32:].any(), name
            num_padded += 1
        else:
            assert b.shape == (64, 128)
            assert np.array_equal(b[:32], a) and not b[32:].any(), name
            num_padded += 1
    assert num_padded == 6 * 64 * 3


def test_fused_expert_tensors_are_padded_per_half():
    E, H, N, W = 3, 4, 2, 6  # experts, hidden, expert width, padded width
    gate_up = np.arange(E * 2 * N * H, dtype=np.float32).reshape(E, 2 * N, H) + 1
    out = pad_expert_tensor("model.layers.0.mlp.experts.gate_up_proj", gate_up,
                            intermediate=N, width=W)
    assert out.shape == (E, 2 * W, H)
    assert np.array_equal(out[:, :N], gate_up[:, :N]) and not out[:, N:W].any()
    assert np.array_equal(out[:, W:W + N], gate_up[:, N:]) and not out[:, W + N:].any()
    down = np.ones((E, H, N), np.float32)
    out = pad_expert_tensor("model.layers.0.mlp.experts.down_proj", down,
                            intermediate=N, width=W)
    assert out.shape == (E, H, W) and out[:, :, :N].all() and not out[:, :, N:].any()
    assert pad_expert_tensor("model.layers.0.mlp.gate.weight", down, intermediate=N,
                             width=W) is None
    with pytest.raises(ValueError, match="expected expert width 2"):
        pad_expert_tensor("model.layers.0.mlp.experts.5.up_proj.weight",
                          np.zeros((3, 4)), intermediate=N, width=W)


def test_a_valid_cache_is_reused_without_rebuilding(built, tmp_path):
    folder = wide_tiny_moe_dir(64, tmp_path)
    inode = (folder / "model.safetensors").stat().st_ino
    assert wide_tiny_moe_dir(64, tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_ino == inode
    assert (folder / "model.safetensors").read_bytes() == \
        (built[64] / "model.safetensors").read_bytes()  # deterministic


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest_source", "no_manifest"])
def test_a_damaged_cache_is_rebuilt_with_a_log_line(damage, built, tmp_path, caplog):
    folder = wide_tiny_moe_dir(64, tmp_path)
    weights = folder / "model.safetensors"
    if damage == "flip":
        raw = bytearray(weights.read_bytes())
        raw[-3] ^= 0xFF
        weights.write_bytes(bytes(raw))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "manifest_source":  # built from another source model
        manifest = json.loads((folder / "eldr-wide.json").read_text())
        manifest["source_sha256"] = "0" * 64
        (folder / "eldr-wide.json").write_text(json.dumps(manifest))
    else:
        (folder / "eldr-wide.json").unlink()
    with caplog.at_level(logging.WARNING, logger="eldr.capture.wide"):
        assert wide_tiny_moe_dir(64, tmp_path) == folder
    assert "does not match its manifest; rebuilding" in caplog.text
    assert weights.read_bytes() == (built[64] / "model.safetensors").read_bytes()
    assert wide._is_valid(folder, 64, wide._sha256(tiny_moe_dir() / "model.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-moe-w64"]


def test_memory_estimate_and_refusal(monkeypatch, tmp_path):
    experts = 6 * 64 * 3 * 128 * 4096 * 4
    assert wide.wide_expert_bytes(4096) == experts
    dense = wide.wide_engine_bytes(4096) - experts - wide.RUNTIME_BYTES
    assert 0 < dense < 4 * 1_000_000  # embeddings, attention, routers, norms in float32
    assert wide_engine_bytes(8192) - wide_engine_bytes(4096) == experts
    monkeypatch.setattr(wide, "_physical_bytes", lambda: 3 * 2**30)
    with pytest.raises(ValueError,
                       match=r"width 4096: .* estimated 5\.4 GiB \(5,748,\d{3},\d{3} bytes"):
        wide_tiny_moe_dir(4096, tmp_path)
    assert not any(tmp_path.iterdir())


# -- the same function: transformers, fp32 --------------------------------------------------
def _prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    by_domain: dict[str, list[str]] = {}
    for row in rows:
        by_domain.setdefault(row["domain"], []).append(row["prompt"])
    picked = []
    for i in range(n):  # round-robin over the domains
        domain = sorted(by_domain)[i % len(by_domain)]
        picked.append(by_domain[domain][i // len(by_domain)])
    return picked


def test_the_prompt_set():
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 64
    assert len({r["domain"] for r in rows}) >= 4
    assert len({r["prompt"] for r in rows}) == len(rows)


@pytest.fixture(scope="module")
def narrow_run():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return _greedy_run(tiny_moe_dir())


def _greedy_run(folder: Path):
    """Per prompt: (captured routing, model logits over prompt + generated tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eldr.capture.hf import capture_ids

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = [tok(p).input_ids for p in _prompts(16)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared machine
    try:
        runs = capture_ids(model, ids, max_new_tokens=8, progress=False)
        logits = []
        with torch.no_grad():
            for p, r in zip(ids, runs, strict=True):
                full = torch.tensor([list(p) + r.output_ids.tolist()])
                logits.append(model(input_ids=full).logits[0].numpy())
    finally:
        torch.set_num_threads(threads)
    return runs, logits


# float32 unit roundoff (2^-24): the relative error of one rounding.
_U32 = 2.0 ** -24


def float32_tolerance(inner: int, num_layers: int, scale: float) -> float:
    """Largest |narrow - wide| the two models may differ by on values of magnitude ``scale``.

    The wide model zero-pads each expert's inner dimension from 32 to W, so the two compute
    the same real numbers, but a BLAS kernel may sum a padded dot product in another order
    (MKL's AVX-512 path does: the last bits of the router logits differ there). The classic
    bound for a float32 dot product of n terms summed in any order is gamma_n = n*u/(1 - n*u)
    relative to the sum of |terms| (Higham, Accuracy and Stability of Numerical
    Algorithms, 3.1). Each layer adds at most one such error from its widest reduction
    (``inner``: the hidden size plus the padded width), and the residual stream carries it
    on, so the layers' errors add: ``num_layers * gamma_inner * scale``. Loose on purpose:
    what it must catch is a wrong function (a misplaced pad moves logits by O(scale)).
    """
    gamma = inner * _U32 / (1.0 - inner * _U32)
    return num_layers * gamma * max(1.0, scale)


@pytest.mark.parametrize("width", [64, 256])
def test_wide_model_computes_the_same_function(width, built, narrow_run):
    narrow, narrow_logits = narrow_run
    wide_runs, wide_logits = _greedy_run(built[width])
    config = json.loads((tiny_moe_dir() / "config.json").read_text())
    inner, layers = config["hidden_size"] + width, config["num_hidden_layers"]
    worst_router = worst_model = 0.0
    for a, b in zip(narrow, wide_runs, strict=True):
        # exact on every CPU: integer choices, checked on AVX2 and AVX-512 machines
        assert np.array_equal(a.output_ids, b.output_ids)  # greedy tokens
        assert np.array_equal(a.prefill_topk, b.prefill_topk)  # every layer's selection
        assert np.array_equal(a.decode_topk, b.decode_topk)
        assert a.decode_topk.shape[0] == len(a.output_ids) - 1
        # float32 router logits: equal to float32 rounding, bitwise only where the BLAS
        # kernel sums the padded width in the same order (docs/capture.md)
        diff = float(np.max(np.abs(a.prefill_logits - b.prefill_logits)))
        tol = float32_tolerance(inner, layers, float(np.max(np.abs(a.prefill_logits))))
        assert diff <= tol, f"router logits differ by {diff:.3g} > {tol:.3g}"
        worst_router = max(worst_router, diff)
    for a, b in zip(narrow_logits, wide_logits, strict=True):
        diff = float(np.max(np.abs(a - b)))
        tol = float32_tolerance(inner, layers, float(np.max(np.abs(a))))
        assert diff <= tol, f"model logits differ by {diff:.3g} > {tol:.3g}"
        worst_model = max(worst_model, diff)
    print(f"W={width}: max |narrow - wide| router logits {worst_router:.3g}, "
          f"model logits {worst_model:.3g}")


def test_the_float32_tolerance_is_the_rounding_bound():
    # n = 384 terms: gamma = 384 u / (1 - 384 u) ~ 2.29e-5; 6 layers, scale 10
    tol = float32_tolerance(384, 6, 10.0)
    assert tol == pytest.approx(6 * 10 * 384 * 2.0 ** -24, rel=1e-4)
    assert float32_tolerance(384, 6, 0.01) == pytest.approx(6 * 384 * 2.0 ** -24, rel=1e-4)
    # a wrong function moves logits by O(scale): far outside the bound
    assert 0.01 * 10.0 > tol
