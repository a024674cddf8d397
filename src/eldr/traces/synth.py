"""Calibrated synthetic expert-routing traces for the paper's models and workloads.

No real routing traces of the paper's models can be captured here, so this module
generates them from a small latent model of MoE routing (docs/synth.md):

* per layer, a global expert popularity: Gaussian logits whose spread grows linearly with
  depth (deeper layers are more skewed), plus a few "generalist" experts with a boost;
* per domain, a preference for a random subset of experts, and per domain "subdomains"
  (topics) with their own, smaller subsets. For a sharp workload (``task``) topics belong
  to a domain; for a soft one (``language``) topics are shared by all languages;
* per request, Gaussian variation around its domain and topic;
* per token, k distinct experts by Gumbel-top-k on the request's logits
  (:mod:`eldr.traces.sampling`), prefill from the request's logits, decode from a drifted
  copy (part of the request term is redrawn, and the global logits shift a little), so
  prefill and decode expert counts correlate below 1;
* shared system prompts: with probability ``workload.shared_prefix_prob`` a request starts
  with one of its domain's few system prompts (whole KV blocks). The prefix is routed once
  from its domain's logits, so requests sharing it share its token ids, its per-token top-k
  and its counts, as a real model's prefix cache would see them.

Calibration. The parameters in ``CALIBRATION`` were fitted, by hand with the search
script ``scripts/calibrate_synth.py``, to the paper's published premises ONLY: the
prefill↔decode Pearson of each model, the same-domain distinct-expert reduction of each
workload, ρ(count·idf) > ρ(gate_prob) and the effective number of experts per layer. They
were never tuned to any routing outcome (TPOT, TTFT or an ELDR-vs-baseline gap): doing so
would make the evaluation circular. :func:`eldr.fit.premises.calibration_report` measures the
premises on a generated trace.

Everything is seeded: the same (model, workload, number of requests, seed, keep_topk)
gives bit-identical arrays. Randomness comes from independent streams spawned from the seed
(structure, requests, one per layer), so the result does not depend on chunking.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from eldr._progress import Progress
from eldr.traces.models import ModelPreset, get_preset
from eldr.traces.recorder import TokenRecorder
from eldr.traces.sampling import aggregate_counts, approx_gate_sums, inclusion_probs
from eldr.traces.trace import Trace, TraceMeta
from eldr.traces.workloads import Workload, get_workload

__all__ = [
    "CALIBRATION",
    "DEFAULT_TRACE",
    "SynthParams",
    "default_trace",
    "generate",
    "get_params",
    "with_params",
]

GENERATOR = "eldr-synth-v1"


@dataclass(frozen=True)
class SynthParams:
    """Latent routing structure of one model on one kind of workload (logit units)."""

    domain_strength: float  # α_d: logit boost of a domain's preferred experts
    decode_drift: float  # ω in [0, 1]: share of the request term redrawn for decode
    subdomain_strength: float = 1.0  # α_s: logit boost of a topic's preferred experts
    request_strength: float = 2.5  # β: std of a request's own logit variation
    skew_first: float = 0.45  # std of global popularity logits at the first layer
    skew_last: float = 0.85  # ... at the last layer (linear in depth in between)
    num_generalists: int = 2  # experts per layer that most tokens like
    generalist_boost: float = 1.0  # their extra logit
    domain_fraction: float = 0.2  # share of experts in a domain's preferred subset
    num_subdomains: int = 4  # topics per domain (sharp) or in total x domains (soft)
    subdomain_fraction: float = 0.08  # share of experts in a topic's preferred subset
    decode_shift: float = 0.2  # std of a global, per-layer prefill→decode logit shift
    stickiness: float = 0.0  # P(a decode token repeats the previous token's selection)
    gate_scale: float = 0.35  # router logits = gate_scale x (z + Gumbel): softmax sharpness

    def __post_init__(self) -> None:
        for name in ("domain_strength", "subdomain_strength", "request_strength",
                     "skew_first", "skew_last", "generalist_boost", "decode_shift",
                     "gate_scale"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"SynthParams: {name} must be finite and >= 0, got {value!r}")
        for name in ("decode_drift", "domain_fraction", "subdomain_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"SynthParams: {name} must be in [0, 1], got {value!r}")
        if not 0.0 <= self.stickiness < 1.0:
            raise ValueError(f"SynthParams: stickiness must be in [0, 1), got {self.stickiness!r}")
        if self.num_generalists < 0 or self.num_subdomains < 1:
            raise ValueError("SynthParams: num_generalists must be >= 0 and num_subdomains >= 1")


# Fitted to the premises only (module docstring). Keys: (model preset, workload sharpness).
CALIBRATION: dict[tuple[str, str], SynthParams] = {
    # domain_strength sets the same-domain reduction (task 17-21%, language 3-10%);
    # decode_drift sets the prefill-decode Pearson of each model. Language prompts are
    # shorter (noisier counts), so the same Pearson needs less drift there.
    ("qwen3-30b-a3b", "sharp"): SynthParams(domain_strength=3.3, decode_drift=0.35),
    ("qwen3-30b-a3b", "soft"): SynthParams(domain_strength=2.0, decode_drift=0.25),
    ("gpt-oss-120b", "sharp"): SynthParams(domain_strength=3.1, decode_drift=0.66),
    ("gpt-oss-120b", "soft"): SynthParams(domain_strength=2.0, decode_drift=0.55),
    ("gemma-4-26b-a4b", "sharp"): SynthParams(domain_strength=3.3, decode_drift=0.28),
    ("gemma-4-26b-a4b", "soft"): SynthParams(domain_strength=2.0, decode_drift=0.20),
    # No published Pearson for Qwen3-235B: the 0.90 target is assumed (Qwen3-30B's).
    ("qwen3-235b-a22b", "sharp"): SynthParams(domain_strength=3.3, decode_drift=0.35),
    ("qwen3-235b-a22b", "soft"): SynthParams(domain_strength=2.0, decode_drift=0.25),
}

# The embedded default trace that ``eldr reproduce`` uses with no arguments.
DEFAULT_TRACE = {"model": "qwen3-30b-a3b", "workload": "task", "num_requests": 2000,
                 "seed": 20260402, "keep_topk": False}


def get_params(model: str | ModelPreset, workload: str | Workload) -> SynthParams:
    """The calibrated parameters of ``model`` on ``workload`` (by its sharpness)."""
    preset, wl = get_preset(model), get_workload(workload)
    key = (preset.name, wl.domain_sharpness)
    if key not in CALIBRATION:
        raise ValueError(f"no synthetic calibration for model {preset.name!r} on a "
                         f"{wl.domain_sharpness} workload; pass params= explicitly")
    return CALIBRATION[key]


def default_trace(*, progress: bool = False) -> Trace:
    """The fixed default trace (``DEFAULT_TRACE``): same arrays on every machine."""
    return generate(DEFAULT_TRACE["model"], DEFAULT_TRACE["workload"],
                    num_requests=DEFAULT_TRACE["num_requests"], seed=DEFAULT_TRACE["seed"],
                    keep_topk=DEFAULT_TRACE["keep_topk"], progress=progress)


# -- latent structure -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Structure:
    """Per-layer logit components shared by all requests. Arrays are (L, ·, E) float64."""

    glob: np.ndarray  # (L, E) global popularity logits
    shift: np.ndarray  # (L, E) global prefill→decode shift (added to decode logits)
    domain: np.ndarray  # (L, D, E) domain preference logits
    topic: np.ndarray  # (L, D, S, E) topic preference logits of each domain's topics


def _subset_logits(rng: np.random.Generator, shape: tuple, E: int, fraction: float,
                   strength: float) -> np.ndarray:
    """strength x (1 + 0.3 N(0,1)) on a random ``fraction`` of experts, 0 elsewhere."""
    m = max(1, round(fraction * E))
    keys = rng.random((*shape, E))
    chosen = np.argsort(keys, axis=-1)[..., :m]
    out = np.zeros((*shape, E))
    vals = strength * (1.0 + 0.3 * rng.standard_normal((*shape, m)))
    np.put_along_axis(out, chosen, vals, axis=-1)
    return out


def _structure(rng: np.random.Generator, preset: ModelPreset, wl: Workload,
               p: SynthParams) -> _Structure:
    L, E, D, S = preset.num_layers, preset.num_experts, wl.num_domains, p.num_subdomains
    depth = np.linspace(0.0, 1.0, L)[:, None] if L > 1 else np.zeros((1, 1))
    skew = p.skew_first + (p.skew_last - p.skew_first) * depth
    glob = skew * rng.standard_normal((L, E))
    if p.num_generalists:
        gen = np.argsort(rng.random((L, E)), axis=1)[:, : p.num_generalists]
        np.put_along_axis(glob, gen, np.take_along_axis(glob, gen, axis=1)
                          + p.generalist_boost, axis=1)
    shift = p.decode_shift * rng.standard_normal((L, E))
    domain = _subset_logits(rng, (L, D), E, p.domain_fraction, p.domain_strength)
    if wl.domain_sharpness == "sharp":  # topics belong to their domain
        topic = _subset_logits(rng, (L, D, S), E, p.subdomain_fraction, p.subdomain_strength)
    else:  # topics cut across languages: the same S x D topics for every language
        shared = _subset_logits(rng, (L, D * S), E, p.subdomain_fraction, p.subdomain_strength)
        topic = np.broadcast_to(shared[:, None, :, :], (L, D, D * S, E))
    return _Structure(glob, shift, domain, topic)


# -- requests -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Requests:
    """Per-request draws (R requests) and the shared prefixes (Q = D x per-domain)."""

    domains: np.ndarray  # (R,) int32
    topics: np.ndarray  # (R,) int64 topic index into _Structure.topic[:, domain]
    user_lens: np.ndarray  # (R,) int64 prompt tokens after the shared prefix
    output_lens: np.ndarray  # (R,) int64
    prefix: np.ndarray  # (R,) int64 shared prefix id, or -1 for none (internal only)
    prefix_lens: np.ndarray  # (Q,) int64 tokens of each shared prefix
    prefix_domain: np.ndarray  # (Q,) int64 domain of each shared prefix


def _draw_requests(rng: np.random.Generator, wl: Workload, R: int, num_topics: int,
                   block_size: int,
                   lengths: tuple[np.ndarray, np.ndarray] | None = None) -> _Requests:
    """Per-request draws. With explicit ``lengths`` (prompt, output), everything is drawn
    as usual (same streams) and then the lengths replace the drawn ones; no request gets a
    shared system prompt, since the given prompt length is the whole prompt."""
    D, per = wl.num_domains, wl.shared_prefixes_per_domain
    domains = wl.sample_domains(rng, R)
    topics = rng.integers(0, num_topics, size=R)
    user_lens = wl.prompt_len.sample(rng, R)
    output_lens = wl.output_len.sample(rng, R)
    lo, hi = wl.shared_prefix_blocks
    prefix_lens = rng.integers(lo, hi + 1, size=D * per) * block_size
    prefix_domain = np.repeat(np.arange(D), per)
    has = rng.random(R) < wl.shared_prefix_prob
    prefix = np.where(has, domains * per + rng.integers(0, per, size=R), -1)
    if lengths is not None:
        user_lens, output_lens = lengths
        prefix = np.full(R, -1, np.int64)
    return _Requests(domains, topics, user_lens, output_lens, prefix, prefix_lens,
                     prefix_domain)


# -- generation -------------------------------------------------------------------------------
def generate(
    model: str | ModelPreset,
    workload: str | Workload,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    keep_topk: bool = True,
    params: SynthParams | None = None,
    block_size: int = 16,
    lengths: tuple[np.ndarray, np.ndarray] | None = None,
    progress: bool = False,
    gate_sums: bool = True,
) -> Trace:
    """Generate a synthetic routing trace.

    model: preset name or :class:`~eldr.traces.models.ModelPreset`; workload: name or
    :class:`~eldr.traces.workloads.Workload`; num_requests: default ``workload.num_requests``;
    keep_topk: route every token explicitly and keep ``prefill_topk``/``decode_topk``
    (memory ≈ (prompt + output tokens) x L x k x 2 bytes, time per token and layer);
    ``False`` draws the per-request counts and gate sums directly (count path of
    :mod:`eldr.traces.sampling`), faster: docs/synth.md. params: override the calibrated
    :data:`CALIBRATION` entry. lengths: explicit ``(prompt_lens, output_lens)``, two (R,)
    integer arrays (prompt >= 0, output >= 1), used instead of the workload's length
    distributions, e.g. to pair a real request trace's lengths with synthetic routing
    (:mod:`eldr.traces.arrivals`); R is then their length (``num_requests`` must be ``None``
    or equal) and no request gets a shared system prompt. The calibration was fitted on the
    workload's own lengths; other lengths change the premises that depend on them (longer
    prompts give less noisy counts, hence a higher prefill↔decode Pearson). gate_sums:
    ``False`` leaves the summed gate outputs out (``prefill_gate_prob`` and
    ``prefill_gate_logit`` None: 2 x R x L x E float32 not made, and on the count path not
    computed either) with every other array bit-identical, for callers that never read them
    (the count-based encoder, the simulator). Returns a validated
    :class:`~eldr.traces.trace.Trace` with counts, lengths, domains, gate sums, prompt token
    ids (system prompts shared) and, when ``keep_topk``, per-token top-k.
    """
    preset, wl = get_preset(model), get_workload(workload)
    p = get_params(preset, wl) if params is None else params
    R, lengths = _check_arguments(wl, p, num_requests, seed, keep_topk, lengths)
    L, k = preset.num_layers, preset.top_k
    ss = np.random.SeedSequence([int(seed), 0x5E1D])
    s_struct, s_req, s_ids, *s_layers = ss.spawn(3 + L)
    st = _structure(np.random.default_rng(s_struct), preset, wl, p)
    num_topics = st.topic.shape[2]
    rq = _draw_requests(np.random.default_rng(s_req), wl, R, num_topics, block_size, lengths)
    # Segments routed with one logit vector each: Q shared prefixes, then R user prompts.
    seg_lens = np.concatenate([rq.prefix_lens, rq.user_lens])
    recorder = TokenRecorder(seg_lens, rq.output_lens - 1, L, k) if keep_topk else None
    with Progress(L, f"synth {preset.name}/{wl.name}", enabled=None if progress else False) as bar:
        routed = _route_layers(st, rq, p, preset, s_layers, recorder, bar, gate_sums)
    token_ids = _token_ids(np.random.default_rng(s_ids), rq, preset.vocab_size)
    meta = TraceMeta(model=preset.name, num_layers=L, num_experts=preset.num_experts, top_k=k,
                     block_size=block_size,
                     source=f"synthetic:{GENERATOR}:{wl.name}:seed={int(seed)}")
    Q = rq.prefix_lens.shape[0]
    return Trace(
        meta=meta,
        prefill_counts=routed.prefill_counts,
        decode_counts=routed.decode_counts,
        prompt_lens=rq.user_lens + np.where(rq.prefix >= 0,
                                            rq.prefix_lens[rq.prefix.clip(0)], 0),
        output_lens=rq.output_lens,
        domains=rq.domains,
        domain_names=wl.domain_names,
        prefill_gate_prob=routed.gate_prob,
        prefill_gate_logit=routed.gate_logit,
        prefill_topk=None if recorder is None else recorder.prefill_topk(rq.prefix, Q),
        decode_topk=None if recorder is None else recorder.decode_topk,
        prompt_token_ids=token_ids,
    )


def _check_arguments(wl: Workload, p: SynthParams, num_requests: int | None, seed: int,
                     keep_topk: bool, lengths: tuple[np.ndarray, np.ndarray] | None
                     ) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
    """The number of requests R and the validated explicit lengths (or ``None``)."""
    R = wl.num_requests if num_requests is None else int(num_requests)
    if lengths is not None:
        lengths = _check_lengths(lengths, num_requests)
        R = lengths[0].shape[0]
    if R <= 0:
        raise ValueError(f"generate: num_requests must be positive, got {num_requests!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"generate: seed must be a non-negative integer, got {seed!r}")
    if p.stickiness > 0 and not keep_topk:
        raise ValueError("generate: stickiness > 0 needs keep_topk=True (the count path "
                         "treats decode tokens as independent)")
    return R, lengths


# -- routing ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Routed:
    """Per-request routing aggregates of a generated trace."""

    prefill_counts: np.ndarray  # (R, L, E) int32, shared prefix included
    decode_counts: np.ndarray  # (R, L, E) int32
    gate_prob: np.ndarray | None  # (R, L, E) float32 Σ over prompt tokens (None: not asked)
    gate_logit: np.ndarray | None  # (R, L, E) float32 Σ over prompt tokens (None: not asked)


def _route_layers(st: _Structure, rq: _Requests, p: SynthParams, preset: ModelPreset,
                  s_layers: list[np.random.SeedSequence], recorder: TokenRecorder | None,
                  bar: Progress, gate_sums: bool = True) -> _Routed:
    """Route every layer from its own stream ``s_layers[layer]``: token by token into
    ``recorder`` when given (keep_topk), else by the count path of
    :mod:`eldr.traces.sampling`. Without ``gate_sums`` the gate sums are neither kept nor,
    on the count path, computed (their draws are still taken, so the counts are the
    same)."""
    L, E, k = preset.num_layers, preset.num_experts, preset.top_k
    R, Q = rq.user_lens.shape[0], rq.prefix_lens.shape[0]
    seg_lens = np.concatenate([rq.prefix_lens, rq.user_lens])
    dec_lens = rq.output_lens - 1
    gates = (np.zeros((R, L, E), np.float32), np.zeros((R, L, E), np.float32)) \
        if gate_sums else (None, None)
    out = _Routed(np.zeros((R, L, E), np.int32), np.zeros((R, L, E), np.int32), *gates)
    # A request's prefill = its shared prefix (if any) + its own prompt.
    has = rq.prefix >= 0
    pre_idx = np.where(has, rq.prefix, 0)
    for layer in range(L):
        rng = np.random.default_rng(s_layers[layer])
        u = p.request_strength * rng.standard_normal((R, E))
        v = p.request_strength * rng.standard_normal((R, E))
        base = st.glob[layer] + st.domain[layer, rq.domains] \
            + st.topic[layer, rq.domains, rq.topics]
        z_user = base + u
        z_dec = base + st.shift[layer] + np.sqrt(1.0 - p.decode_drift**2) * u \
            + p.decode_drift * v
        z_pre = st.glob[layer] + st.domain[layer, rq.prefix_domain]
        z_seg = np.concatenate([z_pre, z_user])
        if recorder is not None:
            cnt, prob, logit = recorder.route_prefill(rng, layer, z_seg, E, p.gate_scale)
            dcnt = recorder.route_decode(rng, layer, z_dec, E, p.stickiness)
        else:
            pi = inclusion_probs(z_seg, k)
            cnt = aggregate_counts(rng, pi, seg_lens, k)
            prob, logit = approx_gate_sums(rng, z_seg, seg_lens, gate_scale=p.gate_scale,
                                           values=gate_sums)
            dcnt = aggregate_counts(rng, inclusion_probs(z_dec, k), dec_lens, k)
        out.prefill_counts[:, layer] = cnt[Q:] + cnt[pre_idx] * has[:, None]
        if gate_sums:
            out.gate_prob[:, layer] = prob[Q:] + prob[pre_idx] * has[:, None]
            out.gate_logit[:, layer] = logit[Q:] + logit[pre_idx] * has[:, None]
        out.decode_counts[:, layer] = dcnt
        bar.update(1)
    return out


def _check_lengths(lengths: tuple[np.ndarray, np.ndarray],
                   num_requests: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Validated explicit (prompt_lens, output_lens): (R,) int64 each."""
    if not isinstance(lengths, (tuple, list)) or len(lengths) != 2:
        raise ValueError("generate: lengths must be a pair (prompt_lens, output_lens)")
    out = []
    for name, arr, low in (("prompt_lens", lengths[0], 0), ("output_lens", lengths[1], 1)):
        a = np.asarray(arr)
        if a.ndim != 1 or a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"generate: lengths {name} must be a 1-D integer array, got "
                             f"dtype {a.dtype} shape {a.shape}")
        if a.size and int(a.min()) < low:
            raise ValueError(f"generate: lengths {name} must be >= {low}, got {int(a.min())}")
        out.append(a.astype(np.int64))
    if out[0].shape != out[1].shape:
        raise ValueError(f"generate: lengths prompt_lens {out[0].shape} and output_lens "
                         f"{out[1].shape} differ in shape")
    if num_requests is not None and int(num_requests) != out[0].shape[0]:
        raise ValueError(f"generate: num_requests={num_requests!r} but lengths give "
                         f"{out[0].shape[0]} requests")
    return out[0], out[1]


def _token_ids(rng: np.random.Generator, rq: _Requests, vocab: int) -> np.ndarray:
    """(P,) int32 prompt token ids: shared prefix ids (fixed per prefix) + random user ids.

    Ids are uniform over ``[256, vocab)`` (the first 256 are left to special tokens); the
    routing does not depend on them, only prefix caching and block hashing do.
    """
    prefixes = [rng.integers(256, vocab, size=n).astype(np.int32) for n in rq.prefix_lens]
    user = rng.integers(256, vocab, size=int(rq.user_lens.sum())).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(rq.user_lens)])
    parts = []
    for r in range(rq.user_lens.shape[0]):
        if rq.prefix[r] >= 0:
            parts.append(prefixes[rq.prefix[r]])
        parts.append(user[starts[r]:starts[r + 1]])
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def with_params(model: str | ModelPreset, workload: str | Workload, **changes) -> SynthParams:
    """The calibrated parameters with some fields replaced (for calibration searches)."""
    return replace(get_params(model, workload), **changes)
