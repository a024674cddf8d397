"""SimConfig validation and hardware presets."""

from __future__ import annotations

import pytest

from eldr.sim import HARDWARE, SimConfig, get_hardware, moe_constants
from eldr.traces.models import get_preset


def test_h200_uses_the_measured_fits():
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "gemma-4-26b-a4b", "gpt-oss-120b"):
        m = get_preset(name)
        a, b = moe_constants(HARDWARE["h200"], m)
        assert (a, b) == (m.moe_layer_fixed_us * 1e-6, m.moe_layer_per_expert_us * 1e-6)


def test_mi300x_is_derived_from_bandwidth():
    m = get_preset("qwen3-30b-a3b")
    a, b = moe_constants(get_hardware("MI300X"), m)
    # the H200 fit's efficiency at MI300X bandwidth: 2.22 µs x 4.8 / 5.3
    assert b == pytest.approx(2.22e-6 * 4.8 / 5.3)
    assert a / b == pytest.approx((128 - 4.7 * 16) / 3.7)


@pytest.mark.parametrize("bad", [
    {"num_prefill": 0}, {"num_decode": 1.5}, {"qps": 0}, {"qps": float("nan")},
    {"warmup_s": -1}, {"duration_s": 0}, {"model": "nope"}, {"hardware": "tpu"},
    {"prefill_mfu": 1.5}, {"t_fixed_s": -1e-3}, {"kv_capacity_tokens": 0}, {"seed": -1},
    {"ep": 3}, {"max_batch": True},
])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        SimConfig(**bad)


def test_horizon_and_json_round_trip():
    c = SimConfig(warmup_s=10, duration_s=20)
    assert c.horizon_s == 30
    assert SimConfig(**c.to_json()) == c


def test_cpu_preset_holds_the_measured_tiny_moe_constants_and_refuses_other_models():
    cpu = get_hardware("cpu")
    a, b = moe_constants(cpu, get_preset("tiny-moe"))
    assert (a, b) == (pytest.approx(301.46e-6), pytest.approx(3.636e-6))  # bench fit
    assert cpu.t_fixed_s == pytest.approx(1.49e-3)
    for name in ("qwen3-30b-a3b", "gpt-oss-120b"):
        with pytest.raises(ValueError, match="measured constants of tiny-moe only"):
            moe_constants(cpu, get_preset(name))
        with pytest.raises(ValueError, match="tiny-moe only"):
            SimConfig(model=name, hardware="cpu")


def test_cpu_preset_reproduces_the_measured_batch_one_step():
    from eldr.sim.steptime import StepModel

    sm = StepModel(SimConfig(model="tiny-moe", hardware="cpu"))
    # batch 1, 100 tokens of KV, k = 4 experts at each of 6 layers: 4.535 ms measured
    assert sm.decode_step_time(6 * 4, 100) == pytest.approx(4.535e-3, rel=1e-3)


def test_cpu_preset_simulates_the_tiny_moe_trace_above_t_fixed():
    import numpy as np

    from eldr.capture import tiny_moe_trace_path
    from eldr.routing import make_policy
    from eldr.sim import simulate
    from eldr.traces.trace import load

    trace = load(tiny_moe_trace_path())
    cfg = SimConfig(model="tiny-moe", hardware="cpu", num_prefill=8, num_decode=4, qps=100.0,
                    warmup_s=0.5, duration_s=2.0, seed=1)
    tpot = {}
    for name in ("jsq", "round_robin"):
        res = simulate(trace, cfg, make_policy(name, num_workers=4))
        np.testing.assert_array_equal(res.requests["finishes"], 1)
        tpot[name] = res.summary()["tpot_median_ms"]
    # a step is t_fixed plus 6 MoE layers of >= a + 4b and dense/BW at least
    floor_ms = 1e3 * (1.49e-3 + 6 * (301.46e-6 + 4 * 3.636e-6))
    assert all(t > floor_ms for t in tpot.values())
    assert tpot["jsq"] != tpot["round_robin"]
