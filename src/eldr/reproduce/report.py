"""Tables, plots and ``report.md`` from the rows of :func:`eldr.reproduce.sweeps.run_plan`.

:func:`write_report` writes one section per experiment, each from its own function that
returns the section's Markdown and the rows ``results.json`` keeps for it. All but one
read the plan's simulated rows; "Routing before prefill" computes its few figures itself
(:mod:`eldr.reproduce.before_prefill`, seconds).

Every comparison is ELDR against the BEST load balancer (lowest median TPOT among the
report's balancers) of the same (workload, rate, pool size): Δ% = 100 · (ELDR −
best) / best, negative = ELDR faster. The paper reports −7.0…−13.9% (task) and
−5.9…−10.0% (language) median TPOT at 8P16D.

Which policies each table shows, and what its columns are called, comes from the
registry's report roles (:class:`eldr.routing.ReportRole`; docs/adding-a-policy.md): a
locality policy registered with one is in every section its role belongs to.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr.fileio import atomic_write_text
from eldr.reproduce.analysis import Analysis
from eldr.reproduce.before_prefill import NUM_GROUPS, before_prefill, section_policies
from eldr.reproduce.grid import (
    TOLERANCE_PCT,
    balancer_check,
    comparisons,
    grid_rows,
    grid_table,
)
from eldr.reproduce.plan import Plan, band, grid_balancers, grid_policies, other_locality
from eldr.reproduce.plots import plot_bars, plot_decoders, plot_grid, plot_intervals, plot_main
from eldr.reproduce.real_models import CASES, plot_labels, real_models, real_models_markdown
from eldr.reproduce.sweeps import Results
from eldr.routing.registry import POLICIES, report_policies
from eldr.sim.metrics import write_csv, write_json

__all__ = ["headline_text", "write_report"]

PAPER = {"task": "−7.0…−13.9%", "language": "−5.9…−10.0%"}


def _f(x: float, nd: int = 2) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


def _s(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:+.1f}%"


def _pm(h: dict, name: str) -> str:
    """Headline Δ ``h[name]`` with its 95 % half-width ``h[name + '_h']``: "+1.2±0.4%"
    (no ± with one seed)."""
    x, half = h[name], h.get(f"{name}_h", float("nan"))
    if x is None or not np.isfinite(x):
        return "n/a"
    return f"{x:+.1f}±{half:.1f}%" if np.isfinite(half) else f"{x:+.1f}%"


# -- report -----------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _key(name: str) -> str:
    """The results.json key of a report policy (its report role's ``key``)."""
    return POLICIES[name].report.key


def headline_text(an: Analysis) -> str:
    """The headline table as plain text (printed by ``eldr reproduce``)."""
    pk, oracles = _key(band()), [_key(p) for p in report_policies("oracle")]
    others = [_key(p) for p in other_locality()]
    lines = [f"{'workload':<9} {'req/s':>5} {'best LB':>11} {'TPOT p50':>9} {'ELDR':>7} "
             f"{'Δp50':>12} {'TPOT p99':>9} {'ELDR':>7} {'Δp99':>12} "
             + " ".join(f"{k:>12}" for k in oracles) + " "
             + " ".join(f"{f'{k} Δp50':>12} {f'{k} Δp99':>12}" for k in others)]
    for h in an.headline():
        lines.append(
            f"{h['workload']:<9} {h['qps']:>5g} {h['best_lb']:>11} {h['lb_tpot_p50']:>9.2f} "
            f"{h[f'{pk}_tpot_p50']:>7.2f} {_pm(h, 'd_p50'):>12} {h['lb_tpot_p99']:>9.2f} "
            f"{h[f'{pk}_tpot_p99']:>7.2f} {_pm(h, 'd_p99'):>12} "
            + " ".join(f"{_pm(h, f'{k}_d_p50'):>12}" for k in oracles) + " "
            + " ".join(f"{_pm(h, f'{k}_d_p50'):>12} {_pm(h, f'{k}_d_p99'):>12}"
                       for k in others))
    seeds = {h["seeds"] for h in an.headline()}
    if seeds and max(seeds) > 1:
        lines.append(f"(mean of {'/'.join(map(str, sorted(seeds)))} seeds' paired differences "
                     "± 95 % half-width; ms: mean over seeds)")
    return "\n".join(lines)


def write_report(results: Results, out: str | Path) -> Path:
    """Write report.md, PNG plots, rows.csv, decoders.csv and results.json under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    an = Analysis(results)
    write_csv(results.rows, out / "rows.csv")
    write_csv(results.decoder_rows, out / "decoders.csv")
    md = _intro(results) + _fit_section(results)
    # the plan as it ran: its headline policies resolved from the registry
    doc: dict = {"plan": {**results.plan.__dict__,
                          "policies": list(results.plan.headline_policies())}}
    for name, section in SECTIONS:
        lines, rows = section(an, out)
        md += lines
        doc[name] = rows
    md += _decoders_section(an, out)
    md.append("\n## Files\n\n`rows.csv` (one row per simulation), `decoders.csv` (per-decoder "
              "statistics), `results.json` (headline, sweeps, timings).\n")
    write_json({**doc, "seconds": results.seconds}, out / "results.json")
    return atomic_write_text(out / "report.md", "\n".join(md) + "\n")


# -- sections: (an, out) -> (Markdown lines, rows kept in results.json) -----------------------
Section = tuple[list[str], list[dict]]


def _intro(results: Results) -> list[str]:
    plan = results.plan
    return [f"# ELDR reproduction report ({plan.name})", "",
            f"Model preset `{plan.model}` on `{plan.hardware}`, {plan.num_prefill}P"
            f"{plan.num_decode}D, rates {list(plan.rates)} req/s, warm-up {plan.warmup_s:g} s, "
            f"measured {plan.duration_s:g} s per point, seed {plan.seed}. Traces: "
            f"`eldr.traces.synth` (calibrated to the paper's premises only), seed "
            f"{plan.trace_seed}. Wall time {results.seconds.get('total', 0):.0f} s "
            f"({results.seconds.get('jobs', 1)} process(es)).", ""]


def _fit_section(results: Results) -> list[str]:
    return ["## Fit (calibration split only)\n",
            _table(["workload", "calibration", "held-out", "ρ (count·idf)", "layers |S|",
                    "encoder fit (s)"],
                   [[wl, str(s.calib.num_requests), str(s.eval.num_requests),
                     f"{s.encoder.rho_:.3f}", str(s.encoder.layers_.size),
                     f"{s.fit_seconds:.1f}"] for wl, s in results.setups.items()])]


def _headline_section(an: Analysis, out: Path) -> Section:
    """ELDR and the cost policy vs the best load balancer at 8P16D, with the main plots."""
    md = ["\n## Headline: ELDR vs the best load balancer (median / p99 TPOT)\n",
          f"Paper at 8P16D: median TPOT {PAPER['task']} (task), {PAPER['language']} "
          "(language). Δ = (policy − best LB) / best LB; negative is better.\n"]
    hl = an.headline()
    if an.plan.main_seeds > 1:
        md.append(f"Each point runs {an.plan.main_seeds} seeds (the same arrivals for every "
                  "policy of a seed). The best LB has the lowest median TPOT averaged over "
                  "them; each Δ is the mean of the per-seed paired differences against it "
                  "± the 95 % half-width (Student t, docs/simulator.md); ms and D/layer are "
                  "means over the seeds. An interval that contains 0 does not tell the "
                  "policies apart.\n")
    pk, oracles = _key(band()), report_policies("oracle")
    md.append(_table(
        ["workload", "req/s", "best LB", "LB p50 ms", "ELDR p50 ms", "Δ p50", "LB p99 ms",
         "ELDR p99 ms", "Δ p99", "Δ TTFT p50",
         *(f"{POLICIES[p].report.label} Δ p50" for p in oracles),
         "D/layer LB→ELDR", "batch"],
        [[h["workload"], f"{h['qps']:g}", h["best_lb"], _f(h["lb_tpot_p50"]),
          _f(h[f"{pk}_tpot_p50"]), _pm(h, "d_p50"), _f(h["lb_tpot_p99"]),
          _f(h[f"{pk}_tpot_p99"]), _pm(h, "d_p99"), _pm(h, "d_ttft"),
          *(_pm(h, f"{_key(p)}_d_p50") for p in oracles),
          f"{h['lb_distinct']:.1f}→{h[f'{pk}_distinct']:.1f}", f"{h['lb_batch']:.1f}"]
         for h in hl]))
    md += _other_locality_lines(an, hl)
    for wl in an.plan.workloads:
        plot_main(an, wl, out / f"main_{wl}.png")
        md.append(f"\n![{wl}](main_{wl}.png)\n")
    return md, hl


def _other_locality_lines(an: Analysis, hl: list[dict]) -> list[str]:
    """The headline's sub-table of the locality policies besides the band (and their
    online variants), headed by their report roles' titles, with their ``about``."""
    others = other_locality()
    if not others:
        return []
    roles = [POLICIES[p].report for p in others]
    cols = an.headline_columns()  # (key, variant, label) per column
    pk = _key(band())
    return [
        "\n### " + " and ".join(f"{r.title if i == 0 else r.title[:1].lower() + r.title[1:]}"
                                f" (`{p}`)" for i, (p, r) in enumerate(zip(others, roles,
                                                                           strict=True)))
        + " in the same cells\n",
        " ".join(r.about for r in roles if r.about)
        + " Δ vs the same best load balancer (median / p99 TPOT).\n",
        _table(["workload", "req/s", "ELDR Δ p50 / p99",
                *(f"{label} Δ p50 / p99" for _, _, label in cols),
                "D/layer LB→ELDR→" + "→".join(r.key for r in roles)],
               [[h["workload"], f"{h['qps']:g}", f"{_pm(h, 'd_p50')} / {_pm(h, 'd_p99')}",
                 *(f"{_pm(h, f'{k}_d_p50')} / {_pm(h, f'{k}_d_p99')}" for k, _, _ in cols),
                 f"{h['lb_distinct']:.1f}→{h[f'{pk}_distinct']:.1f}→"
                 + "→".join(_f(h[f"{r.key}_distinct"], 1) for r in roles)]
                for h in hl])]


def _tau_section(an: Analysis, out: Path) -> Section:
    plan, tau = an.plan, an.tau_rows()
    if not tau:
        return [], tau
    md = [f"\n## τ sweep ({plan.workloads[0]}, {plan.tau_rate:g} req/s)\n",
          "τ = 0 is top-1 (nearest centroid only), τ = 1 is pure JSQ.\n",
          _table(["τ", "TPOT p50 ms", "TPOT p99 ms", "Δ p50 vs best LB",
                  "Δ p99 vs best LB", "D/layer", "max request share"],
                 [[f"{r['tau']:g}", _f(r["tpot_p50"]), _f(r["tpot_p99"]),
                   _s(r["d_p50"]), _s(r["d_p99"]), _f(r["distinct"], 1),
                   _f(r["max_share"], 3)] for r in tau])]
    plot_bars([f"{r['tau']:g}" for r in tau],
              {"Δ median TPOT %": [r["d_p50"] for r in tau],
               "Δ p99 TPOT %": [r["d_p99"] for r in tau]},
              "ELDR vs best load balancer by τ", "% vs best LB", out / "tau.png")
    md.append("\n![tau](tau.png)\n")
    return md, tau


def _pool_section(an: Analysis, out: Path) -> Section:
    plan, pool = an.plan, an.pool_rows()
    if not pool:
        return [], pool
    others = [POLICIES[p].report for p in other_locality()]
    md = [f"\n## Decode-pool size ({plan.workloads[0]}, mean over rates "
          f"{list(plan.pool_rates)})\n",
          "Paper: 8.0 → 9.8 → 10.2% median TPOT reduction for 8P8D → 8P16D → 8P24D.\n",
          _table(["pool", "ELDR Δ p50 vs best LB", "ELDR Δ p99",
                  *(f"{r.label} Δ {m}" for r in others for m in ("p50", "p99"))],
                 [[r["pool"], _s(r["d_p50"]), _s(r["d_p99"]),
                   *(_s(r[f"{o.key}_d_{m}"]) for o in others for m in ("p50", "p99"))]
                  for r in pool])]
    series = {"ELDR Δ median %": [r["d_p50"] for r in pool],
              "ELDR Δ p99 %": [r["d_p99"] for r in pool]}
    for o in others:
        series[f"{o.label} Δ median %"] = [r[f"{o.key}_d_p50"] for r in pool]
        series[f"{o.label} Δ p99 %"] = [r[f"{o.key}_d_p99"] for r in pool]
    plot_bars([r["pool"] for r in pool], series,
              "ELDR vs best load balancer by decode-pool size", "% vs best LB",
              out / "pool.png")
    md.append("\n![pool](pool.png)\n")
    return md, pool


def _vanilla_section(an: Analysis, out: Path) -> Section:
    van = an.vanilla_rows()
    if not van:
        return [], van
    md = ["\n## Vanilla vs balanced K-means (mean % Δ vs round-robin over rates)\n",
          "Paper (Fig. 15): vanilla −9.8% p50 but +17.4% p99; balanced −12.6% / −6.8%.\n",
          _table(["workload", "centroids", "Δ p50 vs RR", "Δ p99 vs RR",
                  "calibration cluster sizes (max/min)"],
                 [[r["workload"], r["kind"], _s(r["d_p50"]), _s(r["d_p99"]),
                   f"{r['cluster_max']}/{r['cluster_min']}"] for r in van])]
    plot_bars([f"{r['workload']}\n{r['kind']}" for r in van],
              {"Δ p50 vs RR %": [r["d_p50"] for r in van],
               "Δ p99 vs RR %": [r["d_p99"] for r in van]},
              "vanilla vs balanced K-means", "% vs round-robin", out / "vanilla.png")
    md.append("\n![vanilla](vanilla.png)\n")
    return md, van


def _prefix_section(an: Analysis, out: Path) -> Section:
    plan, pre = an.plan, an.prefix_rows()
    if not pre:
        return [], pre
    md = [f"\n## Prefix caching ({plan.workloads[0]}, per-token trace of "
          f"{plan.prefix_requests} requests, {plan.tau_rate:g} req/s)\n",
          "Prefill workers cache prefixes. ELDR's signatures come either through the "
          "block-granular signature cache (`eldr.cache.sigcache`, exact) or from the freshly "
          "computed tokens only (what a capture without the cache sees). Arrivals "
          "stop before held-out requests would repeat (a repeat hits the cache with "
          "its whole prompt), so this window is short.\n",
          _table(["router", "TPOT p50 ms", "TPOT p99 ms", "Δ p50 vs best LB",
                  "Δ p99 vs best LB", "exact signatures", "prefix-hit requests"],
                 [[r["variant"], _f(r["tpot_p50"]), _f(r["tpot_p99"]), _s(r["d_p50"]),
                   _s(r["d_p99"]), _f(r["exact"], 3), _f(r["hits"], 3)] for r in pre])]
    return md, pre


def _ep_section(an: Analysis, out: Path) -> Section:
    plan, ep = an.plan, an.ep_rows()
    if not ep:
        return [], ep
    md = [f"\n## Expert parallelism ({plan.ep_model}, TP{plan.ep_tp}/EP{plan.ep}, "
          f"{plan.ep_num_prefill}P{plan.ep_num_decode}D, {plan.workloads[0]})\n",
          "MoE layer time = slowest EP rank's a + b·D_rank. Layouts: vLLM's contiguous "
          "blocks, one global greedy layout balanced on the calibration activation, "
          "or one layout per decoder balanced on its cluster. Paper: −2.7…−4.3% "
          "median TPOT.\n",
          _table(["req/s", "best LB (layout)", "LB p50 ms", "ELDR contiguous Δ p50",
                  "ELDR global Δ p50", "ELDR per-decoder Δ p50", "per-decoder Δ p99"],
                 [[f"{r['qps']:g}", r["best_lb"], _f(r["lb_p50"]),
                   _s(r["contiguous_p50"]), _s(r["global_p50"]),
                   _s(r["per_decoder_p50"]), _s(r["per_decoder_p99"])] for r in ep])]
    return md, ep


def _grid_section(an: Analysis, out: Path) -> Section:
    plan = an.plan
    variants = {p: an.variant(p) for p in grid_policies()}
    grid = grid_rows(an.results.rows, variants) if plan.grid else []
    if not grid:
        return [], grid
    comps = comparisons(an.results.rows, variants)
    seeds = [r["n"] for r in grid]
    md = ["\n## Never worse than load balancing\n",
          f"Every cell of rates {list(plan.grid_rates)} req/s × decode pools "
          f"{list(plan.grid_pools)} ({plan.num_prefill} prefill workers) × "
          f"workloads {list(plan.grid_workloads)}, {plan.grid_warmup_s:g} s "
          f"warm-up + {plan.grid_duration_s:g} s measured per cell, longer at low "
          f"rates so every cell measures at least {plan.grid_min_requests} "
          "requests. `azure_conv` and `mooncake_conv` replay the real traces' arrival times "
          "(scaled to the rate, bursts kept) and prompt/output lengths, with routing drawn "
          "for those lengths.\n",
          (f"Each cell runs {plan.grid_start_seeds} seeds. "
           if plan.grid_start_seeds == plan.grid_max_seeds else
           f"Each cell runs {plan.grid_start_seeds} to {plan.grid_max_seeds} seeds "
           f"(here {min(seeds)}–{max(seeds)}): one is added at a time until every interval "
           f"of the cell is within ±{plan.target_half_width:g} points. ")
          + "Every Δ is the mean of "
          "per-seed paired differences (same arrivals) against ONE load balancer, with "
          f"its 95 % interval, for each of {', '.join(grid_balancers())} and each metric "
          f"(median and p99 TPOT). A comparison is **worse** when the interval lies "
          f"entirely above +{TOLERANCE_PCT:g}%, _not distinguishable_ when it straddles "
          f"+{TOLERANCE_PCT:g}%, better or equal when it lies entirely below. The last "
          "column is the rule's false-positive expectation: how many comparisons a policy "
          "truly equal to that balancer would see classed worse by chance, with each "
          "cell's observed spread and seeds (a noncentral-t tail, "
          "docs/simulator.md). The check line runs two load balancers through the same "
          "rule: they are different policies, so a \"worse\" there may be real. In the "
          "cell tables each policy's Δs are against its decisive balancer "
          "(the worst class, then the largest Δ).\n",
          grid_table(grid, comps, balancer_check(an.results.rows))]
    plot_grid(grid, out / "grid.png")
    md.append("\n![grid](grid.png)\n")
    return md, grid


def _tiny_section(an: Analysis, out: Path) -> Section:
    plan = an.plan
    tiny = an.tiny_rows() if plan.tiny else []
    if not tiny:
        return [], tiny
    others = [POLICIES[p].report for p in other_locality()]
    keys = [_key(band()), *(o.key for o in others)]  # the band's columns first
    md = ["\n## The real tiny-MoE trace on its measured CPU preset\n",
          f"The shipped tiny Qwen3-MoE's captured routing (314 held-out prompts; "
          f"calibration a third), step costs measured on this project's CPU "
          f"(`--hardware cpu`, docs/simulator.md), {plan.tiny_num_prefill}P"
          f"{plan.tiny_num_decode}D, {plan.tiny_warmup_s:g} + "
          f"{plan.tiny_duration_s:g} s. Δ vs the best load balancer per metric.\n",
          _table(["req/s", "batch", "best LB", "LB p50 ms", "LB p99 ms",
                  "ELDR Δ p50 / p99", *(f"{o.label} Δ p50 / p99" for o in others),
                  "D/layer LB→ELDR→" + "→".join(o.key for o in others)],
                 [[f"{r['qps']:g}", f"{r['batch']:.1f}", r["best_lb"],
                   _f(r["lb_p50"]), _f(r["lb_p99"]),
                   *(f"{_s(r[f'{k}_d_p50'])} / {_s(r[f'{k}_d_p99'])}" for k in keys),
                   f"{r['lb_distinct']:.1f}→"
                   + "→".join(_f(r[f"{k}_distinct"], 1) for k in keys)] for r in tiny])]
    return md, tiny


def _prompt_section(an: Analysis, out: Path) -> Section:
    """Routing before prefill: the prompt predictor beside the prefill signature, computed
    here on the shipped prompt trace (:mod:`eldr.reproduce.before_prefill`, seconds)."""
    plan = an.plan
    res = before_prefill(plan)
    if res is None:
        return [], []
    return before_prefill_markdown(res, plan), [res]


def _real_section(an: Analysis, out: Path) -> Section:
    """Real models: the shipped GPT-OSS-20B and ESFT routing replayed, beside the synthetic
    presets' own figures (:mod:`eldr.reproduce.real_models`, computed here)."""
    plan = an.plan
    synthetic = {wl: an.results.setups[wl].eval for wl in plan.workloads
                 if wl in an.results.setups and an.results.setups[wl].eval.domains is not None}
    res = real_models(plan, synthetic, jobs=int(an.results.seconds.get("jobs", 1)))
    if res is None:
        return [], []
    md = real_models_markdown(res, plan, an.headline())
    ok = [c for c in res["cases"] if "error" not in c]
    if ok:
        names = plot_labels()
        series = {label: [(c["deltas"].get(p, {}).get("p50", {}).get("mean", float("nan")),
                           c["deltas"].get(p, {}).get("p50", {}).get("half_width",
                                                                     float("nan")))
                          for c in ok] for p, label in names.items()}
        labels = {c.key: c.label for c in CASES}
        plot_intervals([labels[c["key"]].replace(" (DeepSeek-V2-Lite)", "").replace(", ", "\n")
                        for c in ok], series,
                       "real routing: median TPOT vs the best balancer (95 % intervals)",
                       "Δ median TPOT %", out / "real_models.png")
        md.append("\n![real models](real_models.png)\n")
    return md, [res]


_SOURCE_NAMES = {"prompt": "prompt predictor (before prefill)",
                 "prefill": "prefill signature (after prefill)",
                 "tfidf": "TF-IDF of the prompt's tokens"}


def before_prefill_markdown(res: dict, plan: Plan) -> list[str]:
    """The section's Markdown from :func:`~eldr.reproduce.before_prefill.before_prefill`'s
    figures (``plan`` gives the simulator's sizes)."""
    columns = section_policies()
    md = ["\n## Routing before prefill (the prompt predictor)\n",
          "On the shipped tiny-MoE capture that keeps its prompt token ids "
          f"(`tiny_moe_prompts.npz`, {res['num_fit'] + res['num_heldout']} prompts of ten "
          "domains; docs/capture.md). Synthetic traces draw token ids uniformly, so a "
          "predictor that reads the prompt has nothing to learn there: it is evaluated on "
          "captured traces only.\n",
          f"Held-out quality: encoder and predictor fitted on {res['num_fit']} requests, "
          f"evaluated on the other {res['num_heldout']}; R² of the predicted prefill "
          f"profile **{res['r2']:.3f}**. ρ against the decode patterns; distinct experts "
          f"per layer of one decode step when the held-out requests are grouped into "
          f"{NUM_GROUPS} decoders by balanced K-means on each input, against round robin "
          f"({res['round_robin']:.2f}).\n",
          _table(["routing input", "ρ", "distinct/layer/step", "vs round robin"],
                 [[_SOURCE_NAMES[r["source"]], f"{r['rho']:.3f}", f"{r['distinct']:.2f}",
                   _s(-r["reduction_pct"])] for r in res["quality"]]),
          f"\nMedian TPOT (ms) in the simulator, tiny-MoE CPU preset, "
          f"{plan.tiny_num_prefill}P{plan.tiny_num_decode}D, {plan.tiny_warmup_s:g} + "
          f"{plan.prompt_duration_s:g} s, seed {plan.seed}, a third of the trace "
          "calibrating; `eldr_cost` on the predicted signature and profile vs on the real "
          "prefill ones, same arrivals. Gap = prediction vs prefill signature.\n",
          _table(["req/s", *(f"`{p}`" for p in columns), "gap", "cost beats JSQ"],
                 [[f"{r['qps']:g}", *(_f(r[p]) for p in columns), _s(r["prompt_gap_pct"]),
                   "yes" if r["cost_wins"] else "no"] for r in res["tpot"]])]
    return md


def _decoders_section(an: Analysis, out: Path) -> list[str]:
    """Distinct experts per decoder (a plot; its rows are in decoders.csv already)."""
    if not plot_decoders(an, out / "decoders.png"):
        return []
    return [f"\n## Distinct experts per decoder ({an.plan.workloads[0]}, "
            f"{an.plan.tau_rate:g} req/s)\n", "![decoders](decoders.png)\n"]


# report order; the names are results.json's keys
SECTIONS = (("headline", _headline_section), ("tau", _tau_section), ("pool", _pool_section),
            ("vanilla", _vanilla_section), ("prefix", _prefix_section), ("ep", _ep_section),
            ("grid", _grid_section), ("tiny", _tiny_section), ("prompt", _prompt_section),
            ("real_models", _real_section))
