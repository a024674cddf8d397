"""PNG plots of the reproduction report (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr.reproduce.analysis import Analysis
from eldr.reproduce.grid import CLASSES, TOLERANCE_PCT
from eldr.reproduce.plan import band, grid_policies
from eldr.routing.registry import POLICIES

__all__ = ["plot_bars", "plot_decoders", "plot_grid", "plot_intervals", "plot_main", "pyplot",
           "require_matplotlib"]

MISSING = "the report's plots need matplotlib: pip install 'eldr[report]' (scripts/setup.sh does)"


def require_matplotlib() -> None:
    """Raise ``ValueError`` naming the ``report`` extra when matplotlib is not installed
    (checked before a long run, not after it)."""
    from importlib.util import find_spec

    if find_spec("matplotlib") is None:
        raise ValueError(MISSING)


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (imported here, on first use)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# line colours of the locality policies besides the band, in report order
OTHER_LOCALITY_COLOURS = ("tab:green", "tab:olive", "tab:cyan", "tab:pink")


def _main_style(name: str, others: list[str]) -> dict:
    """The band in black on top; other locality policies thick and coloured; an oracle on
    the true decode pattern dashed (the bound, it often coincides with the band)."""
    spec = POLICIES[name]
    if name == band():
        return {"lw": 2.5, "color": "black", "zorder": 5}
    if spec.role == "locality":
        return {"lw": 2.5, "zorder": 5,
                "color": OTHER_LOCALITY_COLOURS[others.index(name)
                                                % len(OTHER_LOCALITY_COLOURS)]}
    if spec.reads_true_decode:
        return {"ls": "--", "color": "gray", "zorder": 6}
    return {}


def plot_main(an: Analysis, wl: str, path: Path) -> None:
    """Median and p99 TPOT and median TTFT against the rate, one line per headline policy
    (the plan's, in report order; labelled by policy name)."""
    plt = pyplot()
    K = an.plan.num_decode
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = an.plan.headline_policies()
    others = [p for p in names if POLICIES[p].role == "locality" and p != band()]
    for name in names:
        v = an.variant(name)
        pts = [(q, an.get(wl, q, K, v)) for q in an.plan.rates]
        pts = [(q, r) for q, r in pts if r is not None]
        if not pts:
            continue
        qs = [q for q, _ in pts]
        style = _main_style(name, others)
        for ax, key in zip(axes, ("tpot_median_ms", "tpot_p99_ms", "ttft_median_ms"),
                           strict=True):
            ax.plot(qs, [r[key] for _, r in pts], marker="o", label=name, **style)
    for ax, title in zip(axes, ("median TPOT (ms)", "p99 TPOT (ms)", "median TTFT (ms)"),
                         strict=True):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{wl} workload, {an.plan.num_prefill}P{K}D, {an.plan.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(labels, series: dict[str, list[float]], title: str, ylabel: str,
               path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(labels))
    w = 0.8 / max(len(series), 1)
    for j, (name, vals) in enumerate(series.items()):
        ax.bar(x + j * w - 0.4 + w / 2, vals, w, label=name)
    ax.set_xticks(x, [str(v) for v in labels])
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    # below the axes: bars may fill the whole plot (and go negative), so no corner is free
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              ncol=max(len(series), 1), frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_intervals(labels, series: dict[str, list[tuple[float, float]]], title: str,
                   ylabel: str, path: Path) -> None:
    """Grouped bars of means with 95 % error bars: ``series[name][i]`` = (mean, half-width)
    at ``labels[i]`` (nan: no bar; a nan half-width: no error bar)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels) + 2), 4))
    x = np.arange(len(labels))
    w = 0.8 / max(len(series), 1)
    for j, (name, vals) in enumerate(series.items()):
        mean = np.array([v[0] for v in vals], dtype=float)
        half = np.array([v[1] for v in vals], dtype=float)
        ax.bar(x + j * w - 0.4 + w / 2, mean, w, label=name,
               yerr=np.where(np.isfinite(half), half, 0.0), capsize=3)
    ax.set_xticks(x, [str(v) for v in labels], fontsize=8)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14),
              ncol=max(len(series), 1), frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decoders(an: Analysis, path: Path) -> list[dict]:
    """Distinct experts per decoder, ELDR vs the best LB, first workload at tau_rate."""
    wl, q, K = an.plan.workloads[0], an.plan.tau_rate, an.plan.num_decode
    b = an.best_lb(wl, q, K)
    rows = an.results.decoder_rows
    want = {an.eldr(): band(), (b["policy"] if b else None): "best LB"}
    series, table = {}, []
    for v, label in want.items():
        sel = [r for r in rows if r["workload"] == wl and r["variant"] == v
               and float(r["qps"]) == float(q)]
        if sel:
            series[f"{label} ({v.split('[')[0]})"] = [r["mean_distinct_per_layer"] for r in sel]
            table += sel
    if series:
        plot_bars(list(range(K)), series, f"distinct experts per layer per step, {wl}, "
                   f"{q:g} req/s", "mean distinct experts / layer / step", path)
    return table


# the grid's classes (eldr.reproduce.grid.CLASSES: worse, not distinguishable, better)
CLASS_COLOURS = ("#d7301f", "#bdbdbd", "#2b8cbe")


def plot_grid(rows: list[dict], path: Path) -> None:
    """Heat maps of :func:`eldr.reproduce.grid.grid_rows`: one column per policy, one row
    per workload; a cell's colour is its class against the load balancers (worse: some
    interval entirely above the tolerance; better or equal: all entirely below; not
    distinguishable otherwise), its text the decisive Δ median / Δ p99 (%)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plt = pyplot()
    wls = list(dict.fromkeys(r["workload"] for r in rows))
    pols = [p for p in grid_policies() if any(r["policy"] == p for r in rows)]
    if not wls or not pols:
        return
    fig, axes = plt.subplots(len(wls), len(pols), figsize=(4.2 * len(pols), 2.8 * len(wls) + 0.6),
                             squeeze=False, layout="constrained")
    cmap = ListedColormap(CLASS_COLOURS)
    for i, wl in enumerate(wls):
        sub = [r for r in rows if r["workload"] == wl]
        pools = sorted({r["num_decode"] for r in sub})
        rates = sorted({r["qps"] for r in sub})
        for j, name in enumerate(pols):
            ax = axes[i][j]
            m = np.full((len(rates), len(pools)), np.nan)
            for r in sub:
                if r["policy"] != name:
                    continue
                a, b = rates.index(r["qps"]), pools.index(r["num_decode"])
                m[a, b] = CLASSES.index(r["cls"])
                ax.text(b, a, f"{r['d_p50']:+.1f}\n{r['d_p99']:+.1f}", ha="center",
                        va="center", fontsize=6.5)
            ax.imshow(m, cmap=cmap, vmin=-0.5, vmax=len(CLASSES) - 0.5, aspect="auto",
                      origin="lower")
            ax.set_xticks(range(len(pools)), [str(k) for k in pools])
            ax.set_yticks(range(len(rates)), [f"{q:g}" for q in rates])
            ax.set_title(f"{name} · {wl}", fontsize=9)
            if i == len(wls) - 1:
                ax.set_xlabel("decode workers")
            if j == 0:
                ax.set_ylabel("req/s")
    fig.legend(handles=[Patch(color=c, label=cls) for c, cls in zip(CLASS_COLOURS, CLASSES,
                                                                     strict=True)],
               loc="outside lower center", ncol=len(CLASSES), fontsize=8, frameon=False,
               title=f"vs each load balancer, 95 % intervals against +{TOLERANCE_PCT:g}% "
               "(text: decisive Δ median / Δ p99, %)", title_fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
