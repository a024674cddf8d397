"""``eldr advise``: what ELDR would buy on a user's own routing, before switching
(docs/real-models.md, "eldr advise").

From one trace (an ``eldr import``, an ``eldr capture``, an ``eldr learn export``, or any
trace of the format) it measures, on the user's model preset and hardware:

- ρ of the routing input a router would have (the prefill signature, or the prompt's
  predicted decode profile on a decode-only trace with prompt token ids);
- the distinct-expert cut against round robin at several batch sizes, with bootstrap
  intervals (:func:`eldr.fit.locality.real_locality`; needs per-token decode experts);
- simulated median and p99 TPOT of ``eldr_cost`` and the band against JSQ, paired over
  seeds (:func:`eldr.reproduce.recorded.compare`), at the load the trace sustains or on
  the user's own arrival times;

and ends in one recommendation (:func:`recommend`): ``eldr_cost``, the band (``eldr``),
stay with load balancing, or "too small to tell".

What each kind of input gives (:func:`prepare`):

- **recorded** (imported or captured with per-token decode experts): everything above;
- **decode counts only** (a capture without ``--keep-topk``, a learn export): each decode
  token is dealt from the request's counts (exact inclusion probabilities, the recorded
  token-by-token order lost), and the lockstep cut, which needs recorded tokens, is
  skipped;
- **learn export** (``eldr learn export``): the requests whose decode counts the engines
  reported; its ``domains`` are the decoders ``eldr serve`` chose, not what the requests
  are about, so they are dropped, never used as labels;
- **synthetic** (``eldr synth``): drawn to the paper's premises, so the advice repeats the
  premises; said so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from eldr.reproduce.grid import TOLERANCE_PCT
from eldr.reproduce.real_models import shown_policies
from eldr.reproduce.recorded import (
    INPUT_LABELS,
    PROMPT_OPTIONS,
    Comparison,
    compare,
    locality,
    oracles,
    reference,
    routing_input,
)
from eldr.routing.registry import POLICIES
from eldr.traces.models import ModelPreset, get_preset
from eldr.traces.trace import Trace

__all__ = ["MAX_HALF_WIDTH", "MIN_BATCH", "MIN_HELDOUT", "Advice", "advice_json", "advise",
           "advised_policies", "format_advice", "plot_advice", "prepare", "recommend"]


def advised_policies() -> tuple[str, ...]:
    """The policies simulated: the reference balancer (JSQ, held against), the locality
    policies, the oracles on the true decode pattern (registry report roles)."""
    return (reference(), *locality(), *oracles())


def _recommended_first() -> tuple[str, ...]:
    """The locality policies, the one recommended when gains tie first (report role
    ``preference``: ``eldr_cost``, eldr serve's default, before the band)."""
    return tuple(p for p in shown_policies() if POLICIES[p].role == "locality")


MIN_HELDOUT = 32  # held-out requests below which nothing is told
MIN_BATCH = 2.0  # requests per decoder the data must sustain for locality to group any
MAX_HALF_WIDTH = 5.0  # percentage points: a wider interval of the winner is too noisy
TOL = TOLERANCE_PCT  # a gain must clear 1 % with 95 % confidence; a p99 loss beyond it bars


@dataclass
class Advice:
    """What :func:`advise` found (``format_advice`` prints it, ``as_dict`` for JSON)."""

    trace: str  # the trace's description
    kind: str  # recorded / counts / learned / synthetic
    notes: list[str]  # what was done with this kind of input
    model: str
    hardware: str
    decoders: int
    routing_input: str  # key of INPUT_LABELS
    recommendation: str  # "eldr_cost", "eldr", "load balancing" or "too small to tell"
    reason: str
    comparison: Comparison | None = None
    locality: object | None = None  # eldr.fit.locality.LocalityReport, or None
    locality_note: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"trace": self.trace, "kind": self.kind, "notes": self.notes,
                "model": self.model, "hardware": self.hardware, "decoders": self.decoders,
                "routing_input": INPUT_LABELS[self.routing_input],
                "recommendation": self.recommendation, "reason": self.reason,
                "simulation": None if self.comparison is None else self.comparison.as_dict(),
                "locality": None if self.locality is None else self.locality.as_dict(),
                "locality_note": self.locality_note, "seconds": self.seconds}


def prepare(trace: Trace) -> tuple[Trace, str, list[str]]:
    """(the trace to advise on, its kind, what is done with it): module docstring."""
    notes: list[str] = []
    src = trace.meta.source
    kind = "recorded"
    if src.startswith("learned:"):
        kind = "learned"
        keep = np.flatnonzero(trace.decode_lens > 0)
        notes.append(f"learn export: {keep.size} of {trace.num_requests} requests carry decode "
                     "counts (the engines reported them) and are used; the rest are left out")
        notes.append("its domains are the decoders eldr serve chose, not what the requests "
                     "are about: dropped, never used as labels")
        trace = replace(trace.subset(keep), domains=None, domain_names=None, _cache={})
    elif src.startswith("synthetic"):
        kind = "synthetic"
        notes.append("synthetic trace (eldr synth): drawn to the paper's premises, so this "
                     "advice repeats the premises; capture or import your own routing")
    if trace.decode_topk is None:
        if kind == "recorded":
            kind = "counts"
        notes.append("no per-token decode experts: each decode token is dealt from its "
                     "request's decode counts (exact per-expert probabilities, the recorded "
                     "token-to-token order lost); the lockstep cut needs recorded tokens and "
                     "is skipped")
    inp = routing_input(trace)
    notes.append({"prefill": "routing input: the prefill signature (the trace records "
                             "prefill routing)",
                  "prompt": "decode-only trace with prompt token ids: eldr and eldr_cost "
                            "route on the prompt's predicted decode profile (a prompt "
                            "predictor fitted on the calibration half)",
                  "none": "decode-only trace without prompt token ids: nothing is known of "
                          "a request before its decode, so eldr and eldr_cost have no input "
                          "and are not simulated"}[inp])
    return trace, kind, notes


def _decoders(num_heldout: int) -> int:
    """The default decode-pool size: 8, fewer when the held-out half is small (at least
    16 held-out requests per decoder), never below 2."""
    return int(max(2, min(8, num_heldout // 16)))


def recommend(cmp: Comparison | None, *, heldout: int) -> tuple[str, str]:
    """(recommendation, why) from a comparison against JSQ (module docstring): a locality
    policy is recommended when its median TPOT is below JSQ's by more than ``TOL`` % with
    95 % confidence and its p99 is not above by more than ``TOL`` % with 95 % confidence;
    the larger gain first, then the report roles' ``preference`` (``eldr_cost``, eldr
    serve's default, before the band)."""
    if cmp is None or heldout < MIN_HELDOUT:
        return "too small to tell", (f"{heldout} held-out requests (half the usable trace); "
                                     f"at least {MIN_HELDOUT} are needed: capture more")
    batch = cmp.mean(reference(), "mean_batch")
    if np.isfinite(batch) and batch < MIN_BATCH:
        return "too small to tell", (
            f"the trace sustains only {batch:.1f} requests per decoder on {cmp.num_decode} "
            "decoders without a request meeting a copy of itself: locality has nothing to "
            "group; capture more requests (or advise on fewer decoders)")
    met = sum(r["copies_in_flight"] for r in cmp.rows)
    if met:
        return "too small to tell", (f"{met} arrivals met a copy of their own request in a "
                                     "batch: the arrivals need more distinct requests than "
                                     "the trace holds; capture more")
    wins, noisy = [], []
    ranked = _recommended_first()
    for p in ranked:
        d = cmp.vs_jsq.get(p, {})
        if "p50" not in d:
            continue
        p50, p99 = d["p50"], d.get("p99")
        if not np.isfinite(p50.half_width) or p50.half_width > MAX_HALF_WIDTH:
            noisy.append(p)
        elif p50.high < -TOL and not (p99 is not None and p99.low > TOL):
            wins.append((p50.mean, ranked.index(p), p))
    if wins:
        _, _, p = min(wins)
        return p, _versus(cmp, p)
    if noisy:
        return "too small to tell", ("the intervals are wider than ±"
                                     f"{MAX_HALF_WIDTH:g} points ({', '.join(noisy)}): more "
                                     "requests or more seeds are needed")
    ran = [p for p in ranked if p in cmp.vs_jsq]
    if not ran:
        return "load balancing", "no locality policy has a routing input on this trace"
    return "load balancing", ("not worth it: neither is faster than JSQ by more than "
                              f"{TOL:g} % with 95 % confidence without a worse p99 ("
                              + "; ".join(_versus(cmp, p) for p in ran) + ")")


def _versus(cmp: Comparison, p: str) -> str:
    d = cmp.vs_jsq[p]

    def pct(x):
        return f"{x.mean:+.1f} ± {x.half_width:.1f} %" if np.isfinite(x.half_width) else \
            f"{x.mean:+.1f} %"
    return f"{p}: median TPOT {pct(d['p50'])}, p99 {pct(d['p99'])} vs JSQ"


def advise(trace: Trace, *, model: str | ModelPreset | None = None,
           hardware="h200", decoders: int | None = None,
           arrival_times: np.ndarray | None = None, seeds: int = 3, seed: int = 0,
           warmup_s: float = 10.0, duration_s: float = 30.0, locality: bool = True,
           log=None) -> Advice:
    """Everything ``eldr advise`` prints (module docstring)."""
    t0 = time.perf_counter()
    desc = trace.describe()
    trace, kind, notes = prepare(trace)
    if model is not None:
        preset = get_preset(model)
    else:
        try:
            preset = get_preset(trace.meta.model)
        except ValueError:
            raise ValueError(f"the trace's model {trace.meta.model!r} is no preset: give "
                             "--model PRESET or the model's config.json") from None
    m = trace.meta
    if (preset.num_layers, preset.num_experts, preset.top_k) != (m.num_layers, m.num_experts,
                                                                 m.top_k):
        raise ValueError(f"the trace is (layers, experts, top-k) = ({m.num_layers}, "
                         f"{m.num_experts}, {m.top_k}), model {preset.name} is "
                         f"({preset.num_layers}, {preset.num_experts}, {preset.top_k})")
    usable = int((trace.decode_lens > 0).sum())
    heldout = usable - round(0.5 * usable)
    K = int(decoders) if decoders is not None else _decoders(heldout)
    if K < 1:
        raise ValueError(f"--decoders must be >= 1, got {K}")
    inp = routing_input(trace)
    hw_name = str(getattr(hardware, "name", hardware))
    out = Advice(desc, kind, notes, preset.name, hw_name, K, inp, "", "")
    if heldout < MIN_HELDOUT:
        out.recommendation, out.reason = recommend(None, heldout=heldout)
        out.seconds = time.perf_counter() - t0
        return out
    trace = trace.subset(np.flatnonzero(trace.decode_lens > 0))
    out.comparison = compare(trace, model=preset, hardware=hardware, num_decode=K,
                             seeds=seeds, policies=advised_policies(), warmup_s=warmup_s,
                             duration_s=duration_s, base_seed=seed,
                             arrival_times=arrival_times, allow_dealt=True, log=log)
    out.recommendation, out.reason = recommend(out.comparison,
                                               heldout=out.comparison.heldout)
    if locality:
        out.locality, out.locality_note = _locality(trace, K, inp, out.comparison, seed)
    out.seconds = time.perf_counter() - t0
    return out


def _locality(trace: Trace, K: int, inp: str, cmp: Comparison, seed: int):
    """(the lockstep cut per batch size, or None, why not)."""
    if trace.decode_topk is None:
        return None, "skipped: no per-token decode experts to batch in lockstep"
    from eldr.fit.locality import Window, real_locality

    # decode steps 0 .. 23, fewer when a quarter of the requests decode less (every
    # request measured must have them all)
    steps = int(min(24, max(2, np.percentile(trace.decode_lens, 25))))
    batch = cmp.mean(reference(), "mean_batch")
    sizes = sorted({2, 4, 8, 16, *([max(2, round(batch))] if np.isfinite(batch) else [])})
    inputs = [x for x in (inp, "oracle") if x in ("prefill", "prompt", "oracle")]
    try:
        return real_locality(trace, num_decoders=K, batch_sizes=sizes, inputs=inputs,
                             window=Window(0, steps), resamples=100, seed=seed,
                             prompt_options=dict(PROMPT_OPTIONS)), ""
    except ValueError as exc:
        return None, f"not measured: {exc}"


_SHORT = {"prefill": "prefill signature", "prompt": "prompt prediction", "none": "none",
          "load": "none needed (load)", "decode": "true decode (oracle)"}


# -- output -----------------------------------------------------------------------------------
def _iv(x) -> str:
    if x is None:
        return "n/a"
    return f"{x.mean:+.1f} ± {x.half_width:.1f} %" if np.isfinite(x.half_width) else \
        f"{x.mean:+.1f} %"


def format_advice(a: Advice) -> str:
    """The advice as plain text (what ``eldr advise`` prints)."""
    lines = [a.trace, f"model {a.model} on {a.hardware}, {a.decoders} decoders; input: "
             f"{a.kind}", *(f"  - {n}" for n in a.notes)]
    c = a.comparison
    if c is not None:
        rho = [r for r in c.rho if np.isfinite(r)]
        lines.append(f"\nrho of the routing input ({INPUT_LABELS[c.trace_input]}) against "
                     "whole decodes, held out: "
                     + (f"{np.mean(rho):.3f} (seeds: {', '.join(f'{r:.3f}' for r in rho)})"
                        if rho else "n/a (no routing input)"))
        adm = [x for x in c.admitted if np.isfinite(x)]
        if c.trace_input == "prompt" and adm:
            lines.append(f"prediction gate: {100 * np.mean(adm):.0f} % of held-out prompts "
                         "routed on their prediction, the rest by load")
        lines.append(f"\nsimulated, {c.seeds} seeds (each its own half/half split and "
                     f"arrivals), {c.qps:.1f} req/s, {c.heldout} held-out requests, "
                     f"{c.mean(reference(), 'mean_batch'):.1f} requests per decoder (JSQ):")
        lines.append(f"  {'policy':<17} {'input':<26} {'TPOT p50':>9} {'p99':>7} "
                     f"{'D/layer':>8}  vs JSQ: p50 / p99 / D")
        for p in advised_policies():
            if not any(r["policy"] == p for r in c.rows):
                continue
            d = c.vs_jsq.get(p, {})
            row = next(r for r in c.rows if r["policy"] == p)
            vs = "" if p == reference() else \
                f"{_iv(d.get('p50'))} / {_iv(d.get('p99'))} / {_iv(d.get('distinct'))}"
            lines.append(f"  {p:<17} {_SHORT[row['input']]:<26} "
                         f"{c.mean(p, 'tpot_median_ms'):>9.2f} {c.mean(p, 'tpot_p99_ms'):>7.2f} "
                         f"{c.mean(p, 'mean_distinct_per_layer'):>8.2f}  {vs}")
        for p, why in c.skipped.items():
            lines.append(f"  {p:<17} not simulated: {why}")
        lines += [f"  note: {n}" for n in c.notes]
    if a.locality is not None:
        rep = a.locality
        lines.append(f"\ndistinct experts per layer per decode step, lockstep batches "
                     f"(decode steps {rep.window.start}-{rep.window.stop - 1}, {rep.num_routed}"
                     f" routed requests on {rep.num_decoders} decoders), cut vs round robin "
                     "with 95 % bootstrap intervals:")
        for i in rep.inputs:
            cuts = ", ".join(f"B={x.batch_size}: {100 * x.cut:+.1f} % [{100 * x.low:+.1f}, "
                             f"{100 * x.high:+.1f}] ({x.requests} req)" for x in i.cuts)
            lines.append(f"  {i.label:<28} rho {i.rho:.3f} (these steps)  {cuts}")
    elif a.locality_note:
        lines.append(f"\nlockstep cut: {a.locality_note}")
    lines.append(f"\nrecommendation: {a.recommendation} ({a.reason})")
    for p in oracles() if c is not None else ():
        if p in c.vs_jsq:
            lines.append("  (bound: routing on each request's true decode pattern, which no "
                         f"router has: median TPOT {_iv(c.vs_jsq[p].get('p50'))} vs JSQ)")
    lines.append(f"({a.seconds:.0f} s)")
    return "\n".join(lines)


def advice_json(a: Advice) -> str:
    """The advice as one JSON document (NaN and infinities as null)."""
    import json

    def clean(x):
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, (float, np.floating)):
            return float(x) if np.isfinite(x) else None
        if isinstance(x, np.integer):
            return int(x)
        return x
    return json.dumps(clean(a.as_dict()), indent=2)


def plot_advice(a: Advice, path) -> None:
    """Two panels: Δ TPOT vs JSQ per policy (95 % intervals); the lockstep cut against
    batch size per routing input (when measured). Needs matplotlib (the report extra)."""
    from eldr.reproduce.plots import pyplot

    plt = pyplot()
    panels = 2 if a.locality is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    c = a.comparison
    pols = [p for p in advised_policies() if c is not None and p in c.vs_jsq]
    x = np.arange(len(pols))
    for j, (metric, label) in enumerate((("p50", "median TPOT"), ("p99", "p99 TPOT"))):
        vals = [c.vs_jsq[p].get(metric) for p in pols]
        ax.bar(x + (j - 0.5) * 0.38, [v.mean if v else np.nan for v in vals], 0.38,
               yerr=[v.half_width if v and np.isfinite(v.half_width) else 0 for v in vals],
               capsize=3, label=label)
    ax.set_xticks(x, pols, fontsize=8)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("% vs JSQ")
    ax.set_title(f"{a.model}: simulated TPOT vs JSQ ({a.decoders} decoders)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    if a.locality is not None:
        ax = axes[0][1]
        for i in a.locality.inputs:
            b = [x.batch_size for x in i.cuts]
            ax.errorbar(b, [100 * x.cut for x in i.cuts], marker="o", capsize=3,
                        yerr=[[100 * (x.cut - x.low) for x in i.cuts],
                              [100 * (x.high - x.cut) for x in i.cuts]], label=i.label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size per decoder")
        ax.set_ylabel("distinct-expert cut vs round robin (%)")
        ax.set_title("lockstep batches")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
