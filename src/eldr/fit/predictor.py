"""Predict a request's per-token decode expert profile from its prefill counts.

The cost policy (:mod:`eldr.routing.cost`) needs, per request, ``p (L, E)``: how likely one
decode token is to select each expert. With no calibration at all the prefill profile
``counts / prompt_len`` is the estimate. With a calibration trace (prefill AND decode
counts) :class:`ProfilePredictor` may shrink it toward the calibration's mean decode
profile,

    p̂ = (1 − α) · min(counts / prompt_len, 1) + α · mean_decode_profile,

which keeps every layer's row summing to ``k`` and helps when prompts are short (their
profile is noisy) or when decode routing drifts from prefill routing. α is chosen on a
held-out part of the calibration split by the mean squared error against the true
per-token decode profile ``decode_counts / (output_len − 1)`` (α = 0 is the calibration-
free predictor, so the fit can only choose shrinkage when it predicts better).

:func:`shrink` is that formula, the one place it is written: the fit, the predictor, the
artifact's ``predict_profile`` and the cluster profiles all call it. The prefill profile is
clipped at 1 first because ``p`` is a probability: an expert is selected at most once per
token, so ``counts ≤ prompt_len`` on every consistent trace and the clip changes nothing
there; where the token count under-reports what the counts cover (a router dividing by
the tokens a prefill reported) it keeps p̂ a mix of two probabilities, in [0, 1], as the
calibration-free :func:`eldr.routing.prefill_profile` does.
"""

from __future__ import annotations

import numpy as np

from eldr.traces.trace import Trace

__all__ = ["ProfilePredictor", "decode_profiles", "decoder_profiles", "prefill_profiles",
           "shrink"]


def shrink(prefill: np.ndarray, alpha: float, mean: np.ndarray | None) -> np.ndarray:
    """(..., L, E) float32 ``(1 − α) · min(prefill, 1) + α · mean`` (module docstring).

    ``prefill``: per-token prefill profiles ``counts / tokens``, one (L, E) or many
    (R, L, E); ``mean`` (L, E) the mean decode profile. α = 0 (or no ``mean``) returns the
    clipped prefill profile itself. The arithmetic is float32 with α rounded to float32
    once, so every caller gets the same bits for the same inputs.
    """
    pre = np.minimum(np.asarray(prefill, dtype=np.float32), np.float32(1.0))
    if not alpha or mean is None:
        return pre
    a = np.float32(alpha)
    return (1 - a) * pre + a * mean


def prefill_profiles(trace: Trace) -> np.ndarray:
    """(R, L, E) float32 ``prefill_counts / prompt_len`` (rows of empty prompts: 0)."""
    trace.require_prefill("the prefill profile")
    n = np.maximum(trace.prompt_lens, 1).astype(np.float32)[:, None, None]
    return trace.prefill_counts.astype(np.float32) / n


def decode_profiles(trace: Trace) -> np.ndarray:
    """(R, L, E) float32 ``decode_counts / (output_len − 1)``: the truth to predict."""
    n = np.maximum(trace.output_lens - 1, 1).astype(np.float32)[:, None, None]
    return trace.decode_counts.astype(np.float32) / n


class ProfilePredictor:
    """Shrinkage of the prefill profile toward the mean decode profile (module docstring).

    Fitted attributes: ``alpha_`` (chosen α), ``mean_`` (L, E) float32 mean decode profile,
    ``errors_`` {α: held-out MSE per request}, ``r2_`` held-out R² of the chosen predictor
    against the mean profile alone, ``r2_prefill_`` the same for α = 0.
    """

    def __init__(self, *, alphas=(0.0, 0.1, 0.2, 0.3, 0.5, 0.7), validation: float = 0.3,
                 random_state: int | None = 0) -> None:
        self.alphas = tuple(float(a) for a in alphas)
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be non-empty values in [0, 1], got {alphas}")
        if not 0.0 < validation < 1.0:
            raise ValueError(f"validation must be in (0, 1), got {validation}")
        self.validation = validation
        self.random_state = random_state

    def fit(self, trace: Trace) -> ProfilePredictor:
        """Choose α on a held-out part of ``trace`` (needs decode counts), then refit the
        mean on all of it."""
        R = trace.num_requests
        if R < 4:
            raise ValueError(f"a profile predictor needs at least 4 calibration requests, got {R}")
        rng = np.random.default_rng(self.random_state)
        order = rng.permutation(R)
        n_val = max(1, round(self.validation * R))
        val, fit = order[:n_val], order[n_val:]
        pre, dec = prefill_profiles(trace), decode_profiles(trace)
        mean = dec[fit].mean(axis=0)
        base = float(((dec[val] - mean) ** 2).sum(axis=(1, 2)).mean())
        self.errors_ = {}
        for a in self.alphas:
            pred = shrink(pre[val], a, mean)
            self.errors_[a] = float(((pred - dec[val]) ** 2).sum(axis=(1, 2)).mean())
        self.alpha_ = min(self.alphas, key=lambda a: (self.errors_[a], a))
        err0 = self.errors_.get(
            0.0, float(((shrink(pre[val], 0.0, None) - dec[val]) ** 2).sum(axis=(1, 2)).mean()))
        self.r2_ = 1.0 - self.errors_[self.alpha_] / base if base > 0 else 0.0
        self.r2_prefill_ = 1.0 - err0 / base if base > 0 else 0.0
        self.mean_ = dec.mean(axis=0).astype(np.float32)
        return self

    def predict(self, counts: np.ndarray, prompt_len: int) -> np.ndarray:
        """(L, E) float32 predicted profile of one request's prefill counts (L, E)."""
        if not hasattr(self, "alpha_"):
            raise RuntimeError("ProfilePredictor is not fitted; call fit(trace) first")
        c = np.asarray(counts, dtype=np.float32)
        if c.shape != self.mean_.shape:
            raise ValueError(f"counts have shape {c.shape}, expected {self.mean_.shape}")
        return shrink(c / np.float32(max(int(prompt_len), 1)), self.alpha_, self.mean_)

    def predict_trace(self, trace: Trace) -> np.ndarray:
        """(R, L, E) float32 predicted profiles of every request of ``trace``."""
        if not hasattr(self, "alpha_"):
            raise RuntimeError("ProfilePredictor is not fitted; call fit(trace) first")
        return shrink(prefill_profiles(trace), self.alpha_, self.mean_)

    def summary(self) -> dict:
        """JSON-able: chosen α, held-out R² (chosen and prefill-only), errors per α."""
        return {"alpha": self.alpha_, "r2": self.r2_, "r2_prefill": self.r2_prefill_,
                "errors": {f"{a:g}": e for a, e in self.errors_.items()}}


def decoder_profiles(profiles: np.ndarray, labels: np.ndarray, num_workers: int) -> np.ndarray:
    """(K, L, E) float32 mean ``log(1 − p)`` of each cluster's calibration requests.

    ``profiles`` (R, L, E) predicted per-token profiles of the calibration requests,
    ``labels`` (R,) their cluster (= decoder) index. The cost policy raises it to a batch
    size: ``exp(n · mean log(1 − p))`` is the chance that none of n of the cluster's usual
    requests selects an expert. An empty cluster gets the all-cluster mean.
    """
    p = np.minimum(np.asarray(profiles, dtype=np.float32), np.float32(1.0 - 1e-6))
    lab = np.asarray(labels)
    if p.ndim != 3 or lab.shape != (p.shape[0],):
        raise ValueError(f"profiles must be (R, L, E) and labels (R,), got {p.shape}, "
                         f"{lab.shape}")
    logs = np.log1p(-p)
    overall = logs.mean(axis=0) if p.shape[0] else np.zeros(p.shape[1:], np.float32)
    out = np.empty((num_workers, *p.shape[1:]), dtype=np.float32)
    for k in range(num_workers):
        members = logs[lab == k]
        out[k] = members.mean(axis=0) if members.shape[0] else overall
    return out
