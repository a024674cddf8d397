"""The "never worse than load balancing" grid: every (workload, decode pool, rate) cell.

For each cell the decode-routing policies that use expert locality (``eldr``, the band;
``eldr_cost``, the marginal expert cost) are compared with the BEST load balancer of the
same cell, separately per metric: Δp50 against the lowest median TPOT of
``GRID_BALANCERS``, Δp99 against the lowest p99. A policy "never loses" when both stay
within ``TOLERANCE_PCT`` in every cell. Cells use short windows (the plan's
``grid_warmup_s`` + ``grid_duration_s``), the same arrivals and tokens for every policy.
``GRID_BALANCERS`` and ``GRID_POLICIES`` are :mod:`eldr.reproduce.plan`'s, whose tasks
run the cells.

Workloads: the synthetic ``task`` and ``language`` (Poisson arrivals) and the real
``azure_conv`` and ``mooncake_conv`` traces (their own arrival times scaled to each rate,
bursts kept, and their prompt/output lengths; expert routing drawn for those lengths).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr.reproduce.plan import GRID_BALANCERS, GRID_POLICIES
from eldr.reproduce.plots import pyplot

__all__ = ["TOLERANCE_PCT", "grid_rows", "grid_table", "plot_grid"]

TOLERANCE_PCT = 1.0  # "never worse": within +1% of the best load balancer


def _pct(new: float, base: float) -> float:
    return 100.0 * (new - base) / base if base and np.isfinite(base) else float("nan")


def grid_rows(rows: list[dict], variant_of: dict[str, str]) -> list[dict]:
    """One row per (workload, pool, rate, policy) of the grid experiment's ``rows``.

    ``variant_of`` maps a grid policy name to its row ``variant`` (e.g. eldr's carries τ).
    Returns dicts with workload, num_decode, qps, policy, tpot_p50/p99 (ms), the best
    balancers' names and values, d_p50 / d_p99 (%), and ``ok`` (both within tolerance).
    """
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r.get("experiment") != "grid":
            continue
        key = (r["workload"], int(r["num_decode"]), float(r["qps"]))
        cells.setdefault(key, {})[r["variant"]] = r
    out = []
    for (wl, K, q), by in sorted(cells.items()):
        lbs = [by[p] for p in GRID_BALANCERS if p in by]
        if not lbs:
            continue
        b50 = min(lbs, key=lambda r: r["tpot_median_ms"])
        b99 = min(lbs, key=lambda r: r["tpot_p99_ms"])
        for name in GRID_POLICIES:
            r = by.get(variant_of.get(name, name))
            if r is None:
                continue
            d50 = _pct(r["tpot_median_ms"], b50["tpot_median_ms"])
            d99 = _pct(r["tpot_p99_ms"], b99["tpot_p99_ms"])
            out.append({
                "workload": wl, "num_decode": K, "qps": q, "policy": name,
                "tpot_p50_ms": r["tpot_median_ms"], "tpot_p99_ms": r["tpot_p99_ms"],
                "best_p50_lb": b50["policy"], "best_p50_ms": b50["tpot_median_ms"],
                "best_p99_lb": b99["policy"], "best_p99_ms": b99["tpot_p99_ms"],
                "d_p50": d50, "d_p99": d99,
                "ok": bool(d50 <= TOLERANCE_PCT and d99 <= TOLERANCE_PCT),
            })
    return out


def _s(x: float) -> str:
    return "n/a" if not np.isfinite(x) else f"{x:+.1f}"


def grid_table(rows: list[dict]) -> str:
    """Markdown: per workload, rates down, pools across, cells ``eldr | eldr_cost`` as
    ``Δp50/Δp99`` (%; negative = faster than the best balancer; bold = over tolerance)."""
    if not rows:
        return "(no grid rows)\n"
    md = []
    wls = sorted({r["workload"] for r in rows}, key=lambda w: [r["workload"] for r in rows]
                 .index(w))
    for wl in wls:
        sub = [r for r in rows if r["workload"] == wl]
        pools = sorted({r["num_decode"] for r in sub})
        rates = sorted({r["qps"] for r in sub})
        idx = {(r["num_decode"], r["qps"], r["policy"]): r for r in sub}
        md.append(f"**{wl}** — Δ median / Δ p99 TPOT vs the best load balancer (%), "
                  f"`eldr` · `eldr_cost`\n")
        md.append("| req/s | " + " | ".join(f"{K} decoders" for K in pools) + " |")
        md.append("|---|" + "---|" * len(pools))
        for q in rates:
            cells = []
            for K in pools:
                parts = []
                for name in GRID_POLICIES:
                    r = idx.get((K, q, name))
                    if r is None:
                        parts.append("–")
                        continue
                    t = f"{_s(r['d_p50'])}/{_s(r['d_p99'])}"
                    parts.append(t if r["ok"] else f"**{t}**")
                cells.append(" · ".join(parts))
            md.append(f"| {q:g} | " + " | ".join(cells) + " |")
        md.append("")
    for name in GRID_POLICIES:
        sub = [r for r in rows if r["policy"] == name]
        if not sub:
            continue
        bad = [r for r in sub if not r["ok"]]
        worst50 = max(r["d_p50"] for r in sub)
        worst99 = max(r["d_p99"] for r in sub)
        md.append(f"- `{name}`: {len(sub) - len(bad)} of {len(sub)} cells within "
                  f"+{TOLERANCE_PCT:g}% on both; worst Δp50 {worst50:+.1f}%, worst Δp99 "
                  f"{worst99:+.1f}%.")
    return "\n".join(md) + "\n"


def plot_grid(rows: list[dict], path: Path) -> None:
    """Heat maps: one column per policy, one row per workload; cell colour = the worse of
    Δp50 and Δp99 (%), red above 0 (worse than the best balancer), blue below."""
    plt = pyplot()
    wls = list(dict.fromkeys(r["workload"] for r in rows))
    pols = [p for p in GRID_POLICIES if any(r["policy"] == p for r in rows)]
    if not wls or not pols:
        return
    fig, axes = plt.subplots(len(wls), len(pols), figsize=(4.2 * len(pols), 2.6 * len(wls)),
                             squeeze=False)
    lim = max(5.0, max(abs(max(r["d_p50"], r["d_p99"])) for r in rows
                       if np.isfinite(r["d_p50"]) and np.isfinite(r["d_p99"])))
    for i, wl in enumerate(wls):
        sub = [r for r in rows if r["workload"] == wl]
        pools = sorted({r["num_decode"] for r in sub})
        rates = sorted({r["qps"] for r in sub})
        for j, name in enumerate(pols):
            ax = axes[i][j]
            m = np.full((len(rates), len(pools)), np.nan)
            for r in sub:
                if r["policy"] == name:
                    m[rates.index(r["qps"]), pools.index(r["num_decode"])] = max(r["d_p50"],
                                                                                 r["d_p99"])
            im = ax.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto",
                           origin="lower")
            for a in range(len(rates)):
                for b in range(len(pools)):
                    if np.isfinite(m[a, b]):
                        ax.text(b, a, f"{m[a, b]:+.1f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(pools)), [str(k) for k in pools])
            ax.set_yticks(range(len(rates)), [f"{q:g}" for q in rates])
            ax.set_title(f"{name} · {wl}", fontsize=9)
            if i == len(wls) - 1:
                ax.set_xlabel("decode workers")
            if j == 0:
                ax.set_ylabel("req/s")
    fig.colorbar(im, ax=axes, shrink=0.6, label="worse of Δp50, Δp99 vs best LB (%)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
