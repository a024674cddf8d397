"""eldr.sim.hardware: hardware files round trip, bad files refused naming the field and
the file, get_hardware reads a path, a step fit becomes a Hardware."""

import json

import numpy as np
import pytest

from eldr.sim.config import HARDWARE, SimConfig, get_hardware, moe_constants
from eldr.sim.hardware import (
    FORMAT,
    Hardware,
    hardware_from_fit,
    load_hardware,
    save_hardware,
)
from eldr.sim.stepfit import fit_step_model
from eldr.traces.models import get_preset

DOC = {"format": "eldr-hardware/1", "name": "my-gpu", "hbm_bandwidth": 4.8e12,
       "hbm_bytes": 141e9, "peak_flops": 989e12, "t_fixed_s": 0.002,
       "moe_fits": [{"model": "qwen3-30b-a3b", "a_us": 18.7, "b_us": 2.22, "c_us": 0.0,
                     "r2": 0.99, "layers": 48, "experts": 128, "top_k": 8}],
       "source": {"how": "eldr calibrate", "engine": "http://x", "steps": 1234,
                  "date": "2026-12-01T00:00:00Z"}}


def _write(tmp_path, doc, name="hw.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_load_the_documented_example(tmp_path):
    hw = load_hardware(_write(tmp_path, DOC))
    assert hw == Hardware("my-gpu", hbm_bandwidth=4.8e12, hbm_bytes=141e9, peak_flops=989e12,
                          t_fixed_s=0.002, measured_moe=True,
                          moe_fits=(("qwen3-30b-a3b", 18.7, 2.22),))
    a, b = moe_constants(hw, get_preset("qwen3-30b-a3b"))
    assert (a, b) == pytest.approx((18.7e-6, 2.22e-6))
    with pytest.raises(ValueError, match="measured constants of qwen3-30b-a3b only"):
        moe_constants(hw, get_preset("qwen3-235b-a22b"))


def test_round_trip_keeps_the_notes(tmp_path):
    hw = load_hardware(_write(tmp_path, DOC))
    out = save_hardware(hw, tmp_path / "again.json", source={"how": "test"},
                        fit_notes={"qwen3-30b-a3b": {"c_us": 1.5, "r2": 0.9}})
    assert load_hardware(out) == hw
    doc = json.loads(out.read_text())
    assert doc["format"] == FORMAT and doc["source"] == {"how": "test"}
    assert doc["moe_fits"][0] == {"model": "qwen3-30b-a3b", "a_us": 18.7, "b_us": 2.22,
                                  "c_us": 1.5, "r2": 0.9, "layers": 48, "experts": 128,
                                  "top_k": 8}
    assert not list(tmp_path.glob("*.tmp*"))  # atomic: no leftovers
    cpu = save_hardware(HARDWARE["cpu"], tmp_path / "cpu.json")
    assert load_hardware(cpu) == HARDWARE["cpu"]


def test_no_fits_derives_constants(tmp_path):
    hw = load_hardware(_write(tmp_path, {**DOC, "moe_fits": []}))
    assert not hw.measured_moe and hw.moe_fits == ()
    assert moe_constants(hw, get_preset("qwen3-235b-a22b"))[1] > 0


def _without(key):
    return {k: v for k, v in DOC.items() if k != key}


def _fit(**change):
    return {**DOC, "moe_fits": [{**DOC["moe_fits"][0], **change}]}


@pytest.mark.parametrize("doc, message", [
    ({**DOC, "format": "eldr-hardware/9"}, "format 'eldr-hardware/9'"),
    (_without("hbm_bandwidth"), "missing field 'hbm_bandwidth'"),
    (_without("name"), "missing field 'name'"),
    ({**DOC, "peak_flops": 0}, "peak_flops must be > 0"),
    ({**DOC, "hbm_bytes": -1.0}, "hbm_bytes must be > 0"),
    ({**DOC, "t_fixed_s": -0.1}, "t_fixed_s must be >= 0"),
    ({**DOC, "hbm_bandwidth": "fast"}, "hbm_bandwidth must be a finite number"),
    (_fit(b_us=0.0), r"moe_fits\[0\]: b_us must be > 0"),
    (_fit(a_us=None), r"moe_fits\[0\]: missing field 'a_us'"),
    (_fit(model="wide-moe"), "unknown model 'wide-moe'; a fit must name a model preset: "
     "qwen3-30b-a3b, .*tiny-moe"),
    (_fit(layers=6), "layers=6 but model preset 'qwen3-30b-a3b' has 48"),
    (_fit(r2=float("nan")), "r2 must be a finite number"),
    ({**DOC, "moe_fits": DOC["moe_fits"] * 2}, "names a model twice"),
    ({**DOC, "moe_fits": {}}, "moe_fits must be a list"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_files_name_field_and_file(tmp_path, doc, message):
    path = _write(tmp_path, doc)
    with pytest.raises(ValueError, match=message) as err:
        load_hardware(path)
    assert str(path) in str(err.value)


def test_not_json_and_missing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        load_hardware(bad)
    with pytest.raises(ValueError, match="no such file"):
        get_hardware(str(tmp_path / "absent.json"))


def test_get_hardware_reads_a_path_and_simconfig_takes_it(tmp_path):
    path = _write(tmp_path, DOC, "My-GPU.JSON")
    assert get_hardware(str(path)).name == "my-gpu"
    assert get_hardware("  H200 ") is HARDWARE["h200"]
    with pytest.raises(ValueError, match="or a hardware file"):
        get_hardware("a100")
    cfg = SimConfig(model="qwen3-30b-a3b", hardware=str(path))
    with pytest.raises(ValueError, match="measured constants of qwen3-30b-a3b only"):
        SimConfig(model="qwen3-235b-a22b", hardware=str(path))
    from eldr.sim.steptime import StepModel

    assert StepModel(cfg).kv_capacity_bytes > 0


def test_hardware_from_fit():
    rng = np.random.default_rng(0)
    B = rng.integers(1, 33, 200)
    D = B * 6 * 3 + rng.integers(0, 40, 200)
    fit = fit_step_model(0.004 + 3.6e-6 * D + 2e-6 * B, B, D)
    tiny = get_preset("tiny-moe")
    hw = hardware_from_fit(fit, "tiny-moe", HARDWARE["cpu"], "my-cpu")
    assert hw.moe_fits == (("tiny-moe", 0.0, pytest.approx(3.6)),)
    assert hw.t_fixed_s == pytest.approx(0.004 - tiny.dense_bytes_per_step / 1.645e9)
    assert (hw.hbm_bandwidth, hw.peak_flops) == (1.645e9, 52.34e9)
    flat = fit_step_model(0.004 - 1e-9 * D, B, D)
    with pytest.raises(ValueError, match="not > 0"):
        hardware_from_fit(flat, "tiny-moe", HARDWARE["cpu"], "x")
