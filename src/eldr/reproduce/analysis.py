"""Lookups and derived tables over the rows of :func:`eldr.reproduce.sweeps.run_plan`
(split out of :mod:`eldr.reproduce.report`, which writes them out).

Every comparison is ELDR against the BEST load balancer (lowest median TPOT among the
report's balancers, :func:`eldr.reproduce.plan.load_balancers`) of the same (workload,
rate, pool size): Δ% = 100 · (ELDR −
best) / best, negative = ELDR faster. The headline's points run ``plan.main_seeds`` seeds:
there the best balancer is the one with the lowest mean median TPOT over the seeds, and
each Δ is the mean of per-seed paired differences against it with a 95 % interval
(``*_h``: its half-width; nan with one seed). The other tables read seed number 0.

The policies and the names of their columns come from the registry's report roles
(:class:`eldr.routing.ReportRole`): the band's columns are ``eldr_*`` and the
unprefixed ``d_*``; each other policy's are prefixed with its role's ``key``
(``cost_d_p50``, ``domain_d_p50``).
"""

from __future__ import annotations

import numpy as np

from eldr.intervals import paired_interval, percent_change
from eldr.reproduce.plan import band, load_balancers, other_locality
from eldr.reproduce.sweeps import Results
from eldr.routing.registry import POLICIES, report_flagged, report_policies

__all__ = ["Analysis"]


def _mean(rows_by_seed: dict[int, dict], column: str) -> float:
    """Mean of ``column`` over a point's seeds (nan when it did not run)."""
    if not rows_by_seed:
        return float("nan")
    return float(np.mean([r[column] for r in rows_by_seed.values()]))


class Analysis:
    """Lookups over the rows: (workload, qps, K, variant) → row (any experiment)."""

    def __init__(self, results: Results) -> None:
        self.results = results
        self.plan = results.plan
        self.index: dict[tuple, dict] = {}
        # (experiment, workload, qps, K, variant) -> seed number -> row
        self.seeds: dict[tuple, dict[int, dict]] = {}
        for r in results.rows:
            key = (r["workload"], float(r["qps"]), int(r["num_decode"]), r["variant"])
            if int(r.get("replicate", 0)) == 0:
                self.index.setdefault(key, r)
            self.seeds.setdefault((r["experiment"], *key), {})[int(r.get("replicate", 0))] = r

    def get(self, wl: str, qps: float, K: int, variant: str) -> dict | None:
        return self.index.get((wl, float(qps), int(K), variant))

    def variant(self, name: str, tau: float | None = None, kind: str = "balanced") -> str:
        """The row variant of policy ``name`` (τ: the plan's unless given)."""
        return POLICIES[name].variant(tau=self.plan.tau if tau is None else tau, kind=kind)

    def eldr(self, tau: float | None = None, kind: str = "balanced") -> str:
        """The band's row variant (:func:`eldr.reproduce.plan.band`)."""
        return self.variant(band(), tau, kind)

    def best_lb(self, wl: str, qps: float, K: int) -> dict | None:
        rows = [self.get(wl, qps, K, p) for p in load_balancers()]
        rows = [r for r in rows if r is not None]
        return min(rows, key=lambda r: r["tpot_median_ms"]) if rows else None

    def main_seeds(self, wl: str, qps: float, K: int, variant: str) -> dict[int, dict]:
        """Seed number -> row of one main-experiment point (empty when it did not run)."""
        return self.seeds.get(("main", wl, float(qps), int(K), variant), {})

    def best_lb_mean(self, wl: str, qps: float, K: int) -> str | None:
        """The load balancer with the lowest median TPOT averaged over a main point's
        seeds (the headline's reference)."""
        means = {p: np.mean([r["tpot_median_ms"] for r in rs.values()])
                 for p in load_balancers() if (rs := self.main_seeds(wl, qps, K, p))}
        return min(means, key=means.get) if means else None

    def paired(self, wl: str, qps: float, K: int, variant: str, base: str,
               column: str) -> tuple[float, float]:
        """(mean, 95 % half-width) of the per-seed % differences of ``column`` between two
        variants of a main point, paired on their common seeds; (nan, nan) when either is
        missing, half-width nan with one seed."""
        a, b = self.main_seeds(wl, qps, K, variant), self.main_seeds(wl, qps, K, base)
        d = [percent_change(a[j][column], b[j][column]) for j in sorted(a.keys() & b.keys())]
        d = [x for x in d if np.isfinite(x)]
        if not d:
            return float("nan"), float("nan")
        iv = paired_interval(d)
        return iv.mean, iv.half_width

    def headline_columns(self) -> list[tuple[str, str, str]]:
        """(results.json key, row variant, table label) of every policy the headline shows
        beside the band: the other locality policies and their online variants, in report
        order."""
        out = []
        for p in other_locality():
            role = POLICIES[p].report
            out.append((role.key, self.variant(p), role.label))
            if role.online_key is not None:
                online = self.variant(p, kind="online")
                out.append((role.online_key, online, online))
        return out

    def headline(self) -> list[dict]:
        """Per workload × rate at 8P16D: the band, the oracles and the other locality
        policies vs the best LB, each Δ (``d_*``) with its half-width (``d_*_h``)."""
        out = []
        K = self.plan.num_decode
        for wl in self.plan.workloads:
            for q in self.plan.rates:
                lb = self.best_lb_mean(wl, q, K)
                e = self.main_seeds(wl, q, K, self.eldr())
                if lb is None or not e:
                    continue
                out.append(self._headline_point(wl, q, K, lb, e))
        return out

    def _headline_point(self, wl: str, q: float, K: int, lb: str,
                        e: dict[int, dict]) -> dict:
        b = self.main_seeds(wl, q, K, lb)
        pk = POLICIES[band()].report.key
        h = {"workload": wl, "qps": q, "best_lb": lb, "seeds": len(e),
             "lb_tpot_p50": _mean(b, "tpot_median_ms"),
             f"{pk}_tpot_p50": _mean(e, "tpot_median_ms"),
             "lb_tpot_p99": _mean(b, "tpot_p99_ms"),
             f"{pk}_tpot_p99": _mean(e, "tpot_p99_ms"),
             "lb_distinct": _mean(b, "mean_distinct_per_layer"),
             f"{pk}_distinct": _mean(e, "mean_distinct_per_layer"),
             "lb_batch": _mean(b, "mean_batch")}
        pairs = [("d_p50", self.eldr(), lb, "tpot_median_ms"),
                 ("d_p99", self.eldr(), lb, "tpot_p99_ms"),
                 ("d_ttft", self.eldr(), lb, "ttft_median_ms")]
        for p in report_policies("oracle"):
            key = POLICIES[p].report.key
            pairs += [(f"{key}_d_p50", self.variant(p), lb, "tpot_median_ms"),
                      (f"{key}_d_p99", self.variant(p), lb, "tpot_p99_ms")]
        # the paper's vanilla-vs-balanced baseline (round robin)
        pairs.append((f"{pk}_vs_rr_p50", self.eldr(), report_flagged("paper_baseline")[0],
                      "tpot_median_ms"))
        for name, variant, base, column in pairs:
            h[name], h[f"{name}_h"] = self.paired(wl, q, K, variant, base, column)
        for key, variant, _ in self.headline_columns():
            c = self.main_seeds(wl, q, K, variant)
            h[f"{key}_tpot_p50"] = _mean(c, "tpot_median_ms")
            h[f"{key}_tpot_p99"] = _mean(c, "tpot_p99_ms")
            h[f"{key}_distinct"] = _mean(c, "mean_distinct_per_layer")
            for m, column in (("p50", "tpot_median_ms"), ("p99", "tpot_p99_ms")):
                name = f"{key}_d_{m}"
                h[name], h[f"{name}_h"] = self.paired(wl, q, K, variant, lb, column)
        return h

    def tiny_rows(self) -> list[dict]:
        """The shipped tiny-MoE trace on its measured CPU preset: every policy vs the best
        load balancer per rate (each metric against its own best)."""
        out = []
        plan = self.plan
        for q in plan.tiny_rates:
            rows = {r["variant"]: r for r in self.results.rows
                    if r["experiment"] == "tiny" and float(r["qps"]) == float(q)}
            lbs = [rows[p] for p in load_balancers() if p in rows]
            if not lbs:
                continue
            b50 = min(lbs, key=lambda r: r["tpot_median_ms"])
            b99 = min(lbs, key=lambda r: r["tpot_p99_ms"])
            row = {"qps": q, "best_lb": b50["policy"], "lb_p50": b50["tpot_median_ms"],
                   "lb_p99": b99["tpot_p99_ms"], "batch": b50["mean_batch"]}
            for name, variant in self._locality_columns():
                r = rows.get(variant)
                row[f"{name}_d_p50"] = percent_change(r["tpot_median_ms"], b50["tpot_median_ms"]) \
                    if r else float("nan")
                row[f"{name}_d_p99"] = percent_change(r["tpot_p99_ms"], b99["tpot_p99_ms"]) \
                    if r else float("nan")
                row[f"{name}_distinct"] = r["mean_distinct_per_layer"] if r else float("nan")
            row["lb_distinct"] = b50["mean_distinct_per_layer"]
            out.append(row)
        return out

    def _locality_columns(self) -> list[tuple[str, str]]:
        """(key, row variant) of the band and every other locality policy."""
        return [(POLICIES[band()].report.key, self.eldr()),
                *((POLICIES[p].report.key, self.variant(p)) for p in other_locality())]

    def tau_rows(self) -> list[dict]:
        wl, q, K = self.plan.workloads[0], self.plan.tau_rate, self.plan.num_decode
        b = self.best_lb(wl, q, K)
        out = []
        for tau in self.plan.tau_values:
            e = self.get(wl, q, K, self.eldr(tau))
            if e is None or b is None:
                continue
            out.append({"tau": tau, "tpot_p50": e["tpot_median_ms"], "tpot_p99": e["tpot_p99_ms"],
                        "d_p50": percent_change(e["tpot_median_ms"], b["tpot_median_ms"]),
                        "d_p99": percent_change(e["tpot_p99_ms"], b["tpot_p99_ms"]),
                        "distinct": e["mean_distinct_per_layer"],
                        "max_share": e["max_request_share"]})
        return out

    def pool_rows(self) -> list[dict]:
        wl = self.plan.workloads[0]
        out = []
        others = [(POLICIES[p].report.key, self.variant(p)) for p in other_locality()]
        for K in self.plan.pool_sizes:
            d50, d99 = [], []
            o50: dict[str, list] = {k: [] for k, _ in others}
            o99: dict[str, list] = {k: [] for k, _ in others}
            for q in self.plan.pool_rates:
                b, e = self.best_lb(wl, q, K), self.get(wl, q, K, self.eldr())
                if b is None or e is None:
                    continue
                d50.append(percent_change(e["tpot_median_ms"], b["tpot_median_ms"]))
                d99.append(percent_change(e["tpot_p99_ms"], b["tpot_p99_ms"]))
                for key, variant in others:
                    c = self.get(wl, q, K, variant)
                    if c is not None:
                        o50[key].append(percent_change(c["tpot_median_ms"],
                                                       b["tpot_median_ms"]))
                        o99[key].append(percent_change(c["tpot_p99_ms"], b["tpot_p99_ms"]))
            if d50:
                row = {"pool": f"{self.plan.num_prefill}P{K}D", "K": K,
                       "d_p50": float(np.mean(d50)), "d_p99": float(np.mean(d99))}
                for key, _ in others:
                    row[f"{key}_d_p50"] = float(np.mean(o50[key])) if o50[key] else float("nan")
                    row[f"{key}_d_p99"] = float(np.mean(o99[key])) if o99[key] else float("nan")
                out.append({**row, "rates": len(d50)})
        return out

    def vanilla_rows(self) -> list[dict]:
        K = self.plan.num_decode
        out = []
        for wl in self.plan.workloads:
            for kind in ("balanced", "vanilla"):
                d50, d99 = [], []
                for q in self.plan.rates:
                    rr = self.get(wl, q, K, report_flagged("paper_baseline")[0])
                    e = self.get(wl, q, K, self.eldr(kind=kind))
                    if rr is None or e is None:
                        continue
                    d50.append(percent_change(e["tpot_median_ms"], rr["tpot_median_ms"]))
                    d99.append(percent_change(e["tpot_p99_ms"], rr["tpot_p99_ms"]))
                if d50:
                    sizes = self.results.setups[wl].cluster_sizes(K, kind) \
                        if wl in self.results.setups else np.array([np.nan])
                    out.append({"workload": wl, "kind": kind, "d_p50": float(np.mean(d50)),
                                "d_p99": float(np.mean(d99)),
                                "cluster_max": int(sizes.max()), "cluster_min": int(sizes.min())})
        return out


    def prefix_rows(self) -> list[dict]:
        """Prefix caching on (task, tau_rate): ELDR via the signature cache vs fresh counts."""
        key, q, K = f"{self.plan.workloads[0]}+topk", self.plan.tau_rate, self.plan.num_decode
        lbs = [self.get(key, q, K, f"{p}+prefix[trace]") for p in load_balancers()]
        lbs = [r for r in lbs if r is not None]
        if not lbs:
            return []
        b = min(lbs, key=lambda r: r["tpot_median_ms"])
        out = [{"variant": f"best LB ({b['policy']})", "row": b}]
        for src in ("sigcache", "fresh"):
            e = self.get(key, q, K, f"{self.eldr()}+prefix[{src}]")
            if e is not None:
                out.append({"variant": f"{band()}, signatures {src}", "row": e})
        for o in out:
            r = o["row"]
            o.update(tpot_p50=r["tpot_median_ms"], tpot_p99=r["tpot_p99_ms"],
                     d_p50=percent_change(r["tpot_median_ms"], b["tpot_median_ms"]),
                     d_p99=percent_change(r["tpot_p99_ms"], b["tpot_p99_ms"]),
                     exact=r.get("signature_exact_share", float("nan")),
                     hits=r.get("prefix_hit_share", float("nan")))
            del o["row"]
        return out

    def ep_rows(self) -> list[dict]:
        """Qwen3-235B TP4/EP4: ELDR under each EP layout vs the best LB (any layout)."""
        p = self.plan
        key, K = f"{p.workloads[0]}@{p.ep_model}", p.ep_num_decode
        out = []
        for q in p.ep_rates:
            lbs = [self.get(key, q, K, f"{lb}+ep[{lay}]") for lb in load_balancers()
                   for lay in ("contiguous", "global")]
            lbs = [r for r in lbs if r is not None]
            if not lbs:
                continue
            b = min(lbs, key=lambda r: r["tpot_median_ms"])
            row = {"qps": q, "best_lb": b["variant"], "lb_p50": b["tpot_median_ms"],
                   "lb_p99": b["tpot_p99_ms"]}
            for lay in ("contiguous", "global", "per_decoder"):
                e = self.get(key, q, K, f"{self.eldr()}+ep[{lay}]")
                row[f"{lay}_p50"] = percent_change(e["tpot_median_ms"], b["tpot_median_ms"]) if e \
                    else float("nan")
                row[f"{lay}_p99"] = percent_change(e["tpot_p99_ms"], b["tpot_p99_ms"]) if e \
                    else float("nan")
            out.append(row)
        return out
