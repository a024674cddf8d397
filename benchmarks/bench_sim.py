"""Simulator speed: 8P16D, 100 req/s, 150 simulated seconds, Qwen3-30B-A3B preset.

Target (issue 5): ≤ 30 s wall on one core for ≈ 15k requests. Prints simulated requests per
wall second and per CPU second of this process (the machine may be shared: CPU time is the
steadier figure), and the per-step expert union (the hot path) next to two naive baselines
measured in the same run: a boolean (L, E) mask filled from top-k ids, and np.unique per
layer.

``--policy`` takes the load balancers and ``eldr_cost`` (its profiles: the raw prefill
profile ``counts / prompt_len``, no fitted predictor; κ and the batch limit from the
config, as ``eldr reproduce`` gives them). The band policies need a fitted artifact.

    python benchmarks/bench_sim.py [--trace T.npz] [--qps 100] [--policy jsq|eldr_cost]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from eldr.routing import make_policy
from eldr.routing.cost import prefill_profile
from eldr.sim import SimConfig, TokenBank, simulate
from eldr.sim.steptime import routing_resources, topk_bitsets, union_distinct


def bench_union(batch: int = 16, L: int = 48, E: int = 128, k: int = 8, reps: int = 2000):
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((batch, L, E)), axis=2)[:, :, :k]
    bits = topk_bitsets(ids, E)
    layer = np.arange(L)[None, :, None]

    def bitset():
        return union_distinct(bits).sum()

    def mask():
        m = np.zeros((L, E), bool)
        m[np.broadcast_to(layer, ids.shape), ids] = True
        return m.sum()

    def unique():
        return sum(np.unique(ids[:, i]).size for i in range(L))

    out = {}
    for name, fn in (("bitset OR+popcount", bitset), ("bool mask", mask),
                     ("np.unique per layer", unique)):
        assert fn() == bitset()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = (time.perf_counter() - t0) / reps * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", help="trace .npz (default: eldr.traces.synth.default_trace())")
    ap.add_argument("--qps", type=float, default=100.0)
    ap.add_argument("--policy", default="jsq")
    args = ap.parse_args()
    if args.trace:
        from eldr.traces.trace import load

        trace = load(args.trace)
    else:
        from eldr.traces.synth import default_trace

        trace = default_trace()
    print(trace.describe())
    print("\nper-step expert union, batch 16, 48 x 128 (µs per step):")
    union = bench_union()
    base = union["bitset OR+popcount"]
    for name, us in union.items():
        print(f"  {name:<22} {us:8.1f} µs  ({us / base:5.1f}x bitset)")

    cfg = SimConfig(num_prefill=8, num_decode=16, qps=args.qps, warmup_s=30.0,
                    duration_s=120.0, seed=0)
    if args.policy in ("eldr", "eldr_top1", "oracle_signature", "domain"):
        raise SystemExit("use a load-only policy here; eldr needs a fitted artifact")
    inputs: dict = {}
    resources: dict = {"random_state": 0}
    if args.policy == "eldr_cost":
        meta = trace.meta
        resources = {"num_layers": meta.num_layers, "num_experts": meta.num_experts,
                     **routing_resources(cfg)}

        def profile(r: int) -> np.ndarray:
            return prefill_profile(trace.prefill_counts[r], int(trace.prompt_lens[r]),
                                   meta.top_k)

        inputs["profiles"] = profile
    tokens = TokenBank(trace, seed=0)  # cold on the first run, warm on the second
    for label in ("cold token cache", "warm token cache"):
        pol = make_policy(args.policy, num_workers=16, **resources)
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate(trace, cfg, pol, tokens=tokens, **inputs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = res.summary()
        print(f"\n8P16D {args.qps:g} req/s x 150 s ({label}), policy {args.policy}: "
              f"{s['requests']} requests, {res.total_steps} decode steps")
        print(f"  wall {wall:.2f} s -> {s['requests'] / wall:,.0f} simulated requests per wall "
              f"second, {res.total_steps / wall:,.0f} decode steps per second "
              f"(target: <= 30 s wall)")
        print(f"  CPU {cpu:.2f} s -> {s['requests'] / cpu:,.0f} simulated requests per CPU "
              f"second")
        print(f"  TPOT p50 {s['tpot_median_ms']:.2f} ms, p99 {s['tpot_p99_ms']:.2f} ms; "
              f"mean batch {s['mean_batch']:.1f}, distinct/layer "
              f"{s['mean_distinct_per_layer']:.1f}")


if __name__ == "__main__":
    main()
