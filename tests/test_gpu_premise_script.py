"""scripts/gpu_premise.py: its CPU path end to end (the CI check of what a lent GPU runs),
and its pieces on hand-made cases. No GPU needed: on a machine without CUDA the script
takes the CPU path by itself; ``--cpu`` forces it anywhere."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from eldr.traces.models import get_preset
from eldr.traces.trace import load

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_premise.py"
HARDWARE_KEYS = {"format", "name", "hbm_bandwidth", "hbm_bytes", "peak_flops", "t_fixed_s",
                 "moe_fits", "source"}
FIT_KEYS = {"model", "a_us", "b_us", "c_us", "r2", "layers", "experts", "top_k"}
SOURCE_KEYS = {"how", "device", "steps", "date", "note"}
NUM_PROMPTS, TINY_LAYERS, TINY_EXPERTS, TINY_K = 16, 6, 64, 4


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_premise")
    return out, _run(out)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_premise", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_premise"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_cpu_path_exits_zero_and_prints_the_table(cpu_run):
    _, proc = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "B \\ D" in proc.stdout
    assert "fit t = a + b·D + c·B" in proc.stdout and "R² = " in proc.stdout
    assert "capture: 16 requests" in proc.stdout and "tokens/s" in proc.stdout


def test_hardware_file_has_every_field_with_its_type(cpu_run):
    out, _ = cpu_run
    hw = json.loads((out / "hardware.json").read_text())
    assert set(hw) == HARDWARE_KEYS
    assert hw["format"] == "eldr-hardware/1" and hw["name"] == "cpu-smoke"
    for key in ("hbm_bandwidth", "peak_flops", "t_fixed_s"):
        assert isinstance(hw[key], float) and hw[key] > 0 and math.isfinite(hw[key]), key
    assert isinstance(hw["hbm_bytes"], int) and hw["hbm_bytes"] > 0
    assert hw["t_fixed_s"] == 0.002
    # the fit itself is always in premise.json; hardware.json carries it unless noise made
    # it unusable for the step-time model (a < 0 or b <= 0), which premise.json then says
    report = json.loads((out / "premise.json").read_text())
    (sweep,) = report["moe"]
    assert sweep["shape"]["model"] == "tiny-moe" and len(sweep["cells"]) == 16  # k <= D <= B·k
    r2 = sweep["fit"]["r2"]
    assert isinstance(r2, float) and -math.inf <= r2 <= 1.0
    omitted = [o["model"] for o in report["omitted_fits"]]
    assert len(hw["moe_fits"]) + len(omitted) == 1
    for fit in hw["moe_fits"]:
        assert set(fit) == FIT_KEYS
        preset = get_preset(fit["model"])  # a preset name eldr knows
        assert (fit["layers"], fit["experts"], fit["top_k"]) == (
            preset.num_layers, preset.num_experts, preset.top_k)
        for key in ("a_us", "b_us", "c_us"):
            assert isinstance(fit[key], float) and math.isfinite(fit[key]), key
        assert fit["a_us"] >= 0 and fit["b_us"] > 0
        assert isinstance(fit["r2"], float) and -math.inf <= fit["r2"] <= 1.0
        assert fit["r2"] == sweep["fit"]["r2"]
    src = hw["source"]
    assert set(src) == SOURCE_KEYS
    assert src["how"] == "scripts/gpu_premise.py"
    assert isinstance(src["device"], str) and src["device"].startswith("cpu")
    assert isinstance(src["steps"], int) and src["steps"] > 0
    assert datetime.fromisoformat(src["date"]).utcoffset().total_seconds() == 0
    assert "SMOKE RUN" in src["note"] and "not a measurement" in src["note"]


def test_capture_counts_have_one_row_per_request(cpu_run):
    out, _ = cpu_run
    with np.load(out / "capture_tiny.npz") as z:
        pre, dec = z["prefill_counts"], z["decode_counts"]
        plen, olen = z["prompt_lens"], z["output_lens"]
        assert z["domains"].shape == (NUM_PROMPTS,)
    assert pre.shape == dec.shape == (NUM_PROMPTS, TINY_LAYERS, TINY_EXPERTS)
    # every token routed at every layer picks k experts; the last output is never fed back
    np.testing.assert_array_equal(pre.sum(axis=2), np.repeat(plen[:, None] * TINY_K, 6, 1))
    np.testing.assert_array_equal(dec.sum(axis=2),
                                  np.repeat((olen[:, None] - 1) * TINY_K, 6, 1))
    trace = load(out / "capture_tiny_trace.npz")
    np.testing.assert_array_equal(trace.prefill_counts, pre)
    report = json.loads((out / "premise.json").read_text())
    assert report["capture"]["path"].startswith("eldr.capture.hf")
    assert report["capture"]["tokens_per_s"] > 0 and report["errors"] == []


def test_direct_capture_path_records_the_same_counts(cpu_run, tmp_path):
    out, _ = cpu_run
    proc = _run(tmp_path, "--skip-sweep", "--capture-path", "direct")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "hardware.json").exists()
    assert json.loads((tmp_path / "premise.json").read_text())["capture"]["path"].startswith(
        "direct")
    with np.load(out / "capture_tiny.npz") as a, np.load(tmp_path / "capture_tiny.npz") as b:
        for key in ("prefill_counts", "decode_counts", "prompt_lens", "output_lens"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize(("B", "D"), [(1, 4), (2, 8), (8, 5), (8, 32), (16, 64)])
def test_forced_ids_select_exactly_d_distinct_experts(script, B, D):
    ids = script.forced_ids(B, D, 4, 64, np.random.default_rng(0))
    assert ids.shape == (B, 4)
    assert len(np.unique(ids)) == D
    assert all(len(set(row)) == 4 for row in ids.tolist())  # a token's k experts differ


def test_forced_ids_refuse_impossible_cells(script):
    with pytest.raises(ValueError, match="D=3"):
        script.forced_ids(8, 3, 4, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="D=8"):
        script.forced_ids(1, 8, 4, 64, np.random.default_rng(0))


def test_fits_recover_exact_coefficients(script):
    cells = [(B, D) for B in (1, 8, 32) for D in (8, 16, 64)]
    ys = [20.0 + 2.5 * D + 0.25 * B for B, D in cells]
    a, b, c, r2 = script.fit_plane(cells, ys)
    assert (a, b, c, r2) == pytest.approx((20.0, 2.5, 0.25, 1.0))
    table = [{"B": B, "D": D, "us": y} for (B, D), y in zip(cells, ys, strict=True)]
    per_b = script.per_batch_fits(table)
    assert [f["B"] for f in per_b] == [1, 8, 32]
    assert [f["a_us"] for f in per_b] == pytest.approx([20.25, 22.0, 28.0])
    assert all(f["b_us"] == pytest.approx(2.5) for f in per_b)


def test_grouped_gemm_layer_matches_the_loop_over_experts(script):
    import torch

    shape = script.TINY_MOE
    layer = script.MoeLayer(shape, device="cpu", dtype=torch.float32, seed=0)
    ids_np = script.forced_ids(8, 24, shape.top_k, shape.num_experts, np.random.default_rng(1))
    x = torch.randn(8, shape.hidden, generator=torch.Generator().manual_seed(2))
    ids = torch.from_numpy(ids_np)
    with torch.no_grad():
        loop = layer.forward(x, ids, script.MoeLayer.groups(ids_np), impl="loop")
        # dense reference: every token through its k experts, weights renormalised
        probs = torch.softmax(x @ layer.router, dim=-1)
        ref = torch.zeros_like(x)
        for t in range(8):
            w = probs[t, ids[t]] / probs[t, ids[t]].sum()
            for j, e in enumerate(ids[t].tolist()):
                h = x[t] @ layer.w_gate_up[e]
                act = torch.nn.functional.silu(h[:shape.intermediate]) * h[shape.intermediate:]
                ref[t] += w[j] * (act @ layer.w_down[e])
        torch.testing.assert_close(loop, ref, rtol=1e-5, atol=1e-6)
        if hasattr(torch, "_grouped_mm"):
            grouped = layer.forward(x, ids, impl="grouped_mm")
            torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-6)
