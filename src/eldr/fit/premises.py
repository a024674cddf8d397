"""Measurements of the paper's premises on a trace.

These are the statistics that make expert-locality routing worthwhile (docs/method.md#why-it-works):
prefill expert counts predict decode expert counts, and same-domain batches activate fewer
distinct experts. They are used to check synthetic traces against published numbers and to
report what real traces show.

* :func:`prefill_decode_pearson`: per-request Pearson of prefill vs decode counts;
* :func:`distinct_experts_reduction`: distinct experts per layer of same-domain vs mixed
  decode batches (one step of 16 requests);
* :func:`effective_experts`: exp(entropy) of each layer's expert popularity;
* :func:`representation_rho`: ρ (docs/method.md Eq. 1) of signature representations;
* :func:`calibration_report`: all of the above next to the published targets.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eldr.traces.trace import Trace

__all__ = [
    "PEARSON_TARGETS",
    "REDUCTION_TARGETS",
    "DistinctExperts",
    "PremiseRow",
    "calibration_report",
    "distinct_experts_reduction",
    "effective_experts",
    "format_report",
    "prefill_decode_pearson",
    "representation_rho",
]

# Published per-request prefill↔decode Pearson (paper §3.3, Fig. 3), tolerance ±0.05.
# Qwen3-235B-A22B has no published figure: 0.90 is ASSUMED (same family as Qwen3-30B).
PEARSON_TARGETS: dict[str, float] = {
    "qwen3-30b-a3b": 0.90,
    "gpt-oss-120b": 0.70,
    "gemma-4-26b-a4b": 0.92,
    "qwen3-235b-a22b": 0.90,
}
PEARSON_TOLERANCE = 0.05
# Same-domain batches activate this many fewer distinct experts than mixed (paper §3.4).
REDUCTION_TARGETS: dict[str, tuple[float, float]] = {
    "task": (0.17, 0.21),
    "language": (0.03, 0.10),
}
# Effective experts per layer as a fraction of E (the issue's sanity band).
EFFECTIVE_EXPERTS_BAND = (0.50, 0.95)


def prefill_decode_pearson(trace: Trace) -> np.ndarray:
    """(R,) float64: per-request Pearson correlation of prefill vs decode per-expert counts.

    The two count vectors are flattened over all layers and experts (L*E entries each).
    A request whose prefill or decode counts are constant (e.g. no decode tokens) has no
    defined correlation: its entry is NaN, and callers summarise with ``nan``-aware
    statistics.
    """
    R = trace.num_requests
    trace.require_prefill("the prefill-decode Pearson premise")
    x = trace.prefill_counts.reshape(R, -1).astype(np.float64)
    y = trace.decode_counts.reshape(R, -1).astype(np.float64)
    x -= x.mean(axis=1, keepdims=True)
    y -= y.mean(axis=1, keepdims=True)
    num = (x * y).sum(axis=1)
    den = np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1))
    out = np.full(R, np.nan)
    ok = den > 0
    out[ok] = num[ok] / den[ok]
    return out


# -- distinct experts of a decode step -----------------------------------------------------
@dataclass(frozen=True)
class DistinctExperts:
    """Mean distinct experts per layer of one decode step, same-domain vs mixed batches."""

    same_domain: float  # mean over batches and layers, batches of one domain
    mixed: float  # mean over batches and layers, batches drawn from the whole trace
    reduction: float  # 1 - same_domain / mixed
    per_layer_same: np.ndarray  # (L,) float64 mean over batches
    per_layer_mixed: np.ndarray  # (L,) float64 mean over batches
    batch_size: int  # requests per batch
    num_batches: int  # batches of each kind
    source: str  # "decode_topk" (a recorded token) or "decode_counts" (expectation)


def _expected_union_from_counts(trace: Trace, batches: list[np.ndarray]) -> np.ndarray:
    """(num_batches, L) float64: expected distinct experts of one decode step per batch.

    Each request contributes one decode token whose k distinct experts have inclusion
    probabilities ``π = counts / decode_len`` (each ≤ 1, summing to k). Requests are
    independent, so the expected union is ``Σ_e 1 - Π_r (1 - π_re)``, whatever the joint
    law of a token's k experts: this is the exact mean of sampling such tokens, without
    the sampling noise. One matrix product over all batches.
    """
    idx = np.unique(np.concatenate(batches))
    pos = np.searchsorted(idx, np.concatenate(batches))
    R, L, E = idx.size, trace.meta.num_layers, trace.meta.num_experts
    pi = trace.decode_counts[idx].reshape(R, L * E) / trace.decode_lens[idx, None]
    log_miss = np.log1p(-np.minimum(pi, 1.0 - 1e-12))  # finite, so 0 * log_miss is 0
    member = np.zeros((len(batches), R))
    member[np.repeat(np.arange(len(batches)), [b.size for b in batches]), pos] = 1.0
    hit = 1.0 - np.exp(member @ log_miss)  # (num_batches, L*E)
    return hit.reshape(len(batches), L, E).sum(axis=2)


def _step_masks_from_topk(rng: np.random.Generator, trace: Trace, idx: np.ndarray) -> np.ndarray:
    """(B, L, E) bool: a uniformly random recorded decode token of each request."""
    L, E = trace.meta.num_layers, trace.meta.num_experts
    off = trace.decode_offsets
    rows = off[idx] + (rng.random(idx.size) * trace.decode_lens[idx]).astype(np.int64)
    sel = trace.decode_topk[rows].astype(np.int64)  # (B, L, k)
    mask = np.zeros((idx.size, L, E), dtype=bool)
    np.put_along_axis(mask, sel, True, axis=2)
    return mask


def distinct_experts_reduction(
    trace: Trace,
    *,
    batch_size: int = 16,
    num_batches: int = 200,
    random_state=0,
) -> DistinctExperts:
    """Distinct experts per layer of same-domain vs mixed decode batches (paper §3.4).

    A batch is ``batch_size`` requests with at least one decode token, each contributing
    one decode token (one step). Same-domain batches: a domain is drawn in proportion to
    its eligible requests (domains with fewer than ``batch_size`` are skipped), then the
    requests. Mixed batches: requests drawn from the whole trace, i.e. the workload's
    natural mix. The token is a random row of ``decode_topk`` when the trace has it; else
    the step is a token of k distinct experts with the request's decode frequencies,
    evaluated in expectation (:func:`_expected_union_from_counts`).
    """
    if trace.domains is None:
        raise ValueError("distinct_experts_reduction needs a trace with domain labels")
    if batch_size < 2 or num_batches < 1:
        raise ValueError(f"need batch_size >= 2 and num_batches >= 1, got {batch_size}, "
                         f"{num_batches}")
    rng = np.random.default_rng(random_state)
    eligible = np.flatnonzero(trace.decode_lens > 0)
    if eligible.size < batch_size:
        raise ValueError(f"only {eligible.size} requests have decode tokens; need "
                         f">= batch_size={batch_size}")
    doms = trace.domains[eligible]
    sizes = np.bincount(doms, minlength=len(trace.domain_names))
    ok = np.flatnonzero(sizes >= batch_size)
    if ok.size == 0:
        raise ValueError(f"no domain has {batch_size} requests with decode tokens")
    by_dom = {int(d): eligible[doms == d] for d in ok}
    share = sizes[ok] / sizes[ok].sum()
    same = [rng.choice(by_dom[int(d)], batch_size, replace=False)
            for d in rng.choice(ok, size=num_batches, p=share)]
    mixed = [rng.choice(eligible, batch_size, replace=False) for _ in range(num_batches)]
    def union(batches: list[np.ndarray]) -> np.ndarray:  # (num_batches, L)
        if trace.decode_topk is None:
            return _expected_union_from_counts(trace, batches)
        m = _step_masks_from_topk(rng, trace, np.concatenate(batches))
        m = m.reshape(num_batches, batch_size, *m.shape[1:])
        return m.any(axis=1).sum(axis=2).astype(np.float64)

    u_same, u_mixed = union(same), union(mixed)
    s, mx = float(u_same.mean()), float(u_mixed.mean())
    return DistinctExperts(
        same_domain=s, mixed=mx, reduction=1.0 - s / mx,
        per_layer_same=u_same.mean(axis=0), per_layer_mixed=u_mixed.mean(axis=0),
        batch_size=batch_size, num_batches=num_batches,
        source="decode_topk" if trace.decode_topk is not None else "decode_counts",
    )


def effective_experts(trace: Trace) -> np.ndarray:
    """(L,) float64: exp(entropy) of each layer's expert popularity.

    Popularity = all selections of the trace at that layer (prefill + decode counts summed
    over requests; a decode-only trace: decode counts alone). E when every expert is equally
    popular, 1 when one expert takes all.
    """
    pop = trace.decode_counts.sum(axis=0, dtype=np.int64)
    if trace.has_prefill:
        pop = pop + trace.prefill_counts.sum(axis=0, dtype=np.int64)
    pop = pop.astype(np.float64)
    tot = pop.sum(axis=1, keepdims=True)
    p = np.divide(pop, tot, out=np.zeros_like(pop), where=tot > 0)
    logp = np.log(p, out=np.zeros_like(p), where=p > 0)
    return np.exp(-(p * logp).sum(axis=1))


def representation_rho(
    trace: Trace,
    representations: Sequence[str] = ("count_idf", "gate_prob"),
    *,
    max_requests: int | None = 800,
    max_pairs: int | None = 100_000,
    random_state=0,
) -> dict[str, float]:
    """ρ of each signature representation with ALL layers in the mask (equal footing).

    The greedy layer mask is left out on purpose: it would pick a different mask per
    representation and cost hundreds of ρ evaluations. ``max_requests`` subsamples
    requests (seeded) to bound the cost.
    """
    from eldr.fit.signature import SignatureEncoder  # lazy: only this measurement needs it

    rng = np.random.default_rng(random_state)
    t = trace
    if max_requests is not None and trace.num_requests > max_requests:
        t = trace.subset(np.sort(rng.choice(trace.num_requests, max_requests, replace=False)))
    layers = list(range(t.meta.num_layers))
    out = {}
    for rep in representations:
        enc = SignatureEncoder(representation=rep, layers=layers, max_pairs=max_pairs,
                               random_state=random_state)
        out[rep] = float(enc.fit(t).rho_)
    return out


# -- the report --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PremiseRow:
    """One premise: what the trace shows next to what the paper reports."""

    premise: str  # short description
    measured: float  # the measured value (NaN when it could not be measured)
    target: str  # the published value or band, as text
    ok: bool | None  # within the target; None when there is no target for this trace
    detail: str = ""  # extra measured figures


def _infer_workload(trace: Trace) -> str | None:
    m = re.match(r"synthetic:[^:]+:([^:]+):", trace.meta.source)
    if m:
        return m.group(1)
    if trace.domain_names is not None:
        from eldr.traces.workloads import WORKLOADS

        for name, wl in WORKLOADS.items():
            if tuple(trace.domain_names) == wl.domain_names:
                return name
    return None


def calibration_report(
    trace: Trace,
    model: str | None = None,
    *,
    workload: str | None = None,
    with_rho: bool = True,
    rho_max_requests: int | None = 800,
    rho_max_pairs: int | None = 100_000,
    random_state=0,
) -> list[PremiseRow]:
    """Every premise measured on ``trace`` next to its published target.

    model: preset name (default ``trace.meta.model``) for the Pearson target; workload:
    ``task``/``language`` for the reduction target (default: read from a synthetic trace's
    source or matched by its domain names). ``with_rho=False`` skips the ρ premise (the
    slowest measurement); ``rho_max_requests``/``rho_max_pairs`` bound its cost
    (:func:`representation_rho`).
    """
    model = str(getattr(model, "name", model) or trace.meta.model).lower()
    workload = workload or _infer_workload(trace)
    rows: list[PremiseRow] = []

    pear = prefill_decode_pearson(trace)
    mean_p = float(np.nanmean(pear)) if np.isfinite(pear).any() else float("nan")
    target = PEARSON_TARGETS.get(model)
    rows.append(PremiseRow(
        "prefill-decode Pearson (mean per request)", mean_p,
        "n/a" if target is None else f"{target:.2f} ± {PEARSON_TOLERANCE:.2f}"
        + (" (assumed)" if model == "qwen3-235b-a22b" else ""),
        None if target is None else bool(abs(mean_p - target) <= PEARSON_TOLERANCE),
        f"median {np.nanmedian(pear):.3f}" if np.isfinite(pear).any() else "",
    ))

    if trace.domains is not None:
        red = distinct_experts_reduction(trace, random_state=random_state)
        band = REDUCTION_TARGETS.get(workload or "")
        rows.append(PremiseRow(
            "same-domain batch: fewer distinct experts", red.reduction,
            "n/a" if band is None else f"{band[0]:.0%}-{band[1]:.0%} ({workload})",
            None if band is None else bool(band[0] <= red.reduction <= band[1]),
            f"{red.same_domain:.1f} vs {red.mixed:.1f} experts/layer, "
            f"{red.batch_size} requests x {red.num_batches} batches, {red.source}",
        ))

    if with_rho and trace.prefill_gate_prob is not None and trace.num_requests >= 3:
        r = representation_rho(trace, max_requests=rho_max_requests, max_pairs=rho_max_pairs,
                               random_state=random_state)
        rows.append(PremiseRow(
            "rho(count_idf) - rho(gate_prob)", r["count_idf"] - r["gate_prob"],
            "> 0 (paper 0.76 vs 0.62)", bool(r["count_idf"] > r["gate_prob"]),
            f"count_idf {r['count_idf']:.3f}, gate_prob {r['gate_prob']:.3f}",
        ))

    eff = effective_experts(trace) / trace.meta.num_experts
    lo, hi = EFFECTIVE_EXPERTS_BAND
    rows.append(PremiseRow(
        "effective experts / E (min over layers)", float(eff.min()),
        f"every layer in {lo:.0%}-{hi:.0%}", bool((eff >= lo).all() and (eff <= hi).all()),
        f"min {eff.min():.2f}, max {eff.max():.2f}",
    ))
    return rows


def format_report(rows: Sequence[PremiseRow]) -> str:
    """A plain-text table of :func:`calibration_report` rows."""
    head = ("premise", "measured", "target", "ok", "detail")
    body = [(r.premise, f"{r.measured:.3f}", r.target,
             "-" if r.ok is None else ("yes" if r.ok else "NO"), r.detail) for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(4)]
    lines = []
    for row in (head, *body):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True))
                     + "  " + row[4])
    return "\n".join(lines)
