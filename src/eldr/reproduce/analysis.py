"""Lookups and derived tables over the rows of :func:`eldr.reproduce.sweeps.run_plan`
(split out of :mod:`eldr.reproduce.report`, which writes them out).

Every comparison is ELDR against the BEST load balancer (lowest median TPOT among random,
round_robin, jsq and p2c) of the same (workload, rate, pool size): Δ% = 100 · (ELDR −
best) / best, negative = ELDR faster.
"""

from __future__ import annotations

import numpy as np

from eldr.reproduce.plan import LOAD_BALANCERS
from eldr.reproduce.sweeps import Results
from eldr.routing.registry import POLICIES

__all__ = ["Analysis"]


def _pct(new: float, base: float) -> float:
    return 100.0 * (new - base) / base if base and np.isfinite(base) else float("nan")


class Analysis:
    """Lookups over the rows: (workload, qps, K, variant) → row (any experiment)."""

    def __init__(self, results: Results) -> None:
        self.results = results
        self.plan = results.plan
        self.index: dict[tuple, dict] = {}
        for r in results.rows:
            key = (r["workload"], float(r["qps"]), int(r["num_decode"]), r["variant"])
            self.index.setdefault(key, r)

    def get(self, wl: str, qps: float, K: int, variant: str) -> dict | None:
        return self.index.get((wl, float(qps), int(K), variant))

    def eldr(self, tau: float | None = None, kind: str = "balanced") -> str:
        return POLICIES["eldr"].variant(tau=self.plan.tau if tau is None else tau, kind=kind)

    def oracle(self) -> str:
        return POLICIES["oracle_signature"].variant(tau=self.plan.tau)

    def best_lb(self, wl: str, qps: float, K: int) -> dict | None:
        rows = [self.get(wl, qps, K, p) for p in LOAD_BALANCERS]
        rows = [r for r in rows if r is not None]
        return min(rows, key=lambda r: r["tpot_median_ms"]) if rows else None

    def headline(self) -> list[dict]:
        """Per workload × rate at 8P16D: ELDR, Domain and the oracle vs the best LB."""
        out = []
        K = self.plan.num_decode
        for wl in self.plan.workloads:
            for q in self.plan.rates:
                b = self.best_lb(wl, q, K)
                e = self.get(wl, q, K, self.eldr())
                if b is None or e is None:
                    continue
                d = self.get(wl, q, K, "domain")
                o = self.get(wl, q, K, self.oracle())
                rr = self.get(wl, q, K, "round_robin")
                out.append({
                    "workload": wl, "qps": q, "best_lb": b["policy"],
                    "lb_tpot_p50": b["tpot_median_ms"], "eldr_tpot_p50": e["tpot_median_ms"],
                    "d_p50": _pct(e["tpot_median_ms"], b["tpot_median_ms"]),
                    "lb_tpot_p99": b["tpot_p99_ms"], "eldr_tpot_p99": e["tpot_p99_ms"],
                    "d_p99": _pct(e["tpot_p99_ms"], b["tpot_p99_ms"]),
                    "d_ttft": _pct(e["ttft_median_ms"], b["ttft_median_ms"]),
                    "domain_d_p50": _pct(d["tpot_median_ms"], b["tpot_median_ms"]) if d
                    else float("nan"),
                    "domain_d_p99": _pct(d["tpot_p99_ms"], b["tpot_p99_ms"]) if d
                    else float("nan"),
                    "oracle_d_p50": _pct(o["tpot_median_ms"], b["tpot_median_ms"]) if o
                    else float("nan"),
                    "eldr_vs_rr_p50": _pct(e["tpot_median_ms"], rr["tpot_median_ms"]) if rr
                    else float("nan"),
                    "lb_distinct": b["mean_distinct_per_layer"],
                    "eldr_distinct": e["mean_distinct_per_layer"],
                    "lb_batch": b["mean_batch"],
                    **self._cost_cells(wl, q, K, b),
                })
        return out

    def best_lb_p99(self, wl: str, qps: float, K: int) -> dict | None:
        rows = [self.get(wl, qps, K, p) for p in LOAD_BALANCERS]
        rows = [r for r in rows if r is not None]
        return min(rows, key=lambda r: r["tpot_p99_ms"]) if rows else None

    def _cost_cells(self, wl: str, q: float, K: int, b: dict) -> dict:
        """eldr_cost (fitted) and eldr_cost[online] (no calibration) vs the best LB."""
        out = {}
        cost = POLICIES["eldr_cost"]
        for key, variant in (("cost", cost.variant(tau=self.plan.tau)),
                             ("online", cost.variant(tau=self.plan.tau, kind="online"))):
            c = self.get(wl, q, K, variant)
            out[f"{key}_tpot_p50"] = c["tpot_median_ms"] if c else float("nan")
            out[f"{key}_tpot_p99"] = c["tpot_p99_ms"] if c else float("nan")
            out[f"{key}_d_p50"] = _pct(c["tpot_median_ms"], b["tpot_median_ms"]) if c \
                else float("nan")
            out[f"{key}_d_p99"] = _pct(c["tpot_p99_ms"], b["tpot_p99_ms"]) if c \
                else float("nan")
            out[f"{key}_distinct"] = c["mean_distinct_per_layer"] if c else float("nan")
        return out

    def tiny_rows(self) -> list[dict]:
        """The shipped tiny-MoE trace on its measured CPU preset: every policy vs the best
        load balancer per rate (each metric against its own best)."""
        out = []
        plan = self.plan
        for q in plan.tiny_rates:
            rows = {r["variant"]: r for r in self.results.rows
                    if r["experiment"] == "tiny" and float(r["qps"]) == float(q)}
            lbs = [rows[p] for p in LOAD_BALANCERS if p in rows]
            if not lbs:
                continue
            b50 = min(lbs, key=lambda r: r["tpot_median_ms"])
            b99 = min(lbs, key=lambda r: r["tpot_p99_ms"])
            row = {"qps": q, "best_lb": b50["policy"], "lb_p50": b50["tpot_median_ms"],
                   "lb_p99": b99["tpot_p99_ms"], "batch": b50["mean_batch"]}
            for name, variant in (("eldr", self.eldr()), ("cost", "eldr_cost")):
                r = rows.get(variant)
                row[f"{name}_d_p50"] = _pct(r["tpot_median_ms"], b50["tpot_median_ms"]) \
                    if r else float("nan")
                row[f"{name}_d_p99"] = _pct(r["tpot_p99_ms"], b99["tpot_p99_ms"]) \
                    if r else float("nan")
                row[f"{name}_distinct"] = r["mean_distinct_per_layer"] if r else float("nan")
            row["lb_distinct"] = b50["mean_distinct_per_layer"]
            out.append(row)
        return out

    def tau_rows(self) -> list[dict]:
        wl, q, K = self.plan.workloads[0], self.plan.tau_rate, self.plan.num_decode
        b = self.best_lb(wl, q, K)
        out = []
        for tau in self.plan.tau_values:
            e = self.get(wl, q, K, self.eldr(tau))
            if e is None or b is None:
                continue
            out.append({"tau": tau, "tpot_p50": e["tpot_median_ms"], "tpot_p99": e["tpot_p99_ms"],
                        "d_p50": _pct(e["tpot_median_ms"], b["tpot_median_ms"]),
                        "d_p99": _pct(e["tpot_p99_ms"], b["tpot_p99_ms"]),
                        "distinct": e["mean_distinct_per_layer"],
                        "max_share": e["max_request_share"]})
        return out

    def pool_rows(self) -> list[dict]:
        wl = self.plan.workloads[0]
        out = []
        for K in self.plan.pool_sizes:
            d50, d99, c50, c99 = [], [], [], []
            for q in self.plan.pool_rates:
                b, e = self.best_lb(wl, q, K), self.get(wl, q, K, self.eldr())
                c = self.get(wl, q, K, "eldr_cost")
                if b is None or e is None:
                    continue
                d50.append(_pct(e["tpot_median_ms"], b["tpot_median_ms"]))
                d99.append(_pct(e["tpot_p99_ms"], b["tpot_p99_ms"]))
                if c is not None:
                    c50.append(_pct(c["tpot_median_ms"], b["tpot_median_ms"]))
                    c99.append(_pct(c["tpot_p99_ms"], b["tpot_p99_ms"]))
            if d50:
                out.append({"pool": f"{self.plan.num_prefill}P{K}D", "K": K,
                            "d_p50": float(np.mean(d50)), "d_p99": float(np.mean(d99)),
                            "cost_d_p50": float(np.mean(c50)) if c50 else float("nan"),
                            "cost_d_p99": float(np.mean(c99)) if c99 else float("nan"),
                            "rates": len(d50)})
        return out

    def vanilla_rows(self) -> list[dict]:
        K = self.plan.num_decode
        out = []
        for wl in self.plan.workloads:
            for kind in ("balanced", "vanilla"):
                d50, d99 = [], []
                for q in self.plan.rates:
                    rr, e = self.get(wl, q, K, "round_robin"), self.get(wl, q, K,
                                                                      self.eldr(kind=kind))
                    if rr is None or e is None:
                        continue
                    d50.append(_pct(e["tpot_median_ms"], rr["tpot_median_ms"]))
                    d99.append(_pct(e["tpot_p99_ms"], rr["tpot_p99_ms"]))
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
        lbs = [self.get(key, q, K, f"{p}+prefix[trace]") for p in LOAD_BALANCERS]
        lbs = [r for r in lbs if r is not None]
        if not lbs:
            return []
        b = min(lbs, key=lambda r: r["tpot_median_ms"])
        out = [{"variant": f"best LB ({b['policy']})", "row": b}]
        for src in ("sigcache", "fresh"):
            e = self.get(key, q, K, f"{self.eldr()}+prefix[{src}]")
            if e is not None:
                out.append({"variant": f"eldr, signatures {src}", "row": e})
        for o in out:
            r = o["row"]
            o.update(tpot_p50=r["tpot_median_ms"], tpot_p99=r["tpot_p99_ms"],
                     d_p50=_pct(r["tpot_median_ms"], b["tpot_median_ms"]),
                     d_p99=_pct(r["tpot_p99_ms"], b["tpot_p99_ms"]),
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
            lbs = [self.get(key, q, K, f"{lb}+ep[{lay}]") for lb in LOAD_BALANCERS
                   for lay in ("contiguous", "global")]
            lbs = [r for r in lbs if r is not None]
            if not lbs:
                continue
            b = min(lbs, key=lambda r: r["tpot_median_ms"])
            row = {"qps": q, "best_lb": b["variant"], "lb_p50": b["tpot_median_ms"],
                   "lb_p99": b["tpot_p99_ms"]}
            for lay in ("contiguous", "global", "per_decoder"):
                e = self.get(key, q, K, f"{self.eldr()}+ep[{lay}]")
                row[f"{lay}_p50"] = _pct(e["tpot_median_ms"], b["tpot_median_ms"]) if e \
                    else float("nan")
                row[f"{lay}_p99"] = _pct(e["tpot_p99_ms"], b["tpot_p99_ms"]) if e \
                    else float("nan")
            out.append(row)
        return out
