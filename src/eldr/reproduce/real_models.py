"""The report's "Real models": ELDR on the real routing of two production-size MoE models,
beside the synthetic presets' own figures (docs/real-models.md, "Simulated on real routing").

Every synthetic figure of the report rests on traces drawn to match the paper's premises.
This section replays the routing eldr ships (:mod:`eldr.traces.real`) in the simulator
(:func:`eldr.reproduce.recorded.compare`), on the plan's hardware:

- **GPT-OSS-20B** (decode-only, with prompt token ids): 8 decoders; ``eldr`` and
  ``eldr_cost`` route on the prompt's predicted decode profile (no prefill signature
  exists);
- **ESFT** (DeepSeek-V2-Lite, teacher-forced; the first half of each sequence is the
  prompt): 4 decoders, the prefill signature; once with the recorded lengths and once
  with outputs capped at ``plan.real_output_cap`` tokens (as ``max_tokens`` would cap
  them), because 71 held-out sequences of up to 449 decode tokens sustain only about two
  requests per decoder without a request meeting a copy of itself.

Each at the highest rate its held-out split sustains, ``plan.real_seeds`` seeds (each its
own split, fit and arrivals), ``plan.real_warmup_s`` + ``plan.real_duration_s``. Beside
them, the paper's premise measured the same way on every trace: distinct experts per layer
of one decode step of 16 same-domain requests against 16 of the natural mix
(:func:`eldr.fit.premises.distinct_experts_reduction`), on the plan's synthetic held-out
traces and on the real ones (domains: ESFT's task, GPT-OSS's benchmark family).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from eldr.fit.premises import REDUCTION_TARGETS, distinct_experts_reduction
from eldr.reproduce.plan import Plan, band, other_locality
from eldr.reproduce.recorded import INPUT_LABELS, cap_outputs, compare, locality, oracles
from eldr.routing.registry import POLICIES
from eldr.traces.trace import Trace

__all__ = ["CASES", "PREMISE_BATCH", "RealCase", "plot_labels", "real_models",
           "real_models_markdown", "shown_policies"]

PREMISE_BATCH = 16  # the paper's same-domain premise: one decode step of 16 requests


@dataclass(frozen=True)
class RealCase:
    """One replayed real trace."""

    key: str  # results.json key
    trace: str  # name of the shipped trace (eldr.traces.real.REAL_TRACES)
    label: str  # as the report names it
    num_decode: int  # K
    capped: bool = False  # outputs capped at plan.real_output_cap tokens


CASES = (
    RealCase("gpt-oss-20b", "gpt-oss-20b", "GPT-OSS-20B", 8),
    RealCase("esft", "esft-vanilla-lite", "ESFT (DeepSeek-V2-Lite), as recorded", 4),
    RealCase("esft-capped", "esft-vanilla-lite", "ESFT (DeepSeek-V2-Lite), outputs capped",
             4, capped=True),
)


def _premise(name: str, kind: str, trace: Trace, seed: int) -> dict:
    """The same-domain cut of ``trace`` (a row of the premise table)."""
    row = {"trace": name, "kind": kind, "domains": list(trace.domain_names or ()),
           "batch": PREMISE_BATCH}
    try:
        d = distinct_experts_reduction(trace, batch_size=PREMISE_BATCH, num_batches=200,
                                       random_state=seed)
    except ValueError as exc:
        return {**row, "note": str(exc)}
    return {**row, "same_domain": d.same_domain, "mixed": d.mixed,
            "cut_pct": 100.0 * d.reduction, "source": d.source}


def _case(plan: Plan, case: RealCase) -> dict:
    """One case's comparison as a dict (run in a worker process: only plain data back)."""
    from eldr.traces.real import load_real_trace

    trace = load_real_trace(case.trace)
    if case.capped:
        trace = cap_outputs(trace, plan.real_output_cap)
    t0 = time.perf_counter()
    try:
        cmp = compare(trace, hardware=plan.hardware, num_decode=case.num_decode,
                      seeds=plan.real_seeds, warmup_s=plan.real_warmup_s,
                      duration_s=plan.real_duration_s, tau=plan.tau, base_seed=plan.seed)
    except ValueError as exc:  # e.g. a hardware file without constants of this model
        return {"key": case.key, "label": case.label, "error": str(exc)}
    out = {"key": case.key, "label": case.label, "trace": case.trace,
           "cap": plan.real_output_cap if case.capped else None, **cmp.as_dict()}
    out["means"] = {p: {"p50": cmp.mean(p, "tpot_median_ms"), "p99": cmp.mean(p, "tpot_p99_ms"),
                        "distinct": cmp.mean(p, "mean_distinct_per_layer"),
                        "batch": cmp.mean(p, "mean_batch")}
                    for p in {r["policy"] for r in cmp.rows}}
    out["wall_s"] = time.perf_counter() - t0
    return out


def real_models(plan: Plan, synthetic: dict[str, Trace] | None = None, *, jobs: int = 1,
                log=None) -> dict | None:
    """The section's figures (None when ``plan.real_models`` is off).

    ``synthetic``: the plan's synthetic held-out traces by workload, for the premise table;
    ``jobs``: the cases run in that many processes. Returns ``{"cases": [one dict per
    :data:`CASES` entry: the :class:`~eldr.reproduce.recorded.Comparison` as a dict plus
    ``means``], "premises": [rows], "seconds"}``."""
    if not plan.real_models:
        return None
    from eldr.traces.real import load_real_trace

    t0 = time.perf_counter()
    if jobs > 1:
        from joblib import Parallel, delayed

        cases = Parallel(n_jobs=min(jobs, len(CASES)))(delayed(_case)(plan, c) for c in CASES)
    else:
        cases = [_case(plan, c) for c in CASES]
    for c in cases:
        if log and "error" not in c:
            log(f"real models: {c['label']}: {c['qps']:.1f} req/s, {c['seeds']} seeds "
                f"({c['wall_s']:.1f} s)")
    premises = [_premise(wl, "synthetic", t, plan.seed) for wl, t in (synthetic or {}).items()]
    premises += [_premise(name, "real", load_real_trace(name), plan.seed)
                 for name in ("gpt-oss-20b", "esft-vanilla-lite")]
    return {"cases": cases, "premises": premises, "seconds": time.perf_counter() - t0}


# -- which policies the section shows, and as what ---------------------------------------------
def shown_policies() -> tuple[str, ...]:
    """The policies of the section's Δ columns: the locality policies, the recommended
    first (report role ``preference``, then report order), then the oracles on the true
    decode pattern."""
    def rank(p: str) -> tuple:
        r = POLICIES[p].report
        return (r.preference is None, r.preference or 0, r.order)
    return (*sorted(locality(), key=rank), *oracles())


def _short(p: str) -> str:
    """A policy's name in the D/layer chains: the band's label, the others' keys."""
    r = POLICIES[p].report
    return r.label if p == band() else r.key


def plot_labels() -> dict[str, str]:
    """Policy → its legend label in the section's plot, in :func:`shown_policies` order."""
    def label(p: str) -> str:
        r = POLICIES[p].report
        if p == band():
            return f"{r.label} ({p})"
        return f"{r.label} (true decode)" if POLICIES[p].reads_true_decode else r.label
    return {p: label(p) for p in shown_policies()}


# -- Markdown ---------------------------------------------------------------------------------
def _iv(d: dict, policy: str, metric: str) -> str:
    x = d.get(policy, {}).get(metric)
    if not x or x["mean"] is None or not np.isfinite(x["mean"]):
        return "n/a"
    h = x["half_width"]
    return f"{x['mean']:+.1f}±{h:.1f}%" if h is not None and np.isfinite(h) else \
        f"{x['mean']:+.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _case_row(c: dict) -> list[str]:
    if "error" in c:
        width = 8 + len(shown_policies())  # the table's columns
        return [c["label"], *["—"] * 6, f"not run: {c['error']}", *[""] * (width - 8)]
    m, lb = c["means"], c["best_balancer"]

    def d(p):
        return f"{m[p]['distinct']:.1f}" if p in m else "n/a"
    rho = np.nanmean(c["rho"]) if c["rho"] and np.isfinite(c["rho"]).any() else float("nan")
    inp = INPUT_LABELS[c["trace_input"]]
    adm = [a for a in c.get("admitted", []) if a is not None and np.isfinite(a)]
    if c["trace_input"] == "prompt" and adm:
        inp += f" (the gate let {100 * np.mean(adm):.0f} % of requests use it)"
    return [c["label"] + (f" (≤ {c['cap']} output tokens)" if c["cap"] else ""),
            f"{c['num_decode']}", inp,
            f"{c['heldout']} / {c['qps']:.1f} / {m[lb]['batch']:.1f}",
            "n/a" if not np.isfinite(rho) else f"{rho:.2f}",
            f"{lb} {m[lb]['p50']:.2f} / {m[lb]['p99']:.2f}",
            *(f"{_iv(c['deltas'], p, 'p50')} / {_iv(c['deltas'], p, 'p99')}"
              for p in shown_policies()),
            " → ".join([d(lb), *(d(p) for p in _chained())]),
            str(sum(r["copies_in_flight"] for r in c["rows"]))]


def _chained() -> tuple[str, ...]:
    """The D/layer chain's policies: the locality ones in report order, then the oracles."""
    return (*locality(), *oracles())


def _premise_row(p: dict) -> list[str]:
    target = REDUCTION_TARGETS.get(p["trace"])
    paper = f"{100 * target[0]:.0f}–{100 * target[1]:.0f}%" if target else "—"
    if "note" in p:
        return [p["trace"], p["kind"], ", ".join(p["domains"]), "n/a", "n/a",
                f"n/a ({p['note']})", paper]
    return [p["trace"], p["kind"], ", ".join(p["domains"]), f"{p['same_domain']:.1f}",
            f"{p['mixed']:.1f}", f"{-p['cut_pct']:+.1f}%", paper]


def real_models_markdown(res: dict, plan: Plan, headline: list[dict]) -> list[str]:
    """The section's Markdown from :func:`real_models`'s figures and the report's headline
    rows (the synthetic presets' own D/layer and Δ, beside the real ones)."""
    seeds = plan.real_seeds
    md = ["\n## Real models: GPT-OSS-20B and ESFT (DeepSeek-V2-Lite) routing\n",
          "Every synthetic figure above rests on traces drawn to match the paper's premises. "
          "Here the simulator replays the recorded per-token experts of two production-size "
          "models (shipped with eldr; sources, licences and caveats in docs/real-models.md), "
          f"on `{plan.hardware}` with the `gpt-oss-20b` and `deepseek-v2-lite` presets. Half "
          "of each trace calibrates, the other half is replayed; each of "
          f"{seeds} seeds has its own split, fit and arrivals, and every Δ is the mean of the "
          "per-seed paired differences against the best balancer (lowest mean median TPOT "
          "of round robin, JSQ and P2C) ± the 95 % half-width. The rate is the highest at "
          "which no request meets a copy of itself in a batch (arrivals cycle through the "
          "held-out split; the last column counts such meetings, all runs together): the "
          "batch per decoder is what the data sustains, not a choice. Routing input: what "
          "`eldr` and `eldr_cost` know of a request when they pick its decoder "
          "(GPT-OSS-20B's recording has no prefill routing, so both route on the prompt's "
          "predicted decode profile, where the prediction gate of docs/real-models.md lets "
          "them; a request it refuses is routed by load); the balancers need none, the "
          "oracle reads the true "
          f"decode pattern. {plan.real_warmup_s:g} + {plan.real_duration_s:g} s per run.\n"]
    md.append(_table(
        ["routing", "K", f"{' / '.join(locality())} input", "held-out / req/s / batch",
         "ρ held-out", "best LB p50 / p99 ms",
         *(f"{POLICIES[p].report.label} Δ p50 / p99" for p in shown_policies()),
         "D/layer " + " → ".join(["LB", *(_short(p) for p in _chained())]), "copies met"],
        [_case_row(c) for c in res["cases"]]))
    md.append("\nThe synthetic presets' own, from the headline above (Qwen3-30B-A3B traces "
              "drawn to the paper's premises, 16 decoders; Δ vs the best balancer):\n")
    keys = [POLICIES[p].report.key for p in (band(), *other_locality())]
    md.append(_table(
        ["synthetic workload", "req/s", "batch",
         "D/layer " + " → ".join(["LB", *(_short(p) for p in (band(), *other_locality()))]),
         f"{POLICIES[band()].report.label} Δ p50 / p99",
         *(f"{POLICIES[p].report.label} Δ p50 / p99" for p in other_locality())],
        [[h["workload"], f"{h['qps']:g}", f"{h['lb_batch']:.1f}",
          " → ".join(f"{h[f'{k}_distinct']:.1f}" for k in ["lb", *keys]),
          _hl(h, "d_p50") + " / " + _hl(h, "d_p99"),
          *(_hl(h, f"{k}_d_p50") + " / " + _hl(h, f"{k}_d_p99") for k in keys[1:])]
         for h in headline]))
    md.append(f"\nThe paper's premise on every trace: distinct experts per layer of one decode "
              f"step of {PREMISE_BATCH} same-domain requests against {PREMISE_BATCH} of the "
              "natural mix (`eldr.fit.premises`; 200 batches each; a domain with fewer than "
              f"{PREMISE_BATCH} requests is left out). The synthetic traces are drawn to hit "
              "the paper's range; the real ones show what their domain labels carry.\n")
    md.append(_table(["trace", "routing", "domains", "same-domain D/layer", "mixed D/layer",
                      "same-domain cut", "paper"],
                     [_premise_row(p) for p in res["premises"]]))
    return md


def _hl(h: dict, name: str) -> str:
    x, half = h.get(name), h.get(f"{name}_h", float("nan"))
    if x is None or not np.isfinite(x):
        return "n/a"
    return f"{x:+.1f}±{half:.1f}%" if np.isfinite(half) else f"{x:+.1f}%"
