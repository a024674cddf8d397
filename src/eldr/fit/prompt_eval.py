"""Held-out evidence for the prompt predictor
(docs/fit-and-routing.md#the-prompt-predictor-eldrfitprompt).

:func:`evaluate_prompt_predictor` splits a captured trace in two (seeded), fits the
signature encoder and the :class:`~eldr.fit.prompt.PromptPredictor` on one part and, on
the held-out part, compares three ways of knowing a request before its decode:

- ``prompt``: the encoder applied to the predicted profile (routing before prefill);
- ``prefill``: the real prefill signature (routing after prefill, what ELDR does today);
- ``tfidf``: the raw TF-IDF of the prompt's token ids (unigrams over the vocabulary, IDF
  from the fit part): what a router could use with no model of the experts at all.

For each: ρ against the decode patterns (:func:`eldr.fit.signature.rho`, all pairs) and
routed locality (:func:`routed_locality`). For the predictor also R² of the profile
(against the fit part's mean profile). Synthetic traces draw token ids uniformly, so the
evaluation means something on captured traces only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eldr.fit.cluster import BalancedKMeans
from eldr.fit.prompt import PromptPredictor
from eldr.fit.rows import unit_rows
from eldr.fit.signature import SignatureEncoder, rho
from eldr.traces.trace import Trace

__all__ = ["PromptEvaluation", "RoutedLocality", "evaluate_prompt_predictor",
           "expected_distinct_experts", "routed_locality", "token_tfidf"]

SOURCES = ("prompt", "prefill", "tfidf")


def token_tfidf(fit_prompts: list[np.ndarray], prompts: list[np.ndarray],
                vocab_size: int) -> np.ndarray:
    """(R, vocab_size) float64 unit rows: ``log(1 + tf) · idf`` of each prompt's token ids,
    IDF ``log((N + 1) / (df + 1)) + 1`` over ``fit_prompts``."""
    df = np.zeros(vocab_size)
    for p in fit_prompts:
        df[np.unique(p)] += 1
    idf = np.log((len(fit_prompts) + 1.0) / (df + 1.0)) + 1.0
    out = np.zeros((len(prompts), vocab_size))
    for i, p in enumerate(prompts):
        ids, counts = np.unique(p, return_counts=True)
        out[i, ids] = np.log1p(counts) * idf[ids]
    return unit_rows(out)


def expected_distinct_experts(decode_probs: np.ndarray, labels: np.ndarray,
                              num_groups: int) -> float:
    """Mean over groups and layers of the expected distinct experts of one decode step
    of a batch holding every request of the group.

    ``decode_probs`` (R, L, E): each request's per-token decode inclusion probabilities
    (``decode_counts / decode_len``). Requests are independent, so a group's expected
    union at a layer is ``Σ_e 1 − Π_r (1 − π_re)`` (as :mod:`eldr.fit.premises` does).
    """
    p = np.minimum(np.asarray(decode_probs, dtype=np.float64), 1.0 - 1e-12)
    log_miss = np.log1p(-p)
    member = np.zeros((num_groups, p.shape[0]))
    member[np.asarray(labels), np.arange(p.shape[0])] = 1.0
    hit = 1.0 - np.exp(np.einsum("gr,rle->gle", member, log_miss))
    return float(hit.sum(axis=2).mean())


@dataclass(frozen=True)
class RoutedLocality:
    """Distinct experts per layer per decode step when requests are grouped by a signature."""

    clustered: float  # mean expected distinct experts per layer per step, grouped by signature
    round_robin: float  # the same for random balanced splits (mean over draws)
    reduction: float  # 1 − clustered / round_robin
    num_groups: int  # K decoders


def routed_locality(signatures: np.ndarray, decode_probs: np.ndarray, num_groups: int, *,
                    draws: int = 20, n_init: int = 4,
                    random_state: int | None = 0) -> RoutedLocality:
    """Group the requests into ``num_groups`` equal decoders by balanced spherical
    K-means on ``signatures`` (R, d), and compare the expected distinct experts of a
    step of each decoder's batch (:func:`expected_distinct_experts`) with round robin
    (``draws`` random balanced splits: a load balancer that ignores content)."""
    x = np.asarray(signatures, dtype=np.float64)
    km = BalancedKMeans(num_groups, n_init=n_init, random_state=random_state).fit(x)
    clustered = expected_distinct_experts(decode_probs, km.labels_, num_groups)
    rng = np.random.default_rng(random_state)
    base = np.arange(x.shape[0]) % num_groups
    rr = float(np.mean([expected_distinct_experts(decode_probs, rng.permutation(base),
                                                  num_groups) for _ in range(draws)]))
    return RoutedLocality(clustered, rr, 1.0 - clustered / rr, num_groups)


@dataclass(frozen=True)
class PromptEvaluation:
    """What :func:`evaluate_prompt_predictor` measured on the held-out requests."""

    r2: float  # R² of the predicted prefill profile (vs the fit part's mean profile)
    rho: dict  # source -> ρ against decode patterns (held-out, all pairs)
    locality: dict  # source -> RoutedLocality
    num_fit: int  # requests the encoder and the predictor were fitted on
    num_heldout: int  # requests evaluated
    predictor: PromptPredictor  # the fitted predictor
    encoder: SignatureEncoder  # the fitted signature encoder

    def as_dict(self) -> dict:
        return {"r2": self.r2, "rho": dict(self.rho),
                "distinct_experts_per_step": {k: v.clustered for k, v in self.locality.items()},
                "round_robin": next(iter(self.locality.values())).round_robin,
                "reduction_vs_round_robin": {k: v.reduction for k, v in self.locality.items()},
                "num_groups": next(iter(self.locality.values())).num_groups,
                "num_fit": self.num_fit, "num_heldout": self.num_heldout,
                "predictor": {k: v for k, v in self.predictor.summary().items()
                              if k != "grid"}}


def evaluate_prompt_predictor(trace: Trace, *, heldout: float = 0.5, num_groups: int = 8,
                              predictor_options: dict | None = None,
                              random_state: int | None = 0) -> PromptEvaluation:
    """Fit on a seeded ``1 − heldout`` share of ``trace`` (requests with a prompt and a
    decode token), evaluate on the rest (module docstring)."""
    if trace.prompt_token_ids is None:
        raise ValueError(f"trace ({trace.meta.source}) has no prompt_token_ids")
    if not 0.0 < heldout < 1.0:
        raise ValueError(f"heldout must be in (0, 1), got {heldout}")
    usable = np.flatnonzero((trace.prompt_lens > 0) & (trace.decode_lens > 0))
    rng = np.random.default_rng(random_state)
    order = rng.permutation(usable)
    n_held = round(heldout * order.size)
    held_idx, fit_idx = np.sort(order[:n_held]), np.sort(order[n_held:])
    if fit_idx.size < 6 or held_idx.size < max(3, 2 * num_groups):
        raise ValueError(f"too few usable requests ({usable.size}) for a {heldout:g} held-out "
                         f"split with {num_groups} groups")
    fit, held = trace.subset(fit_idx), trace.subset(held_idx)
    enc = SignatureEncoder(random_state=random_state).fit(fit)
    pred = PromptPredictor(random_state=random_state, **(predictor_options or {})).fit(fit)
    prompts = [held.prompt_tokens(r) for r in range(held.num_requests)]
    # the held-out part may hold ids the fit part never saw: the predictor, fitted without
    # a vocabulary, hashes them; the raw TF-IDF needs a vocabulary holding both parts' ids
    vocab = max(pred.vocab_size, int(held.prompt_token_ids.max()) + 1)
    profiles = pred.predict_many(prompts)
    truth = held.prefill_counts / held.prompt_lens[:, None, None].astype(np.float64)
    mean = (fit.prefill_counts / fit.prompt_lens[:, None, None].astype(np.float64)).mean(0)
    sst = float(((truth - mean) ** 2).sum())
    r2 = 1.0 - float(((profiles - truth) ** 2).sum()) / sst if sst > 0 else float("nan")
    fit_prompts = [fit.prompt_tokens(r) for r in range(fit.num_requests)]
    signatures = {
        "prompt": enc.transform(profiles),
        "prefill": enc.transform(held),
        "tfidf": token_tfidf(fit_prompts, prompts, vocab),
    }
    dec_probs = held.decode_counts / held.decode_lens[:, None, None].astype(np.float64)
    rhos = {k: rho(s, held.decode_counts) for k, s in signatures.items()}
    loc = {k: routed_locality(s, dec_probs, num_groups, random_state=random_state)
           for k, s in signatures.items()}
    return PromptEvaluation(r2=r2, rho=rhos, locality=loc, num_fit=int(fit_idx.size),
                            num_heldout=int(held_idx.size), predictor=pred, encoder=enc)
