"""Drift detector: false-alarm rate on unshifted traffic and detection rate on a domain-mix
shift, over many seeded runs of synthetic 4-domain traffic (tests/_learn_data.py).

    PYTHONPATH=src:tests python benchmarks/bench_drift.py [--runs 100] [--windows 10]

Per run: calibrate on 400 requests of the calibration mix, then stream ``windows`` windows
of 100 requests. Unshifted: the same mix (fresh draws: resampling noise only). Shifted:
the mix moves from (25, 25, 25, 25)% to ``--shifted``. Prints per-window exceedances and
declared drifts (patience 2) for both.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from _learn_data import mix, requests
from eldr.fit.signature import SignatureEncoder
from eldr.learn.drift import DriftDetector
from eldr.traces.trace import Trace, TraceMeta


def _trace(pre, dec, plen, olen):
    return Trace(meta=TraceMeta(model="synthetic", num_layers=pre.shape[1],
                                num_experts=pre.shape[2], top_k=2),
                 prefill_counts=pre, decode_counts=dec, prompt_lens=plen, output_lens=olen)


def run_once(seed: int, shares, windows: int, window: int = 100, alpha: float = 0.01):
    rng = np.random.default_rng(seed)
    ref = _trace(*requests(rng, mix(rng, 400, (1, 1, 1, 1))))
    enc = SignatureEncoder(layers=range(ref.meta.num_layers), random_state=seed).fit(ref)
    det = DriftDetector(window=window, alpha=alpha, patience=2, random_state=seed)
    det.calibrate(enc.transform(ref), ref.decode_counts)
    pre, dec, _, _ = requests(rng, mix(rng, windows * window, shares))
    exceeded = {"shift": 0, "rho": 0}
    first = None
    for w in range(windows):
        sl = slice(w * window, (w + 1) * window)
        reports = det.update(enc.transform(pre[sl]), dec[sl])
        for r in reports:
            exceeded[r.signal] += r.exceeded
        if det.drifted and first is None:
            first = w + 1
    return exceeded, first


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--windows", type=int, default=10)
    p.add_argument("--shifted", default="0.7,0.1,0.1,0.1")
    args = p.parse_args()
    shifted = tuple(float(x) for x in args.shifted.split(","))
    t0 = time.perf_counter()
    for name, shares in (("unshifted", (1, 1, 1, 1)), ("shifted", shifted)):
        exc = {"shift": 0, "rho": 0}
        declared, delays = 0, []
        for seed in range(args.runs):
            e, first = run_once(seed, shares, args.windows)
            for k in exc:
                exc[k] += e[k]
            if first is not None:
                declared += 1
                delays.append(first)
        n = args.runs * args.windows
        print(f"{name:9s}: windows past the threshold: shift {exc['shift']}/{n} "
              f"({exc['shift'] / n:.4f}), rho {exc['rho']}/{n} ({exc['rho'] / n:.4f}); "
              f"drift declared in {declared}/{args.runs} runs of {args.windows} windows"
              + (f", after {np.mean(delays):.1f} windows on average" if delays else ""))
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
