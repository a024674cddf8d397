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
- **per request**: a statistic of how familiar the prompt is must reach the ``quantile``
  (5 %) of the values the cross-validation folds' held-out prompts had against their own
  training folds; a prompt less familiar than 95 % of the calibration's held-out prompts is
  routed by load alone (an all-zero signature makes the band every decoder). Two
  statistics: ``coverage``, the share of the prompt's hashed n-grams (unigrams and bigrams,
  as the predictor hashes them) seen in the fit prompts, the first design; and
  ``familiarity``, the highest TF-IDF cosine to a fit prompt, designed after coverage
  admitted every prompt of a held-out family (docs/real-models.md says which result is
  clean).

Both thresholds come from the fit data alone; held-out families are only measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eldr.fit.prompt import PromptPredictor, ngram_hashes
from eldr.traces.trace import Trace

__all__ = ["MIN_ROUTING_R2", "STATISTICS", "PredictionGate", "decode_profiles", "familiarity",
           "fit_decode_predictor", "ngram_coverage"]


# A predictor whose cross-validated R² on its own fit data is below this is never routed on
# (fixed before any held-out measurement; docs/real-models.md).
MIN_ROUTING_R2 = 0.1


def decode_profiles(trace: Trace) -> np.ndarray:
    """(R, L, E) float64 per-token decode profiles ``decode_counts / decode_len`` (a request
    without decode steps: zeros)."""
    n = np.maximum(trace.decode_lens, 1).astype(np.float64)
    return trace.decode_counts / n[:, None, None]


def fit_decode_predictor(trace: Trace, *, random_state: int | None = 0,
                         vocab_size: int | None = None, vocab_source: str | None = None,
                         **options) -> PromptPredictor:
    """A :class:`PromptPredictor` fitted on ``trace``'s prompt token ids with the decode
    profiles as targets (requests with a prompt and a decode step). ``options``: the
    predictor's settings (bits, ranks, alphas, weightings, folds ...; ``token`` needs
    prefill experts and is dropped). ``vocab_size``, ``vocab_source``: passed on to
    :meth:`PromptPredictor.fit_prompts`, the vocabulary the predictor records (default 1 +
    the largest id of ``trace``'s prompts; never below the fitted prompts' ids) and where
    it comes from (default ``calibration``, no tokenizer being known here: a later id
    beyond ``vocab_size`` is hashed like any other; with ``tokenizer`` or ``config`` one
    outside ``[0, vocab_size)`` is refused). A caller that predicts on prompts the fit
    never saw (a held-out split) may give 1 + the largest id of both, so that the
    predictor records the ids it is used on."""
    if trace.prompt_token_ids is None:
        raise ValueError(f"trace ({trace.meta.source}) has no prompt_token_ids: a prompt "
                         "predictor needs the prompts")
    keep = np.flatnonzero((trace.prompt_lens > 0) & (trace.decode_lens > 0))
    weightings = tuple(w for w in options.pop("weightings", ("tfidf", "tf")) if w != "token")
    pred = PromptPredictor(random_state=random_state, weightings=weightings or ("tfidf",),
                           **options)
    prompts = [trace.prompt_tokens(int(r)) for r in keep]
    return pred.fit_prompts(prompts, decode_profiles(trace)[keep], top_k=trace.meta.top_k,
                            vocab_size=int(trace.prompt_token_ids.max()) + 1
                            if vocab_size is None else vocab_size,
                            vocab_source=vocab_source)


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


def familiarity(prompts: list[np.ndarray], reference: list[np.ndarray],
                vocab_size: int) -> np.ndarray:
    """(R,) each prompt's highest cosine similarity to a ``reference`` prompt, both as
    unigram TF-IDF over the token ids (IDF from the reference; :func:`token_tfidf`)."""
    from eldr.fit.prompt_eval import token_tfidf

    ref = token_tfidf(reference, reference, vocab_size)
    x = token_tfidf(reference, prompts, vocab_size)
    return (x @ ref.T).max(axis=1) if len(reference) else np.zeros(len(prompts))


STATISTICS = ("coverage", "familiarity")


@dataclass(frozen=True)
class PredictionGate:
    """When a router may route on a prompt prediction (module docstring).

    ``statistic``: ``coverage`` (share of the prompt's hashed n-grams seen in the fit
    prompts) or ``familiarity`` (highest TF-IDF cosine to a fit prompt; the fit prompts'
    unigram TF-IDF rows are kept, so it costs their size)."""

    cv_r2: float  # the predictor's cross-validated R² on its fit data
    min_r2: float  # below it: never route on the prediction
    statistic: str  # "coverage" or "familiarity"
    threshold: float  # a prompt whose statistic is below it: load balancing
    quantile: float  # the calibration quantile the threshold is
    bits: int  # the hash of the coverage (the predictor's)
    seen: np.ndarray  # sorted buckets of the fit prompts' n-grams
    reference: tuple  # the fit prompts (familiarity)
    vocab_size: int

    @classmethod
    def calibrate(cls, predictor: PromptPredictor, prompts: list[np.ndarray], *,
                  statistic: str = "coverage", min_r2: float = MIN_ROUTING_R2,
                  quantile: float = 0.05,
                  folds: int = 3, random_state: int | None = 0) -> PredictionGate:
        """From the fit prompts alone: each fold's held-out prompts' statistic against the
        other folds, its ``quantile`` the per-request threshold."""
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
        bits = predictor.bits_
        vocab = int(max(int(p.max()) for p in prompts)) + 1
        fold = np.random.default_rng(random_state).permutation(len(prompts)) % folds
        values = []
        for f in range(folds):
            train = [p for p, g in zip(prompts, fold, strict=True) if g != f]
            held = [p for p, g in zip(prompts, fold, strict=True) if g == f]
            values.append(ngram_coverage(held, _seen(train, bits), bits)
                          if statistic == "coverage" else familiarity(held, train, vocab))
        threshold = float(np.quantile(np.concatenate(values), quantile))
        return cls(cv_r2=float(predictor.cv_r2_), min_r2=min_r2, statistic=statistic,
                   threshold=threshold, quantile=quantile, bits=bits,
                   seen=_seen(prompts, bits), reference=tuple(prompts), vocab_size=vocab)

    @property
    def enabled(self) -> bool:
        """Whether the predictor is good enough to route on at all."""
        return bool(np.isfinite(self.cv_r2) and self.cv_r2 >= self.min_r2)

    def score(self, prompts: list[np.ndarray]) -> np.ndarray:
        """(R,) the gate's statistic of each prompt."""
        if self.statistic == "coverage":
            return ngram_coverage(prompts, self.seen, self.bits)
        vocab = max(self.vocab_size, max(int(p.max()) for p in prompts) + 1)
        return familiarity(prompts, list(self.reference), vocab)

    def admit(self, prompts: list[np.ndarray]) -> np.ndarray:
        """(R,) bool: route on the prediction (True) or by load alone (False)."""
        if not self.enabled:
            return np.zeros(len(prompts), dtype=bool)
        return self.score(prompts) >= self.threshold

    def as_dict(self) -> dict:
        return {"statistic": self.statistic, "cv_r2": round(self.cv_r2, 6),
                "min_r2": self.min_r2, "threshold": round(self.threshold, 6),
                "quantile": self.quantile, "enabled": self.enabled}
