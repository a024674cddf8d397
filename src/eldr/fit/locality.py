"""Expert locality measured on per-token routing: what grouping requests by a routing input
buys in distinct experts per decode step, against round robin (docs/real-models.md).

The measurement, for a trace with per-token decode experts (``decode_topk``):

- **requests**: those with at least ``window.stop`` decode steps; split in two, seeded:
  everything is fitted on one half (the encoder, the clusters, the prompt predictor) and
  measured on the other, never on data it was fitted on;
- **routing**: each routed request has a signature row (an input: the prefill signature,
  its own whole-decode profile as an oracle, a domain label, a prompt prediction, ...);
  the fitted half's signatures are clustered into K balanced centroids (one per decoder)
  and the routed requests arrive one by one, in a seeded random order, at the locality
  band (:func:`band_assign`: the decoders within τ of the best cosine, the least loaded of
  them; loads are the requests assigned so far, capped at ⌈N / K⌉, as a balancer keeps
  them level). An all-zero signature (an input the router does not have, or refuses)
  makes the band every decoder: load balancing;
- **round robin**: the same requests dealt to the K decoders at random, equally;
- **batches**: each decoder's requests run in lockstep batches of B (⌊n_d / B⌋ full
  batches, in a random order, the rest left out); per decode step of ``window`` and per
  layer, a batch selects the union of its requests' experts. The figure is the mean over
  batches, steps and layers of that union's size, "distinct experts per layer per step",
  and the **cut** is ``1 − routed / round robin``;
- **intervals**: 95 % percentile intervals over bootstrap resamples of the routed requests
  (seeded; the fit held fixed; the same resamples for every input, so inputs compare
  paired). A request drawn twice is never batched with its copy: copies of one request are
  dealt to different batches of their decoder, and copies beyond the decoder's batch count
  are left out. ρ's interval leaves out the pairs of a request with its own copy.

The module is numpy only (with the fit package's encoder, K-means and prompt predictor);
``eldr score`` and ``eldr advise`` call :func:`real_locality`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from eldr.fit.cluster import BalancedKMeans
from eldr.fit.prompt_decode import decode_profiles, fit_decode_predictor
from eldr.fit.rows import unit_rows
from eldr.fit.signature import SignatureEncoder, _rankdata, rho
from eldr.traces.trace import Trace

__all__ = ["INPUTS", "CutEstimate", "InputLocality", "LocalityReport", "Window",
           "band_assign", "batch_distinct", "bootstrap_locality", "real_locality",
           "round_robin_assign", "step_masks"]

# routing inputs real_locality knows, in report order, with their labels
INPUTS = {
    "prefill": "prefill signature",
    "oracle": "whole-decode oracle",
    "standin": "first decode tokens (stand-in)",
    "domain": "domain label",
    "prompt": "prompt prediction",
}


@dataclass(frozen=True)
class Window:
    """Decode steps ``start .. stop − 1`` over which distinct experts are counted."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"window: need 0 <= start < stop, got {self.start}..{self.stop}")

    @property
    def steps(self) -> int:
        return self.stop - self.start


# -- per-token expert sets ---------------------------------------------------------------------
def step_masks(trace: Trace, window: Window, requests: np.ndarray | None = None) -> np.ndarray:
    """(R', W, L, words) uint64: per request of ``requests`` (default all), decode step of
    ``window`` and layer, the bitset of its selected experts (64 experts per word). Every
    request must have at least ``window.stop`` decode steps."""
    if trace.decode_topk is None:
        raise ValueError("distinct experts per step need per-token decode experts "
                         "(decode_topk); this trace has only counts")
    idx = np.arange(trace.num_requests) if requests is None else np.asarray(requests)
    short = trace.decode_lens[idx] < window.stop
    if short.any():
        raise ValueError(f"request {int(idx[short][0])} has fewer than {window.stop} decode "
                         "steps")
    E = trace.meta.num_experts
    words = -(-E // 64)
    off = trace.decode_offsets
    rows = (off[idx][:, None] + np.arange(window.start, window.stop)[None, :]).ravel()
    ids = trace.decode_topk[rows].astype(np.int64)  # (R'·W, L, k)
    out = np.zeros((ids.shape[0], ids.shape[1], words), dtype=np.uint64)
    bits = np.left_shift(np.uint64(1), (ids % 64).astype(np.uint64))
    for w in range(words):
        mine = (ids // 64) == w
        out[:, :, w] = np.bitwise_or.reduce(np.where(mine, bits, np.uint64(0)), axis=2)
    return out.reshape(idx.size, window.steps, ids.shape[1], words)


_BYTE_POP = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _popcount_sum(x: np.ndarray) -> int:
    """Σ of the set bits of a uint64 array."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return int(np.bitwise_count(x).sum(dtype=np.int64))
    return int(_BYTE_POP[np.ascontiguousarray(x).view(np.uint8)].sum(dtype=np.int64))


# -- assignment -------------------------------------------------------------------------------
def band_assign(signatures: np.ndarray, centroids: np.ndarray, *, tau: float = 0.1,
                order: np.ndarray | None = None) -> np.ndarray:
    """(N,) decoder of each request under the locality band (module docstring): requests
    arrive in ``order`` (default 0 .. N − 1); each goes to the least-loaded decoder among
    those whose centroid's cosine is within ``tau`` of the best (ties: the higher cosine,
    then the lower index); a decoder holding ⌈N / K⌉ requests takes no more."""
    s = np.asarray(signatures, dtype=np.float64)
    c = np.asarray(centroids, dtype=np.float64)
    N, K = s.shape[0], c.shape[0]
    sims = s @ c.T  # rows are unit (or zero): cosines
    cap = -(-N // K)
    loads = np.zeros(K, dtype=np.int64)
    labels = np.empty(N, dtype=np.int64)
    for i in (range(N) if order is None else order):
        row = sims[i]
        open_ = loads < cap
        best = row[open_].max()
        band = np.flatnonzero(open_ & (row >= best - tau - 1e-12))
        low = loads[band].min()
        cand = band[loads[band] == low]
        pick = cand[np.argmax(row[cand])]
        labels[i] = pick
        loads[pick] += 1
    return labels


def round_robin_assign(n: int, num_decoders: int, rng: np.random.Generator) -> np.ndarray:
    """(n,) decoders of n requests dealt equally in a random order (a load balancer that
    ignores content: every decoder holds ⌊n / K⌋ or ⌈n / K⌉)."""
    return rng.permutation(np.arange(n) % num_decoders)


def batch_distinct(masks: np.ndarray, labels: np.ndarray, num_decoders: int, batch_size: int,
                   rng: np.random.Generator, origin: np.ndarray | None = None
                   ) -> tuple[float, int, int]:
    """(mean distinct experts per layer per step, requests batched, batches) of lockstep
    batches of ``batch_size`` within each decoder (module docstring). ``masks`` (N, W, L,
    words) from :func:`step_masks` (rows may repeat in a resample); ``origin`` (N,) the
    request each row copies (default: all distinct): copies go to different batches."""
    N = masks.shape[0]
    origin = np.arange(N) if origin is None else np.asarray(origin)
    total = cells = used = batches = 0
    key = rng.random(int(origin.max()) + 1)
    for d in range(num_decoders):
        rows = np.flatnonzero(labels == d)
        nb = rows.size // batch_size
        if nb == 0:
            continue
        # copies adjacent (same random key), dealt round the nb batches: a copy lands in
        # another batch than its original as long as it has at most nb copies
        rows = rows[np.lexsort((rows, key[origin[rows]]))]
        copy = _copy_index(origin[rows])
        while nb and (copy < nb).sum() < nb * batch_size:  # copies left out: fewer batches
            nb = int((copy < nb).sum()) // batch_size
        if nb == 0:
            continue
        rows = rows[copy < nb][:nb * batch_size]
        grouped = masks[rows].reshape(batch_size, nb, *masks.shape[1:])  # p → batch p % nb
        union = np.bitwise_or.reduce(grouped, axis=0)  # (nb, W, L, words)
        total += _popcount_sum(union)
        cells += nb * masks.shape[1] * masks.shape[2]
        used += nb * batch_size
        batches += nb
    return (total / cells if cells else float("nan")), used, batches


def _copy_index(origin_sorted: np.ndarray) -> np.ndarray:
    """(n,) 0 for the first row of each run of equal values, 1 for the second, ..."""
    n = origin_sorted.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    start = np.concatenate(([True], origin_sorted[1:] != origin_sorted[:-1]))
    run_start = np.maximum.accumulate(np.where(start, np.arange(n), 0))
    return np.arange(n) - run_start


# -- estimates with intervals ------------------------------------------------------------------
@dataclass(frozen=True)
class CutEstimate:
    """The distinct-expert cut of one input at one batch size."""

    batch_size: int
    cut: float  # 1 − routed / round robin (point estimate, the routed requests as drawn)
    low: float  # 95 % bootstrap interval of the cut
    high: float
    distinct: float  # routed: mean distinct experts per layer per step
    round_robin: float  # the same under round robin
    requests: int  # routed requests the batches rest on (K decoders × batches × B)
    batches: int

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v)
                for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class InputLocality:
    """ρ and the cut per batch size of one routing input."""

    name: str  # key of INPUTS
    label: str  # what it is, as printed
    rho: float  # Spearman ρ against the routed requests' decode patterns
    rho_low: float
    rho_high: float
    cuts: tuple[CutEstimate, ...]
    note: str = ""  # what the reader must know (a stand-in, a split, a fit ...)

    def as_dict(self) -> dict:
        return {"name": self.name, "label": self.label, "rho": round(self.rho, 6),
                "rho_interval": [round(self.rho_low, 6), round(self.rho_high, 6)],
                "cuts": [c.as_dict() for c in self.cuts], "note": self.note}


@dataclass(frozen=True)
class LocalityReport:
    """What :func:`real_locality` measured on one trace."""

    model: str
    num_decoders: int  # K
    window: Window
    tau: float
    num_fit: int  # requests fitted on
    num_routed: int  # requests routed and measured
    num_eligible: int  # requests with at least window.stop decode steps
    resamples: int
    seed: int
    inputs: tuple[InputLocality, ...]
    skipped: dict = field(default_factory=dict)  # input -> why it was not measured
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"model": self.model, "decoders": self.num_decoders,
                "window": [self.window.start, self.window.stop], "tau": self.tau,
                "requests": {"fit": self.num_fit, "routed": self.num_routed,
                             "eligible": self.num_eligible},
                "resamples": self.resamples, "seed": self.seed,
                "inputs": [i.as_dict() for i in self.inputs], "skipped": dict(self.skipped),
                "notes": list(self.notes)}


def _cos_dist(x: np.ndarray) -> np.ndarray:
    u = unit_rows(x)
    return 1.0 - u @ u.T


def _spearman_pairs(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = _rankdata(a), _rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    # einsum, not BLAS: a threaded dot stalls on a busy machine (eldr.fit.signature)
    den = math.sqrt(float(np.einsum("i,i->", ra, ra)) * float(np.einsum("i,i->", rb, rb)))
    return float(np.einsum("i,i->", ra, rb) / den) if den > 0 else float("nan")


def _percentile(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size < 2:
        return float("nan"), float("nan")
    lo, hi = np.percentile(v, [2.5, 97.5])
    return float(lo), float(hi)


def bootstrap_locality(masks: np.ndarray, decode_patterns: np.ndarray,
                       inputs: dict[str, tuple[np.ndarray, np.ndarray]], *,
                       num_decoders: int, batch_sizes: Sequence[int], tau: float = 0.1,
                       resamples: int = 500, draws: int = 10, seed: int = 0,
                       rho_targets: dict[str, np.ndarray] | None = None
                       ) -> dict[str, tuple[tuple[float, float, float], list[CutEstimate]]]:
    """ρ (point, low, high) and cuts with intervals of each input, on N routed requests.

    ``masks`` (N, W, L, words) their step bitsets (:func:`step_masks`); ``decode_patterns``
    (N, L·E) what ρ ranks against (``rho_targets`` overrides it per input);
    ``inputs[name] = (signatures (N, d), centroids (K, d))``. The point estimate averages
    ``draws`` random arrival orders and batchings (round robin: ``draws`` deals); each of
    ``resamples`` bootstrap resamples of the requests draws one of each, the same resample
    for every input."""
    N = masks.shape[0]
    K = num_decoders
    rng = np.random.default_rng(seed)
    resample = [rng.integers(0, N, N) for _ in range(resamples)]
    orders = [rng.permutation(N) for _ in range(draws)]
    rr_point = {}
    for B in batch_sizes:
        vals = [batch_distinct(masks, round_robin_assign(N, K, np.random.default_rng(
            [seed, 1, B, i])), K, B, np.random.default_rng([seed, 2, B, i])) for i in
            range(draws)]
        rr_point[B] = (float(np.mean([v[0] for v in vals])), vals[0][1], vals[0][2])
    rr_boot = {B: [batch_distinct(masks[idx], round_robin_assign(N, K, np.random.default_rng(
        [seed, 3, b])), K, B, np.random.default_rng([seed, 4, B, b]), origin=idx)[0]
        for b, idx in enumerate(resample)] for B in batch_sizes}
    iu = np.triu_indices(N, k=1)
    out = {}
    for name, (sig, cen) in inputs.items():
        target = decode_patterns if rho_targets is None or name not in rho_targets \
            else rho_targets[name]
        ds, dp = _cos_dist(sig), _cos_dist(target)
        point_rho = float(rho(sig, target))
        boot_rho = []
        for idx in resample:
            i, j = idx[iu[0]], idx[iu[1]]
            keep = i != j
            boot_rho.append(_spearman_pairs(ds[i[keep], j[keep]], dp[i[keep], j[keep]]))
        rlo, rhi = _percentile(boot_rho)
        labels = [band_assign(sig, cen, tau=tau, order=o) for o in orders]
        boot_labels = [band_assign(sig[idx], cen, tau=tau, order=np.random.default_rng(
            [seed, 6, b]).permutation(N)) for b, idx in enumerate(resample)]
        cuts = []
        for B in batch_sizes:
            vals = [batch_distinct(masks, lab, K, B, np.random.default_rng([seed, 5, B, i]))
                    for i, lab in enumerate(labels)]
            routed = float(np.mean([v[0] for v in vals]))
            boot = [1.0 - batch_distinct(masks[idx], lab, K, B, np.random.default_rng(
                [seed, 7, B, b]), origin=idx)[0] / rr_boot[B][b]
                for b, (idx, lab) in enumerate(zip(resample, boot_labels, strict=True))]
            lo, hi = _percentile(boot)
            rr = rr_point[B][0]
            cuts.append(CutEstimate(B, 1.0 - routed / rr, lo, hi, routed, rr, vals[0][1],
                                    vals[0][2]))
        out[name] = ((point_rho, rlo, rhi), cuts)
    return out


# -- the inputs on a trace ---------------------------------------------------------------------
def _counts_view(trace: Trace, counts: np.ndarray, tokens: np.ndarray) -> Trace:
    """A trace whose "prefill" counts are ``counts`` (R, L, E) over ``tokens`` (R,) tokens:
    how the encoder is fitted on decode counts (the oracle, the stand-in)."""
    return Trace(meta=replace(trace.meta, version=2), prefill_counts=counts,
                 decode_counts=trace.decode_counts, prompt_lens=tokens,
                 output_lens=trace.output_lens)


def _standin_counts(trace: Trace, tokens: int) -> np.ndarray:
    """(R, L, E) int32 counts of each request's first ``tokens`` decode steps."""
    off = trace.decode_offsets
    R, L, E = trace.decode_counts.shape
    out = np.zeros((R, L, E), dtype=np.int64)
    for r in range(R):
        ids = trace.decode_topk[off[r]:off[r] + tokens].astype(np.int64)  # (m, L, k)
        flat = (np.arange(L)[None, :, None] * E + ids).ravel()
        out[r] = np.bincount(flat, minlength=L * E).reshape(L, E)
    return out.astype(np.int32)


def _later_counts(trace: Trace, start: int) -> np.ndarray:
    """(R, L, E) counts of each request's decode steps from ``start`` on."""
    return (trace.decode_counts.astype(np.int64) - _standin_counts(trace, start)).astype(
        np.int32)


def _encoded(fit_view: Trace, route_view: Trace, K: int, seed: int
             ) -> tuple[np.ndarray, np.ndarray, SignatureEncoder]:
    """(routed signatures, K balanced centroids of the fitted ones, the encoder)."""
    enc = SignatureEncoder(random_state=seed).fit(fit_view)
    km = BalancedKMeans(K, n_init=4, random_state=seed).fit(enc.transform(fit_view))
    return enc.transform(route_view), km.cluster_centers_, enc


def default_window(trace: Trace, standin_tokens: int = 16) -> Window:
    """Decode steps measured by default: 0–23 for a trace with prefill routing; for a
    decode-only one 16–63, after the stand-in signature's first ``standin_tokens``."""
    if trace.has_prefill:
        return Window(0, 24)
    return Window(standin_tokens, standin_tokens + 48)


def default_decoders(num_routed: int) -> int:
    """The most decoders (8, 4 or 2) that still hold 16 routed requests each (two lockstep
    batches of 8), or 2."""
    for K in (8, 4, 2):
        if num_routed >= 16 * K:
            return K
    return 2


def _split(eligible: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit, routed) halves of the eligible requests, seeded."""
    perm = np.random.default_rng([seed, 0]).permutation(eligible)
    n_fit = perm.size // 2
    return np.sort(perm[:n_fit]), np.sort(perm[n_fit:])


def _domain_rows(trace: Trace) -> np.ndarray:
    onehot = np.zeros((trace.num_requests, len(trace.domain_names)))
    onehot[np.arange(trace.num_requests), trace.domains] = 1.0
    return onehot


def real_locality(trace: Trace, *, num_decoders: int | None = None,
                  batch_sizes: Sequence[int] | None = None, window: Window | None = None,
                  tau: float = 0.1, standin_tokens: int = 16, resamples: int = 500,
                  draws: int = 10, seed: int = 0, inputs: Sequence[str] | None = None,
                  prompt_options: dict | None = None) -> LocalityReport:
    """ρ and the distinct-expert cut against round robin, with intervals, of every routing
    input the trace supports (module docstring; :data:`INPUTS`):

    - ``prefill``: the prefill signature (needs prefill routing);
    - ``oracle``: each request's own whole-decode profile (no router has it: the bound);
    - ``standin``: the first ``standin_tokens`` decode steps' experts, a stand-in signature
      for a decode-only trace (only where the window starts after them);
    - ``domain``: the trace's domain labels, one-hot;
    - ``prompt``: the prompt predictor (prompt token ids → decode profile, fitted on the fit
      half; :mod:`eldr.fit.prompt_decode`), routed against the oracle's centroids.
    """
    window = default_window(trace, standin_tokens) if window is None else window
    eligible = np.flatnonzero(trace.decode_lens >= window.stop)
    fit_idx, route_idx = _split(eligible, seed)
    if route_idx.size < 4 or fit_idx.size < 4:
        raise ValueError(f"too few requests with at least {window.stop} decode steps "
                         f"({eligible.size}) to fit on half and route the other half")
    K = default_decoders(route_idx.size) if num_decoders is None else int(num_decoders)
    if K < 2 or route_idx.size < 2 * K:
        raise ValueError(f"{route_idx.size} routed requests cannot fill {K} decoders with "
                         "batches of 2")
    if batch_sizes is None:  # at least two batches per decoder
        batch_sizes = [b for b in (2, 4, 8, 16, 32, 64) if 2 * b * K <= route_idx.size]
    batch_sizes = [int(b) for b in batch_sizes if int(b) * K <= route_idx.size]
    if not batch_sizes:
        raise ValueError(f"no batch size fits {route_idx.size} routed requests on {K} "
                         "decoders")
    fit, routed = trace.subset(fit_idx), trace.subset(route_idx)
    wanted = list(INPUTS) if inputs is None else list(inputs)
    built, skipped, notes, rho_targets = _build_inputs(
        trace, fit, routed, wanted, K=K, window=window, standin_tokens=standin_tokens,
        seed=seed, prompt_options=prompt_options)
    masks = step_masks(routed, window)
    patterns = routed.decode_counts.reshape(routed.num_requests, -1)
    res = bootstrap_locality(masks, patterns, built, num_decoders=K, batch_sizes=batch_sizes,
                             tau=tau, resamples=resamples, draws=draws, seed=seed,
                             rho_targets=rho_targets)
    items = tuple(InputLocality(name, INPUTS[name], *res[name][0], tuple(res[name][1]),
                                notes.get(name, "")) for name in built)
    return LocalityReport(model=trace.meta.model, num_decoders=K, window=window, tau=tau,
                          num_fit=int(fit_idx.size), num_routed=int(route_idx.size),
                          num_eligible=int(eligible.size), resamples=resamples, seed=seed,
                          inputs=items, skipped=skipped)


def _r2(pred: np.ndarray, truth: np.ndarray, mean: np.ndarray) -> float:
    """R² of predicted profiles against the truth, the baseline the fit part's mean."""
    sst = float(((truth - mean) ** 2).sum())
    return 1.0 - float(((pred - truth) ** 2).sum()) / sst if sst > 0 else float("nan")


def _build_inputs(trace: Trace, fit: Trace, routed: Trace, wanted: list[str], *, K: int,
                  window: Window, standin_tokens: int, seed: int,
                  prompt_options: dict | None) -> tuple[dict, dict, dict, dict]:
    """(inputs {name: (routed signatures, centroids)}, skipped {name: why}, notes {name:
    text}, ρ targets {name: (R, L·E)}) of :func:`real_locality`."""
    built, skipped, notes, rho_targets = {}, {}, {}, {}
    oracle = _encoded(_counts_view(fit, fit.decode_counts, fit.decode_lens),
                      _counts_view(routed, routed.decode_counts, routed.decode_lens), K, seed)
    for name in wanted:
        if name not in INPUTS:
            raise ValueError(f"unknown routing input {name!r}; choose from {', '.join(INPUTS)}")
        if name == "prefill":
            if not trace.has_prefill:
                skipped[name] = "decode-only trace: no prefill routing recorded"
                continue
            sig, cen, _ = _encoded(fit, routed, K, seed)
            built[name] = (sig, cen)
            if trace.meta.provenance.get("split") is not None:
                notes[name] = (f"prompt = the first {trace.meta.provenance['split']:g} of "
                               "each sequence (the import's split)")
        elif name == "oracle":
            built[name] = oracle[:2]
            notes[name] = "each request's own whole decode: a bound no router reaches"
        elif name == "standin":
            if window.start < standin_tokens:
                skipped[name] = (f"the window starts at step {window.start}, before the "
                                 f"{standin_tokens} stand-in tokens end")
                continue
            sig, cen, _ = _encoded(
                _counts_view(fit, _standin_counts(fit, standin_tokens),
                             np.full(fit.num_requests, standin_tokens)),
                _counts_view(routed, _standin_counts(routed, standin_tokens),
                             np.full(routed.num_requests, standin_tokens)), K, seed)
            built[name] = (sig, cen)
            later = _later_counts(routed, standin_tokens)
            rho_targets[name] = later.reshape(later.shape[0], -1)
            notes[name] = (f"the first {standin_tokens} decode steps' experts stand in for "
                           "a prefill signature (known only after they ran); rho against "
                           "the later steps")
        elif name == "domain":
            if trace.domains is None:
                skipped[name] = "the trace has no domain labels"
                continue
            km = BalancedKMeans(K, n_init=4, random_state=seed).fit(_domain_rows(fit))
            built[name] = (_domain_rows(routed), km.cluster_centers_)
            notes[name] = f"one-hot of {len(trace.domain_names)} labels"
        elif name == "prompt":
            if trace.prompt_token_ids is None:
                skipped[name] = "the trace has no prompt token ids"
                continue
            pred = fit_decode_predictor(fit, random_state=seed, **(prompt_options or {}))
            profiles = pred.predict_trace(routed)
            truth = decode_profiles(routed)
            r2 = _r2(profiles, truth, decode_profiles(fit).mean(axis=0))
            built[name] = (oracle[2].transform(profiles), oracle[1])
            notes[name] = (f"prompt ids -> decode profile ({pred.weighting_}, rank "
                           f"{pred.rank_}), held-out R^2 {r2:.3f}, cross-validated on the fit "
                           f"half {pred.cv_r2_:.3f}; routed against the oracle's centroids")
    return built, skipped, notes, rho_targets
