"""The prompt predictor on traffic it was and was not fitted on (docs/real-models.md, "The
prompt predictor on real data").

:func:`evaluate_families` fits on half of the ``fit_domains`` requests and measures on
three routed sets: the other half of those domains (in family), the ``heldout_domains``
(a family the fit never saw), and both mixed. For each: R² of the predicted decode
profiles (against the fit part's mean profile), ρ, and the distinct-expert cut against
round robin with bootstrap intervals (:func:`eldr.fit.locality.bootstrap_locality`) of
routing on

- ``prompt``: the prediction, always;
- ``gated_coverage``, ``gated_familiarity``: the prediction where the
  :class:`~eldr.fit.prompt_decode.PredictionGate` with that statistic admits it, load
  balancing where not (an all-zero signature);
- ``oracle``: each request's own whole decode (the bound).

Predictor variants (each fitted on the same fit half, each reported; none is chosen by
its held-out result):

- ``prompt``: hashed n-grams of the whole prompt → decode profile
  (:func:`~eldr.fit.prompt_decode.fit_decode_predictor`: ridge, cross-validated choice);
- ``decode_tokens``: the ``token`` model learned from the GENERATED tokens' own routing
  (``decode_token_ids`` + ``decode_topk``: which experts each generated token and bigram
  selects when it is read), applied to the prompt's tokens: a guess that a request's output
  routes like its prompt's words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eldr.fit.locality import (
    CutEstimate,
    Window,
    _counts_view,
    _encoded,
    _r2,
    bootstrap_locality,
    step_masks,
)
from eldr.fit.prompt import PromptPredictor
from eldr.fit.prompt_decode import (
    STATISTICS,
    PredictionGate,
    decode_profiles,
    fit_decode_predictor,
)
from eldr.traces.trace import Trace

__all__ = ["VARIANTS", "FamilyResult", "evaluate_families"]

VARIANTS = ("prompt", "decode_tokens")


@dataclass(frozen=True)
class FamilyResult:
    """One routed set (in family, held-out family, mixed) under one predictor variant."""

    variant: str
    routed_set: str  # "in_family", "heldout_family", "mixed"
    requests: int
    r2: float  # of the predicted decode profiles
    admitted: dict  # gate statistic -> share of requests it lets route on the prediction
    rho: dict  # input -> (rho, low, high)
    cuts: dict  # input -> [CutEstimate]

    def as_dict(self) -> dict:
        return {"variant": self.variant, "routed_set": self.routed_set,
                "requests": self.requests, "r2": round(self.r2, 6),
                "admitted": {k: round(v, 6) for k, v in self.admitted.items()},
                "rho": {k: [round(x, 6) for x in v] for k, v in self.rho.items()},
                "cuts": {k: [c.as_dict() for c in v] for k, v in self.cuts.items()}}


def _decode_token_predictor(fit: Trace, random_state: int) -> PromptPredictor:
    """The ``token`` model on the generated tokens: sequences = each request's decode
    token ids, per-token experts = its decode rows."""
    if fit.decode_token_ids is None or fit.decode_topk is None:
        raise ValueError("the decode_tokens variant needs decode_token_ids and decode_topk")
    off = fit.decode_offsets
    keep = [r for r in range(fit.num_requests) if fit.decode_lens[r] > 0]
    seqs = [fit.decode_token_ids[off[r]:off[r + 1]] for r in keep]
    experts = [fit.decode_topk[off[r]:off[r + 1]] for r in keep]
    vocab = int(max(fit.decode_token_ids.max(), fit.prompt_token_ids.max())) + 1
    pred = PromptPredictor(weightings=("token",), random_state=random_state)
    return pred.fit_prompts(seqs, decode_profiles(fit)[keep], top_k=fit.meta.top_k,
                            vocab_size=vocab, token_experts=experts)


def evaluate_families(trace: Trace, *, fit_domains: Sequence[str],
                      heldout_domains: Sequence[str], num_decoders: int = 8,
                      batch_sizes: Sequence[int] = (4, 8), window: Window | None = None,
                      tau: float = 0.1, resamples: int = 500, seed: int = 0,
                      variants: Sequence[str] = VARIANTS) -> tuple[list[FamilyResult], dict]:
    """(results per variant and routed set, facts: sizes, the gate, the fitted predictors'
    choices). Requests need ``window.stop`` decode steps (default 16–64)."""
    if trace.domains is None or trace.prompt_token_ids is None:
        raise ValueError("needs domain labels and prompt token ids")
    window = Window(16, 64) if window is None else window
    names = list(trace.domain_names)
    unknown = [d for d in (*fit_domains, *heldout_domains) if d not in names]
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}; the trace has {names}")
    ok = trace.decode_lens >= window.stop
    in_fam = np.flatnonzero(ok & np.isin(trace.domains, [names.index(d) for d in fit_domains]))
    out_fam = np.flatnonzero(ok & np.isin(trace.domains,
                                          [names.index(d) for d in heldout_domains]))
    perm = np.random.default_rng([seed, 0]).permutation(in_fam)
    fit_idx, held_in = np.sort(perm[:perm.size // 2]), np.sort(perm[perm.size // 2:])
    fit = trace.subset(fit_idx)
    sig_fit = _counts_view(fit, fit.decode_counts, fit.decode_lens)
    predictors = {}
    if "prompt" in variants:
        predictors["prompt"] = fit_decode_predictor(fit, random_state=seed)
    if "decode_tokens" in variants:
        predictors["decode_tokens"] = _decode_token_predictor(fit, seed)
    fit_prompts = [fit.prompt_tokens(r) for r in range(fit.num_requests)]
    mean = decode_profiles(fit).mean(axis=0)
    sets = {"in_family": held_in, "heldout_family": out_fam,
            "mixed": np.sort(np.concatenate([held_in, out_fam]))}
    results, gates = [], {}
    for variant, pred in predictors.items():
        gate = {s: PredictionGate.calibrate(pred, fit_prompts, statistic=s,
                                            random_state=seed) for s in STATISTICS}
        gates[variant] = {s: g.as_dict() for s, g in gate.items()}
        for set_name, idx in sets.items():
            results.append(_measure(trace, fit, sig_fit, idx, pred, gate, mean, variant,
                                    set_name, num_decoders, batch_sizes, window, tau,
                                    resamples, seed))
    facts = {"fit_domains": list(fit_domains), "heldout_domains": list(heldout_domains),
             "window": [window.start, window.stop], "decoders": num_decoders,
             "requests": {"fit": int(fit_idx.size), "in_family": int(held_in.size),
                          "heldout_family": int(out_fam.size)},
             "gates": gates,
             "predictors": {v: {k: x for k, x in p.summary().items() if k != "grid"}
                            for v, p in predictors.items()}}
    return results, facts


def _measure(trace: Trace, fit: Trace, sig_fit: Trace, idx: np.ndarray, pred, gate,
             mean: np.ndarray, variant: str, set_name: str, K: int,
             batch_sizes: Sequence[int], window: Window, tau: float, resamples: int,
             seed: int) -> FamilyResult:
    routed = trace.subset(idx)
    prompts = [routed.prompt_tokens(r) for r in range(routed.num_requests)]
    profiles = pred.predict_many(prompts)
    r2 = _r2(profiles, decode_profiles(routed), mean)
    sig_routed = _counts_view(routed, routed.decode_counts, routed.decode_lens)
    oracle_sig, centroids, enc = _encoded(sig_fit, sig_routed, K, seed)
    predicted = enc.transform(profiles)
    inputs = {"prompt": (predicted, centroids)}
    admitted = {}
    for stat, g in gate.items():
        admit = g.admit(prompts)
        admitted[stat] = float(admit.mean())
        inputs[f"gated_{stat}"] = (np.where(admit[:, None], predicted, 0.0), centroids)
    inputs["oracle"] = (oracle_sig, centroids)
    sizes = [b for b in batch_sizes if 2 * b * K <= routed.num_requests]
    if not sizes:
        return FamilyResult(variant, set_name, routed.num_requests, r2, admitted, {}, {})
    res = bootstrap_locality(step_masks(routed, window),
                             routed.decode_counts.reshape(routed.num_requests, -1), inputs,
                             num_decoders=K, batch_sizes=sizes, tau=tau,
                             resamples=resamples, seed=seed)
    cuts: dict[str, list[CutEstimate]] = {k: v[1] for k, v in res.items()}
    return FamilyResult(variant, set_name, routed.num_requests, r2, admitted,
                        {k: v[0] for k, v in res.items()}, cuts)
