"""Fit the simulator's step model to decode steps timed on a real engine. Numpy only.

An engine running the eldr plugin times each decode step (docs/capture.md#step-timings):
its wall time ``t``, its tokens ``B`` (rows of the batch) and ``Σ_l D_l``, the distinct
experts its batch selected summed over the model's ``L`` MoE layers. Across steps::

    t = t0 + b · Σ_l D_l + c · B            (least squares)

What maps where in the simulator's step model (:mod:`eldr.sim.steptime`,
``t_step = t_fixed + Σ_l (a + b·D_l) + dense/BW + KV/BW``):

- ``b`` IS the simulator's per-layer constant, seconds per distinct expert per MoE layer:
  ``Σ_l b·D_l = b · Σ_l D_l``. It is the one constant the routing changes.
- ``t0`` lumps everything that does not grow with ``Σ D`` or ``B``: ``t_fixed``, the
  ``L·a`` of the MoE layers, the dense weight read and the mean KV read of the steps
  fitted. Whole steps cannot separate ``a`` from ``t_fixed`` (both are constants per step),
  so :func:`eldr.sim.hardware.hardware_from_fit` puts ``t0`` into ``t_fixed`` and sets
  ``a = 0``, minus the dense and KV terms the simulator models separately.
- ``c`` (seconds per token: attention, sampling, per-row work) has no slot in the
  simulator; it is kept in the hardware file for the reader (``c_us``).

Steps with prefill rows mixed in take a prompt's worth of compute: they are left out
(``include_mixed=False``) unless asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MIN_STEPS", "StepFit", "fit_step_model"]

MIN_STEPS = 30  # fewer timed steps than this are refused


@dataclass(frozen=True)
class StepFit:
    """A least-squares fit ``t = t0 + b·ΣD + c·B`` over ``n`` decode steps (seconds)."""

    t0_s: float  # fixed time per step
    b_s: float  # per distinct expert per MoE layer (the simulator's b)
    c_s: float  # per token of the batch (0 when B did not vary and it was dropped)
    r2: float  # coefficient of determination on the fitted steps
    n: int  # steps fitted
    residual_s: float  # standard deviation of the residuals
    num_layers: int | None = None  # L the ΣD were summed over, when known
    num_mixed_dropped: int = 0  # steps left out for prefill rows
    fitted_c: bool = True  # False: B was constant, c not identifiable, fixed at 0

    def predict(self, distinct_sum, tokens) -> np.ndarray:
        """Predicted step seconds for (n,) ``distinct_sum`` and ``tokens``."""
        return (self.t0_s + self.b_s * np.asarray(distinct_sum, np.float64)
                + self.c_s * np.asarray(tokens, np.float64))

    def describe(self, model: str) -> str:
        """Two lines: what was fitted (steps of ``model``, the steps left out) and the
        fitted constants in µs with R² and the residual spread (``eldr calibrate``)."""
        return (f"fit over {self.n} decode steps of {model} ({self.num_mixed_dropped} with "
                f"prompt rows left out): t = t0 + b·ΣD + c·B\n"
                f"  t0 = {self.t0_s * 1e6:.1f} µs, b = {self.b_s * 1e6:.3f} µs per distinct "
                f"expert per layer, c = {self.c_s * 1e6:.2f} µs per token"
                f"{'' if self.fitted_c else ' (B never varied: not fitted)'}, "
                f"R² = {self.r2:.3f}, residual sd = {self.residual_s * 1e6:.1f} µs")

    def to_json(self) -> dict:
        return {"t0_us": self.t0_s * 1e6, "b_us": self.b_s * 1e6, "c_us": self.c_s * 1e6,
                "r2": self.r2, "n": self.n, "residual_us": self.residual_s * 1e6,
                "layers": self.num_layers, "mixed_dropped": self.num_mixed_dropped,
                "fitted_c": self.fitted_c}


def _column(x, name: str, dtype) -> np.ndarray:
    arr = np.asarray(x, dtype=dtype)
    if arr.ndim != 1:
        raise ValueError(f"step fit: {name} must be one-dimensional, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"step fit: {name} holds NaN or infinite values")
    return arr


def fit_step_model(wall_s, tokens, distinct_sum, *, mixed=None, include_mixed: bool = False,
                   num_layers: int | None = None, min_steps: int = MIN_STEPS) -> StepFit:
    """Least-squares ``t = t0 + b·ΣD + c·B`` over timed decode steps.

    ``wall_s`` (n,) seconds > 0, ``tokens`` (n,) B >= 1, ``distinct_sum`` (n,) Σ_l D_l
    >= 0, ``mixed`` (n,) bool (steps with prefill rows; dropped unless ``include_mixed``).
    ``ValueError`` naming the problem: unequal lengths, NaN, non-positive times, fewer
    than ``min_steps`` steps, ``ΣD`` that never varies (``b`` not identifiable). When
    ``B`` never varies, or moves in lockstep with ``ΣD`` (rank-deficient design), ``c`` is
    fixed at 0 and ``fitted_c`` is False: the effect of the batch size is then inside
    ``b`` and ``t0``.
    """
    t = _column(wall_s, "wall_s", np.float64)
    B = _column(tokens, "tokens", np.float64)
    D = _column(distinct_sum, "distinct_sum", np.float64)
    if not len(t) == len(B) == len(D):
        raise ValueError(f"step fit: wall_s, tokens and distinct_sum must have equal lengths, "
                         f"got {len(t)}, {len(B)}, {len(D)}")
    m = np.zeros(len(t), bool) if mixed is None else np.asarray(mixed, bool)
    if m.shape != t.shape:
        raise ValueError(f"step fit: mixed must have {len(t)} entries, got {m.shape}")
    dropped = 0 if include_mixed else int(m.sum())
    if not include_mixed:
        t, B, D = t[~m], B[~m], D[~m]
    if np.any(t <= 0):
        raise ValueError("step fit: wall_s must be > 0 seconds")
    if np.any(B < 1) or np.any(D < 0):
        raise ValueError("step fit: tokens must be >= 1 and distinct_sum >= 0")
    if len(t) < min_steps:
        raise ValueError(f"step fit: {len(t)} usable decode steps, at least {min_steps} needed"
                         + (f" ({dropped} mixed prefill steps left out)" if dropped else ""))
    if np.ptp(D) == 0:
        raise ValueError(f"step fit: every step had the same Σ distinct experts ({D[0]:g}); "
                         "b is not identifiable: send traffic at several concurrencies")
    X = np.column_stack([np.ones_like(t), D, B])
    fitted_c = np.ptp(B) > 0 and np.linalg.matrix_rank(X) == 3
    if not fitted_c:
        X = X[:, :2]
    coef, *_ = np.linalg.lstsq(X, t, rcond=None)
    resid = t - X @ coef
    ss_tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return StepFit(t0_s=float(coef[0]), b_s=float(coef[1]),
                   c_s=float(coef[2]) if fitted_c else 0.0, r2=r2, n=len(t),
                   residual_s=float(resid.std()), num_layers=num_layers,
                   num_mixed_dropped=dropped, fitted_c=bool(fitted_c))
