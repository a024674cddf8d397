"""Benchmark one routing decision (prints figures): p50/p99 latency of ``Policy.choose``.

ELDR's decision is one (K, d) × (d,) float32 product plus a handful of (K,) operations.
Measured per call with ``perf_counter_ns`` over pre-built requests with random unit
signatures and random loads, for K ∈ {8, 16, 24, 64} decode workers and signatures of
|S| × E = 8 × 128, 24 × 128 and 48 × 128 (d = 6,144: every layer of Qwen3-30B-A3B).
Target: p50 ≤ 15 µs at K = 16 (the paper reports 150 µs). JSQ and P2C are printed as the
floor set by Python and numpy call overhead.

``eldr_cost`` (marginal expert cost) is measured on (L, E) = (48, 128) profiles with every
decoder holding 0–8 requests in flight (dispatched through the policy, so its footprints
are real); its decision is a (K, L·E) × (L·E,) product. Target: p50 ≤ 50 µs at K = 16.
Its dispatch/release events (one (L·E,) log1p and exp each) are timed too.

Run: ``python benchmarks/bench_routing.py [--calls 20000]``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from eldr.routing import RouteRequest, make_policy


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.random((n, d), dtype=np.float32) ** 4  # sparse-ish, non-negative like counts
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def measure(name: str, K: int, d: int, calls: int, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    centroids = _unit(rng, K, d)
    policy = make_policy(name, num_workers=K, centroids=centroids, tau=0.1, random_state=0)
    pool = 256
    sigs = _unit(rng, pool, d)
    requests = [RouteRequest(f"r{i}", sigs[i]) for i in range(pool)]
    loads = [rng.integers(0, 8, K).astype(np.float64) for _ in range(pool)]
    healthy = np.ones(K, dtype=bool)
    for i in range(200):  # warm-up
        policy.choose(requests[i % pool], loads[i % pool], healthy)
    out = np.empty(calls, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(calls):
        req, load = requests[i % pool], loads[i % pool]
        t0 = clock()
        policy.choose(req, load, healthy)
        out[i] = clock() - t0
    return float(np.percentile(out, 50)) / 1e3, float(np.percentile(out, 99)) / 1e3


def measure_cost(K: int, calls: int, seed: int = 0, L: int = 48, E: int = 128
                 ) -> tuple[float, float, float]:
    """(decision p50, decision p99, dispatch+release p50) in µs for eldr_cost."""
    rng = np.random.default_rng(seed)
    policy = make_policy("eldr_cost", num_workers=K, num_layers=L, num_experts=E,
                         context_weight=0.01, capacity=256)
    pool = 256
    profiles = (rng.random((pool, L, E), dtype=np.float32) ** 8) * 0.5
    requests = [RouteRequest(f"r{i}", profile=profiles[i], context_tokens=1000)
                for i in range(pool)]
    loads = np.zeros(K)
    for i in range(pool):  # fill decoders with 0-8 requests in flight
        k = int(rng.integers(K))
        if loads[k] < 8:
            policy.on_dispatch(requests[i], k)
            loads[k] += 1
    for i in range(200):
        policy.choose(requests[i % pool], loads)
    out = np.empty(calls, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        policy.choose(requests[i % pool], loads)
        out[i] = clock() - t0
    ev = np.empty(min(calls, 5000), dtype=np.int64)
    extra = RouteRequest("extra", profile=profiles[0], context_tokens=1000)
    for i in range(ev.size):
        t0 = clock()
        policy.on_dispatch(extra, i % K)
        policy.on_release("extra", "completed")
        ev[i] = clock() - t0
    return (float(np.percentile(out, 50)) / 1e3, float(np.percentile(out, 99)) / 1e3,
            float(np.percentile(ev, 50)) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    print(f"one routing decision, {args.calls} calls each (µs; health mask given)")
    print(f"{'policy':<8} {'K':>3} {'|S|xE':>8} {'d':>6} {'p50':>8} {'p99':>8}")
    for K in (8, 16, 24, 64):
        for layers in (8, 24, 48):
            d = layers * 128
            p50, p99 = measure("eldr", K, d, args.calls)
            flag = "  <- target p50 <= 15" if K == 16 and layers == 48 else ""
            print(f"{'eldr':<8} {K:3d} {f'{layers}x128':>8} {d:6d} {p50:8.2f} {p99:8.2f}{flag}")
    for K in (8, 16, 32):
        p50, p99, ev = measure_cost(K, args.calls)
        flag = "  <- target p50 <= 50" if K == 16 else ""
        print(f"{'eldr_cost':<8} {K:3d} {'48x128':>8} {6144:6d} {p50:8.2f} {p99:8.2f}"
              f"{flag}  (dispatch+release {ev:.1f})")
    for name in ("jsq", "p2c", "random"):
        p50, p99 = measure(name, 16, 128, args.calls)
        print(f"{name:<8} {16:3d} {'-':>8} {'-':>6} {p50:8.2f} {p99:8.2f}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(a loaded machine inflates p99 most)")


if __name__ == "__main__":
    main()
