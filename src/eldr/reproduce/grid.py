"""The "never worse than load balancing" grid: every (workload, decode pool, rate) cell,
on several seeds, with 95 % intervals.

For each cell the decode-routing policies that use expert locality
(:func:`~eldr.reproduce.plan.grid_policies`: the band, the marginal expert cost) are
compared with EACH load balancer of :func:`~eldr.reproduce.plan.grid_balancers`
separately, per metric (median and p99 TPOT). A comparison is the mean of per-seed
PAIRED differences, ``100 · (policy − balancer) / balancer`` on the same
seed's arrivals, with its 95 % Student-t interval (:func:`eldr.intervals.paired_interval`).
Comparing with the per-metric minimum over balancers instead would bias every Δ upwards
by about the seed-to-seed spread (a minimum over noisy estimates), and a single seed
cannot tell noise from a real loss.

Each comparison falls in one of three classes against the tolerance ``TOLERANCE_PCT``
(+1 %): ``WORSE`` when the whole interval lies above it, ``BETTER`` ("better or equal")
when the whole interval lies below it, ``UNSURE`` ("not distinguishable") when it
straddles it. The rule's false-positive rate is :func:`false_worse_probability`: how
often a policy truly equal to the balancer would be classed worse by chance.

Cells use short windows (the plan's ``grid_warmup_s`` + ``grid_duration_s``), the same
arrivals and tokens for every policy of a seed; a cell gets seeds until its widest
interval is at most ``target_half_width`` or it has ``grid_max_seeds``
(:func:`cells_needing_seeds`, run by :func:`eldr.reproduce.sweeps.run_plan`). The two
balancers of the rule's check are the registry's ``check_pair`` (:func:`check_pair`).

Workloads: the synthetic ``task`` and ``language`` (Poisson arrivals) and the real
``azure_conv`` and ``mooncake_conv`` traces (their own arrival times scaled to each rate,
bursts kept, and their prompt/output lengths; expert routing drawn for those lengths).
"""

from __future__ import annotations

import math

import numpy as np

from eldr.intervals import PairedInterval, paired_interval, percent_change, t_quantile_975
from eldr.reproduce.plan import grid_balancers, grid_policies
from eldr.routing.registry import report_flagged

__all__ = ["BETTER", "CLASSES", "METRICS", "TOLERANCE_PCT", "UNSURE", "WORSE",
           "balancer_check", "cells_needing_seeds", "check_pair", "class_counts", "classify",
           "comparisons", "false_worse_probability", "grid_rows", "grid_table"]

TOLERANCE_PCT = 1.0  # "never worse": within +1% of the load balancer
WORSE, UNSURE, BETTER = "worse", "not distinguishable", "better or equal"
CLASSES = (WORSE, UNSURE, BETTER)  # worst first
METRICS = {"p50": "tpot_median_ms", "p99": "tpot_p99_ms"}  # short name -> row column


def check_pair() -> tuple[str, str]:
    """The two balancers compared with each other as an empirical check of the rule (the
    registry's report flag ``check_pair``, in report order)."""
    a, b = report_flagged("check_pair")
    return a, b


def classify(iv: PairedInterval, tol: float = TOLERANCE_PCT) -> str:
    """``WORSE`` (interval entirely above ``tol`` %), ``BETTER`` (entirely below) or
    ``UNSURE`` (it straddles ``tol``, or fewer than two seeds give no interval)."""
    if iv.n < 2 or not np.isfinite(iv.half_width):
        return UNSURE
    if iv.low > tol:
        return WORSE
    if iv.high < tol:
        return BETTER
    return UNSURE


def false_worse_probability(sd: float, n: int, tol: float = TOLERANCE_PCT) -> float:
    """P(a comparison is classed ``WORSE``) when the true difference is 0, the per-seed
    differences spread with standard deviation ``sd`` (%) and ``n`` seeds are paired.

    The rule says worse when ``mean − t·S/√n > tol`` (t = t(0.975, n−1), S the sample
    standard deviation). Under the null, ``Z = √n·mean/sd`` is standard normal and
    ``W = S/sd`` independent of it with density ∝ ``w^(k−1)·exp(−k·w²/2)`` (k = n − 1;
    ``k·W²`` is χ² with k degrees of freedom), so the probability is exactly
    ``E_W[P(Z > √n·tol/sd + t·W)]`` — a noncentral-t tail — which is integrated here
    over W on a fine grid (trapezoid rule), with ``sd`` the cell's observed spread
    plugged in for the true one. 0 for ``n < 2`` or ``sd == 0``."""
    if n < 2 or not sd > 0 or not np.isfinite(sd):
        return 0.0
    k = n - 1
    t = t_quantile_975(k)
    w = np.linspace(0.0, 1.0 + 12.0 / math.sqrt(k), 1201)
    f = w ** (k - 1) * np.exp(-0.5 * k * w * w)  # unnormalised density of W (0**0 = 1)
    x = (math.sqrt(n) * tol / sd + t * w) / math.sqrt(2.0)
    tail = 0.5 * np.array([math.erfc(v) for v in x])
    f[[0, -1]] *= 0.5  # trapezoid weights on the even grid (its step cancels)
    return float((f * tail).sum() / f.sum())


def _cells(rows: list[dict]) -> dict[tuple, dict[str, dict[int, dict]]]:
    """(workload, pool, rate) -> variant -> seed number -> the grid row."""
    cells: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in rows:
        if r.get("experiment") != "grid":
            continue
        key = (r["workload"], int(r["num_decode"]), float(r["qps"]))
        cells.setdefault(key, {}).setdefault(r["variant"], {})[int(r.get("replicate", 0))] = r
    return dict(sorted(cells.items()))


def _compare(new: dict[int, dict], base: dict[int, dict], column: str) -> dict | None:
    """Paired comparison of two variants' rows of one cell on their common seeds."""
    d = [percent_change(new[j][column], base[j][column]) for j in sorted(new.keys() & base.keys())]
    d = [x for x in d if np.isfinite(x)]
    if not d:
        return None
    iv = paired_interval(d)
    sd = float(np.std(d, ddof=1)) if len(d) > 1 else float("nan")
    return {"mean": iv.mean, "half": iv.half_width, "n": iv.n, "sd": sd,
            "cls": classify(iv), "p_false": false_worse_probability(sd, iv.n)}


def comparisons(rows: list[dict], variant_of: dict[str, str]) -> list[dict]:
    """One dict per (cell, policy, balancer, metric) of the grid experiment's ``rows``.

    ``variant_of`` maps a grid policy name to its row ``variant`` (e.g. eldr's carries τ).
    Each has workload, num_decode, qps, policy, balancer, metric (``p50``/``p99``), mean
    and half (the interval mean ± half, %), n (seeds), sd (per-seed spread, %), cls (one
    of ``CLASSES``) and p_false (:func:`false_worse_probability`)."""
    out = []
    policies, balancers = grid_policies(), grid_balancers()
    for (wl, K, q), by in _cells(rows).items():
        for name in policies:
            new = by.get(variant_of.get(name, name))
            if new is None:
                continue
            for lb in balancers:
                if lb not in by:
                    continue
                for metric, column in METRICS.items():
                    c = _compare(new, by[lb], column)
                    if c is not None:
                        out.append({"workload": wl, "num_decode": K, "qps": q, "policy": name,
                                    "balancer": lb, "metric": metric, **c})
    return out


def balancer_check(rows: list[dict], pair: tuple[str, str] | None = None) -> list[dict]:
    """The rule applied to one balancer against another (both directions, both metrics):
    comparisons like :func:`comparisons`' with policy = ``pair[i]``, balancer = the other
    (default: :func:`check_pair`)."""
    pair = check_pair() if pair is None else pair
    out = []
    for (wl, K, q), by in _cells(rows).items():
        for a, b in (pair, pair[::-1]):
            if a not in by or b not in by:
                continue
            for metric, column in METRICS.items():
                c = _compare(by[a], by[b], column)
                if c is not None:
                    out.append({"workload": wl, "num_decode": K, "qps": q, "policy": a,
                                "balancer": b, "metric": metric, **c})
    return out


def cells_needing_seeds(rows: list[dict], target_half_width: float,
                        max_seeds: int) -> list[tuple[tuple[str, int, float], int]]:
    """((workload, pool, rate), seeds so far) of every grid cell whose widest interval
    (any policy, balancer, metric) is above ``target_half_width`` % and that has fewer
    than ``max_seeds`` seeds: the cells that run one more seed."""
    widest: dict[tuple, tuple[float, int]] = {}
    for c in comparisons(rows, _variants(rows)):
        key = (c["workload"], c["num_decode"], c["qps"])
        half = c["half"] if np.isfinite(c["half"]) else math.inf
        w, n = widest.get(key, (0.0, c["n"]))
        widest[key] = (max(w, half), min(n, c["n"]))
    return [(key, n) for key, (w, n) in widest.items()
            if w > target_half_width and n < max_seeds]


def _variants(rows: list[dict]) -> dict[str, str]:
    """Grid policy name -> its row variant, read from the grid rows themselves."""
    policies = grid_policies()
    return {r["policy"]: r["variant"] for r in rows
            if r.get("experiment") == "grid" and r["policy"] in policies}


def class_counts(comps: list[dict]) -> dict[str, int]:
    """How many of ``comps`` fall in each class (every class present, maybe 0)."""
    return {cls: sum(c["cls"] == cls for c in comps) for cls in CLASSES}


def _worst(comps: list[dict]) -> dict:
    """The decisive comparison: the worst class, then the largest mean."""
    return min(comps, key=lambda c: (CLASSES.index(c["cls"]), -c["mean"]))


def grid_rows(rows: list[dict], variant_of: dict[str, str]) -> list[dict]:
    """One row per (workload, pool, rate, policy): per metric the decisive comparison
    (against the balancer that gives the worst class, then the largest Δ) as
    d_p50 / h_p50 / lb_p50 / cls_p50 (and p99), the cell's class ``cls`` (the worse of
    the two), its seeds ``n``, and ``ok`` (no comparison classed worse)."""
    by_cell: dict[tuple, list[dict]] = {}
    for c in comparisons(rows, variant_of):
        by_cell.setdefault((c["workload"], c["num_decode"], c["qps"], c["policy"]),
                           []).append(c)
    out = []
    for (wl, K, q, name), comps in by_cell.items():
        row = {"workload": wl, "num_decode": K, "qps": q, "policy": name,
               "n": min(c["n"] for c in comps)}
        for metric in METRICS:
            w = _worst([c for c in comps if c["metric"] == metric])
            row.update({f"d_{metric}": w["mean"], f"h_{metric}": w["half"],
                        f"lb_{metric}": w["balancer"], f"cls_{metric}": w["cls"]})
        row["cls"] = _worst(comps)["cls"]
        row["ok"] = row["cls"] != WORSE
        out.append(row)
    return out


def _pm(mean: float, half: float) -> str:
    if not np.isfinite(mean):
        return "n/a"
    return f"{mean:+.1f}" if not np.isfinite(half) else f"{mean:+.1f}±{half:.1f}"


def _mark(text: str, cls: str) -> str:
    return f"**{text}**" if cls == WORSE else f"_{text}_" if cls == UNSURE else text


def grid_table(rows: list[dict], comps: list[dict], check: list[dict] = ()) -> str:
    """Markdown: the class counts per policy and balancer with the rule's expected false
    "worse" comparisons, the balancer-pair check, then per workload rates down, pools
    across, cells ``policy · policy`` (:func:`~eldr.reproduce.plan.grid_policies`) as
    ``Δp50±h/Δp99±h [seeds]`` against the decisive balancer (%; **bold** = worse,
    _italic_ = not distinguishable)."""
    if not rows:
        return "(no grid rows)\n"
    policies = grid_policies()
    md = [_counts_table(comps), ""]
    if check:
        md += [_check_line(check), ""]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        sub = [r for r in rows if r["workload"] == wl]
        pools = sorted({r["num_decode"] for r in sub})
        idx = {(r["num_decode"], r["qps"], r["policy"]): r for r in sub}
        md.append(f"**{wl}** — Δ median / Δ p99 TPOT ± 95 % half-width vs the decisive "
                  f"load balancer (%) [seeds], "
                  f"{' · '.join(f'`{p}`' for p in policies)}\n")
        md.append("| req/s | " + " | ".join(f"{K} decoders" for K in pools) + " |")
        md.append("|---|" + "---|" * len(pools))
        for q in sorted({r["qps"] for r in sub}):
            cells = []
            for K in pools:
                parts = []
                for name in policies:
                    r = idx.get((K, q, name))
                    if r is None:
                        parts.append("–")
                        continue
                    parts.append(f"{_mark(_pm(r['d_p50'], r['h_p50']), r['cls_p50'])}/"
                                 f"{_mark(_pm(r['d_p99'], r['h_p99']), r['cls_p99'])}")
                n = max((idx[(K, q, p)]["n"] for p in policies if (K, q, p) in idx),
                        default=0)
                cells.append(" · ".join(parts) + f" [{n}]")
            md.append(f"| {q:g} | " + " | ".join(cells) + " |")
        md.append("")
    return "\n".join(md) + "\n"


def _counts_table(comps: list[dict]) -> str:
    head = ("| policy | vs | median TPOT: worse / not dist. / better | p99 TPOT: worse / "
            "not dist. / better | cells worse on either | expected false \"worse\" |")
    md = [head, "|---|---|---|---|---|---|"]
    for name in grid_policies():
        mine = [c for c in comps if c["policy"] == name]
        for lb in (*grid_balancers(), "any"):
            sub = mine if lb == "any" else [c for c in mine if c["balancer"] == lb]
            if not sub:
                continue
            cols = []
            for metric in METRICS:
                k = class_counts([c for c in sub if c["metric"] == metric])
                cols.append(" / ".join(str(k[cls]) for cls in CLASSES))
            cells = {(c["workload"], c["num_decode"], c["qps"]) for c in sub}
            bad = {(c["workload"], c["num_decode"], c["qps"]) for c in sub
                   if c["cls"] == WORSE}
            fp = sum(c["p_false"] for c in sub)
            md.append(f"| `{name}` | {'any balancer' if lb == 'any' else lb} | "
                      f"{cols[0]} | {cols[1]} | {len(bad)} of {len(cells)} | "
                      f"{fp:.2f} of {len(sub)} |")
    return "\n".join(md)


def _check_line(check: list[dict]) -> str:
    a, b = check_pair()
    parts = []
    for x, y in ((a, b), (b, a)):
        sub = [c for c in check if c["policy"] == x]
        k = class_counts(sub)
        parts.append(f"`{x}` vs `{y}`: {k[WORSE]} worse, {k[UNSURE]} not distinguishable, "
                     f"{k[BETTER]} better or equal of {len(sub)} (expected false "
                     f"\"worse\" {sum(c['p_false'] for c in sub):.2f})")
    return ("Check, two load balancers through the same rule (both metrics): "
            + "; ".join(parts) + ".")
