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
