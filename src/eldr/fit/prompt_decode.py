"""The prompt predictor with the DECODE profile as its target, and the gate that keeps a
router from routing on a poor prediction (docs/real-models.md, "The prompt predictor").

:class:`~eldr.fit.prompt.PromptPredictor` learns prompt token ids → a per-token expert
profile. Fitted on prefill profiles (``PromptPredictor.fit``) it stands in for the prefill
signature before prefill; a decode-only recording (GPT-OSS-20B) has no prefill profile, so
here the target is what routing is for: the request's decode profile
``decode_counts / decode_len`` (each layer row sums to k). Same model, same features, same
cross-validated choice (``fit_prompts``); only the target differs.

The gate. A prediction fitted on one kind of traffic may be worthless on another (a
benchmark family never seen in the fit). Routing on it then groups requests by noise, and
the band may do worse than load balancing. The router's rule (:class:`PredictionGate`):

- **global**: the predictor's cross-validated R² on its own fit data must reach
  ``min_r2`` (0.1 by default, fixed before looking at any held-out data); below it the
  predictor is not used at all (load balancing);
- **per request**: the share of the prompt's n-grams (unigrams and bigrams, hashed as the
  predictor hashes them) seen in the fit prompts, its *coverage*, must reach the
  ``quantile`` (5 %) of the coverages the cross-validation folds' held-out prompts had
  against their own training folds. A prompt less familiar than 95 % of the calibration's
  held-out prompts is routed by load alone (an all-zero signature makes the band every
  decoder).

Both thresholds come from the fit data alone; the held-out family is only measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eldr.fit.prompt import PromptPredictor, ngram_hashes
from eldr.traces.trace import Trace

__all__ = ["PredictionGate", "decode_profiles", "fit_decode_predictor", "ngram_coverage"]


def decode_profiles(trace: Trace) -> np.ndarray:
    """(R, L, E) float64 per-token decode profiles ``decode_counts / decode_len`` (a request
    without decode steps: zeros)."""
    n = np.maximum(trace.decode_lens, 1).astype(np.float64)
    return trace.decode_counts / n[:, None, None]


def fit_decode_predictor(trace: Trace, *, random_state: int | None = 0,
                         **options) -> PromptPredictor:
    """A :class:`PromptPredictor` fitted on ``trace``'s prompt token ids with the decode
    profiles as targets (requests with a prompt and a decode step). ``options``: the
    predictor's settings (bits, ranks, alphas, weightings, folds ...; ``token`` needs
    prefill experts and is dropped)."""
    if trace.prompt_token_ids is None:
        raise ValueError(f"trace ({trace.meta.source}) has no prompt_token_ids: a prompt "
                         "predictor needs the prompts")
    keep = np.flatnonzero((trace.prompt_lens > 0) & (trace.decode_lens > 0))
    weightings = tuple(w for w in options.pop("weightings", ("tfidf", "tf")) if w != "token")
    pred = PromptPredictor(random_state=random_state, weightings=weightings or ("tfidf",),
                           **options)
    prompts = [trace.prompt_tokens(int(r)) for r in keep]
    return pred.fit_prompts(prompts, decode_profiles(trace)[keep], top_k=trace.meta.top_k,
                            vocab_size=int(trace.prompt_token_ids.max()) + 1)


def _buckets(prompt: np.ndarray, bits: int) -> np.ndarray:
    return np.unique(ngram_hashes(np.asarray(prompt, dtype=np.int64)) >> np.uint64(64 - bits))


def ngram_coverage(prompts: list[np.ndarray], seen: np.ndarray, bits: int) -> np.ndarray:
    """(R,) share of each prompt's distinct n-gram buckets present in ``seen`` (a sorted
    array of buckets, e.g. those of the fit prompts)."""
    out = np.empty(len(prompts))
    for i, p in enumerate(prompts):
        b = _buckets(p, bits)
        out[i] = np.isin(b, seen, assume_unique=True).mean() if b.size else 0.0
    return out


def _seen(prompts: list[np.ndarray], bits: int) -> np.ndarray:
    return np.unique(np.concatenate([_buckets(p, bits) for p in prompts])) if prompts \
        else np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True)
class PredictionGate:
    """When a router may route on a prompt prediction (module docstring)."""

    cv_r2: float  # the predictor's cross-validated R² on its fit data
    min_r2: float  # below it: never route on the prediction
    min_coverage: float  # a prompt's n-gram coverage below it: load balancing
    quantile: float  # the calibration quantile min_coverage is
    bits: int  # the hash of the coverage (the predictor's)
    seen: np.ndarray  # sorted buckets of the fit prompts' n-grams

    @classmethod
    def calibrate(cls, predictor: PromptPredictor, prompts: list[np.ndarray], *,
                  min_r2: float = 0.1, quantile: float = 0.05, folds: int = 3,
                  random_state: int | None = 0) -> PredictionGate:
        """From the fit prompts alone: each fold's held-out prompts' coverage against the
        other folds, its ``quantile`` the per-request threshold."""
        bits = predictor.bits_
        fold = np.random.default_rng(random_state).permutation(len(prompts)) % folds
        cov = []
        for f in range(folds):
            train = [p for p, g in zip(prompts, fold, strict=True) if g != f]
            held = [p for p, g in zip(prompts, fold, strict=True) if g == f]
            cov.append(ngram_coverage(held, _seen(train, bits), bits))
        threshold = float(np.quantile(np.concatenate(cov), quantile))
        return cls(cv_r2=float(predictor.cv_r2_), min_r2=min_r2, min_coverage=threshold,
                   quantile=quantile, bits=bits, seen=_seen(prompts, bits))

    @property
    def enabled(self) -> bool:
        """Whether the predictor is good enough to route on at all."""
        return bool(np.isfinite(self.cv_r2) and self.cv_r2 >= self.min_r2)

    def coverage(self, prompts: list[np.ndarray]) -> np.ndarray:
        return ngram_coverage(prompts, self.seen, self.bits)

    def admit(self, prompts: list[np.ndarray]) -> np.ndarray:
        """(R,) bool: route on the prediction (True) or by load alone (False)."""
        if not self.enabled:
            return np.zeros(len(prompts), dtype=bool)
        return self.coverage(prompts) >= self.min_coverage

    def as_dict(self) -> dict:
        return {"cv_r2": round(self.cv_r2, 6), "min_r2": self.min_r2,
                "min_coverage": round(self.min_coverage, 6), "quantile": self.quantile,
                "bits": self.bits, "enabled": self.enabled}
