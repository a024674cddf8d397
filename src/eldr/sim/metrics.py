"""Metrics of a simulation run: per-request latencies, summaries, tidy rows.

- TTFT = first token time − arrival (the first token comes out of the decode worker's
  first step, after prefill, KV transfer and decode admission: vLLM's PD flow).
- TPOT = (t_last − t_first) / (n_out − 1); undefined (NaN, excluded) for n_out = 1.
- Medians and p99 are over requests that ARRIVE inside the measured window
  ``[warmup, warmup + duration)``; they are simulated to completion (no censoring).
- Throughput: output tokens emitted by decode steps that end inside the window, per second.
- Per decoder (window steps only): mean batch size, mean distinct experts per MoE layer per
  step, and its share of the measured requests.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr.fileio import atomic_write_text
from eldr.sim.config import SimConfig
from eldr.sim.records import Requests

__all__ = ["SimResult", "write_csv", "write_json"]


@dataclass(eq=False)
class SimResult:
    """Everything a run produced. ``requests`` holds one record per arrival (read by
    column: ``requests["t_first"]`` is an (N,) array; :mod:`eldr.sim.records`)."""

    config: SimConfig  # the run's configuration
    policy: str  # decode routing policy name
    requests: Requests  # per-arrival records, in arrival order
    decoder_steps: np.ndarray  # (K,) int64 steps ending in the window
    decoder_batch_sum: np.ndarray  # (K,) int64 Σ batch size over those steps
    decoder_distinct_sum: np.ndarray  # (K,) int64 Σ_l D_l summed over those steps
    num_layers: int  # L, to turn Σ_l D_l into a per-layer mean
    window_tokens: int  # output tokens emitted by steps ending in the window
    total_steps: int  # decode steps of all workers, whole run
    wall_s: float  # wall-clock seconds the run took
    events: list | None = None  # (time, event, request or batch, worker) when recorded
    num_fallbacks: int = 0  # requests the policy routed by JSQ for lack of input

    @property
    def measured(self) -> np.ndarray:
        """(N,) bool: arrived inside the measured window."""
        t = self.requests["t_arrival"]
        c = self.config
        return (t >= c.warmup_s) & (t < c.horizon_s)

    def ttft(self) -> np.ndarray:
        r = self.requests
        return r["t_first"] - r["t_arrival"]

    def tpot(self) -> np.ndarray:
        r = self.requests
        n = r["n_out"].astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 1, (r["t_last"] - r["t_first"]) / (n - 1), np.nan)

    def decoder_table(self) -> list[dict]:
        """One row per decode worker (window statistics)."""
        m = self.measured
        dec = self.requests["decoder"][m]
        share = np.bincount(dec, minlength=self.config.num_decode) / max(m.sum(), 1)
        steps = np.maximum(self.decoder_steps, 1)
        rows = []
        for k in range(self.config.num_decode):
            rows.append({
                "decoder": k,
                "steps": int(self.decoder_steps[k]),
                "mean_batch": float(self.decoder_batch_sum[k] / steps[k]),
                "mean_distinct_per_layer": float(
                    self.decoder_distinct_sum[k] / steps[k] / self.num_layers),
                "request_share": float(share[k]),
            })
        return rows

    def summary(self) -> dict:
        """Scalars of the run (ms for latencies): what tables and plots show."""
        m = self.measured
        ttft = self.ttft()[m]
        tpot = self.tpot()[m]
        tpot = tpot[np.isfinite(tpot)]
        c = self.config
        steps = self.decoder_steps.sum()
        n_all = len(self.requests)

        def q(x: np.ndarray, p: float) -> float:
            return float(np.percentile(x, p) * 1e3) if x.size else float("nan")

        share = np.array([row["request_share"] for row in self.decoder_table()])
        return {
            "policy": self.policy,
            "qps": c.qps,
            "num_prefill": c.num_prefill,
            "num_decode": c.num_decode,
            "requests": int(n_all),
            "requests_measured": int(m.sum()),
            "ttft_median_ms": q(ttft, 50),
            "ttft_p99_ms": q(ttft, 99),
            "tpot_median_ms": q(tpot, 50),
            "tpot_p99_ms": q(tpot, 99),
            "tpot_mean_ms": float(tpot.mean() * 1e3) if tpot.size else float("nan"),
            "throughput_tok_s": self.window_tokens / c.duration_s,
            "mean_batch": float(self.decoder_batch_sum.sum() / max(steps, 1)),
            "mean_distinct_per_layer": float(
                self.decoder_distinct_sum.sum() / max(steps, 1) / self.num_layers),
            "max_request_share": float(share.max()) if share.size else float("nan"),
            "fallbacks": self.num_fallbacks,
            "wall_s": self.wall_s,
            "sim_requests_per_wall_s": n_all / self.wall_s if self.wall_s > 0 else float("inf"),
        }


def summary_table(rows: list[dict]) -> str:
    """The table ``eldr simulate`` prints: a header, then one line per
    :meth:`SimResult.summary` row (policy, rate, TPOT p50 and p99, TTFT p50 in ms,
    throughput, mean batch, distinct experts per layer)."""
    lines = [f"{'policy':<17} {'req/s':>6} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p50':>9} "
             f"{'tok/s':>8} {'batch':>6} {'D/layer':>8}"]
    for r in rows:
        lines.append(f"{r['policy']:<17} {r['qps']:>6g} {r['tpot_median_ms']:>9.2f} "
                     f"{r['tpot_p99_ms']:>9.2f} {r['ttft_median_ms']:>9.2f} "
                     f"{r['throughput_tok_s']:>8.0f} {r['mean_batch']:>6.1f} "
                     f"{r['mean_distinct_per_layer']:>8.1f}")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str | os.PathLike) -> Path:
    """Tidy rows (same keys) to CSV, atomically. Column order: first row's keys."""
    buf = io.StringIO()
    if rows:
        keys = list(rows[0])
        for row in rows[1:]:
            keys += [k for k in row if k not in keys]
        w = csv.DictWriter(buf, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return atomic_write_text(path, buf.getvalue())


def write_json(obj, path: str | os.PathLike) -> Path:
    """JSON (NaN → null), atomically."""
    return atomic_write_text(path, json.dumps(_clean(obj), indent=2) + "\n")


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return None if not np.isfinite(obj) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
