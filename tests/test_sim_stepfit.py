"""eldr.sim.stepfit: known constants recovered from noisy synthetic steps; refusals."""

import numpy as np
import pytest

from eldr.sim.stepfit import MIN_STEPS, fit_step_model


def _steps(n=400, *, t0=2e-3, b=2.2e-6, c=5e-6, noise=2e-5, L=48, seed=0):
    """n decode steps of a 48-layer model at batch sizes 1..64: Σ_l D_l grows with B
    (saturating towards 128 per layer), with independent spread so B and ΣD separate."""
    rng = np.random.default_rng(seed)
    B = rng.integers(1, 65, n)
    per_layer = 128 * (1 - (1 - 8 / 128) ** B) * rng.uniform(0.85, 1.0, n)
    D = np.round(per_layer * L).astype(np.int64)
    t = t0 + b * D + c * B + rng.normal(0, noise, n)
    return t, B, D


def test_recovers_known_constants():
    t, B, D = _steps()
    fit = fit_step_model(t, B, D, num_layers=48)
    assert fit.b_s == pytest.approx(2.2e-6, rel=0.03)
    assert fit.c_s == pytest.approx(5e-6, rel=0.1)
    assert fit.t0_s == pytest.approx(2e-3, rel=0.02)
    assert fit.r2 > 0.99 and fit.n == 400 and fit.fitted_c
    assert fit.residual_s == pytest.approx(2e-5, rel=0.15)
    assert fit.to_json()["b_us"] == pytest.approx(2.2, rel=0.03)
    np.testing.assert_allclose(fit.predict(D, B), t, atol=1e-4)


def test_describe_says_what_was_fitted_in_microseconds():
    t, B, D = _steps(noise=0.0)
    text = fit_step_model(t, B, D, num_layers=48).describe("qwen3-30b-a3b")
    first, second = text.splitlines()
    assert first == ("fit over 400 decode steps of qwen3-30b-a3b (0 with prompt rows left "
                     "out): t = t0 + b·ΣD + c·B")
    assert second.startswith("  t0 = 2000.0 µs, b = 2.200 µs per distinct expert per "
                             "layer, c = 5.00 µs per token, R² = 1.000")
    const = fit_step_model(1e-3 + 3e-6 * D[:60], np.full(60, 8), D[:60]).describe("m")
    assert "c = 0.00 µs per token (B never varied: not fitted)" in const


def test_exact_without_noise():
    t, B, D = _steps(noise=0.0)
    fit = fit_step_model(t, B, D)
    assert (fit.t0_s, fit.b_s, fit.c_s) == pytest.approx((2e-3, 2.2e-6, 5e-6), rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)


def test_mixed_steps_are_dropped_unless_asked():
    t, B, D = _steps(n=200, noise=0.0)
    mixed = np.zeros(200, bool)
    mixed[::10] = True
    t = t.copy()
    t[mixed] += 0.05  # a prompt's worth of compute
    fit = fit_step_model(t, B, D, mixed=mixed)
    assert fit.n == 180 and fit.num_mixed_dropped == 20
    assert fit.b_s == pytest.approx(2.2e-6, rel=1e-9)
    assert fit_step_model(t, B, D, mixed=mixed, include_mixed=True).r2 < 0.9


def test_constant_batch_fixes_c_at_zero():
    rng = np.random.default_rng(1)
    D = rng.integers(100, 400, 60)
    t = 1e-3 + 3e-6 * D
    fit = fit_step_model(t, np.full(60, 8), D)
    assert not fit.fitted_c and fit.c_s == 0.0
    assert fit.b_s == pytest.approx(3e-6)


@pytest.mark.parametrize("change, message", [
    (lambda t, B, D: (t[:MIN_STEPS - 1], B[:MIN_STEPS - 1], D[:MIN_STEPS - 1]),
     "29 usable decode steps, at least 30"),
    (lambda t, B, D: (np.where(np.arange(len(t)) == 3, np.nan, t), B, D), "NaN"),
    (lambda t, B, D: (t, B, np.full(len(D), 480)), "not identifiable"),
    (lambda t, B, D: (t[:-1], B, D), "equal lengths"),
    (lambda t, B, D: (-t, B, D), "wall_s must be > 0"),
    (lambda t, B, D: (t, B * 0, D), "tokens must be >= 1"),
    (lambda t, B, D: (t.reshape(-1, 2), B, D), "one-dimensional"),
])
def test_refusals(change, message):
    t, B, D = _steps(n=100)
    with pytest.raises(ValueError, match=message):
        fit_step_model(*change(t, B, D))


def test_too_few_after_dropping_mixed_says_so():
    t, B, D = _steps(n=40)
    mixed = np.arange(40) < 20
    with pytest.raises(ValueError, match=r"20 usable .* \(20 mixed prefill steps left out\)"):
        fit_step_model(t, B, D, mixed=mixed)
