#!/usr/bin/env python3
"""``eldr_cost`` pricing every layer against a fixed subset of layers: what routing loses,
what the decision saves (issue 32, "cut what is not needed per request").

``eldr_cost`` prices a decoder by the expected distinct experts of all L layers (L·E cells:
6,144 at 48 × 128), and that arithmetic is its router's largest in-process stage (a
float32 ``log`` over the cells at each dispatch, an ``exp`` over them for each decoder an
event touched: ≈ 105 µs of a request, docs/serve.md). The band policy (``eldr``) already
reads one layer in three. Here ``eldr_cost`` reads every ``s``-th layer (``s`` = 1, 3, 6:
strides fixed before any run, 3 being the band's own), its decoder profiles and κ cut to
match (κ prices context tokens against distinct experts: fewer priced layers, fewer
experts), in three measurements:

1. the decision's own cost in this process (decide + dispatch + release at 32 requests in
   flight, as ``bench_serve.py``'s stage), 48 × 128 with fitted decoder profiles;
2. the simulator on the synthetic ``task`` trace (Qwen3-30B-A3B preset, 8P16D, H200),
   each request's raw prefill profile, median and p99 TPOT against JSQ over seeds;
3. the simulator on the shipped real routing (GPT-OSS-20B; ESFT on DeepSeek-V2-Lite as
   recorded and with outputs capped at 64 tokens), as ``eldr reproduce``'s "Real models"
   runs it (held-out splits, 3 seeds; :func:`eldr.reproduce.recorded.compare`).

The subset is the policy's own option, ``layer_stride`` (``eldr serve
--cost-layer-stride``): profiles (L, E) are cut to the priced rows inside the policy (the
simulator hands it whole ones), a router asks the engine for those rows only. Until
2026-12-07 this benchmark ran a wrapper of its own doing the same cut; the option gave the
same figures.

    python benchmarks/bench_cost_layers.py [--rates 60 100] [--seeds 0 1] [--skip-sim]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np

from eldr.routing.cost import CostPolicy, prefill_profile
from eldr.routing.protocol import RouteRequest

STRIDES = (1, 3, 6)


def _policy(stride: int, K: int, **resources):
    """``eldr_cost`` pricing every ``stride``-th layer, named ``eldr_cost_s{stride}`` beside
    the all-layer one (the simulator's rows carry the policy's name)."""
    from eldr.routing import make_policy

    pol = make_policy("eldr_cost", num_workers=K, layer_stride=stride, **resources)
    if stride != 1:
        pol.name = f"eldr_cost_s{stride}"
    return pol


def decision_cost(K: int, repeat: int = 3000, in_flight: int = 32) -> dict[int, float]:
    """Median µs of decide + dispatch (+ the oldest's release) per stride: the policy with
    ``layer_stride`` on profiles already cut to its priced rows, as the router reads them
    from a payload masked to those rows."""
    L, E, k = 48, 128, 8
    rng = np.random.default_rng(0)
    counts = rng.multinomial(256 * k, np.ones(E) / E, size=L)
    full = prefill_profile(counts, 256, k)
    typical = np.log1p(-np.minimum(rng.dirichlet(np.ones(E), size=(K, L)) * k, 0.99))
    out = {}
    for stride in STRIDES:
        layers = np.arange(0, L, stride)
        profile = np.ascontiguousarray(full[layers])
        pol = CostPolicy(K, num_layers=L, num_experts=E, layer_stride=stride,
                         decoder_profiles=typical.astype(np.float32))
        loads, held, ids = np.zeros(K), collections.deque(), iter(range(1 << 30))

        def step(pol=pol, loads=loads, held=held, ids=ids, profile=profile):
            rid = f"r{next(ids)}"
            req = RouteRequest(rid, profile=profile, context_tokens=256)
            w = pol.decide(req, loads, None).worker
            pol.on_dispatch(req, w)
            loads[w] += 1
            held.append((rid, w))
            if len(held) > in_flight:
                old, d = held.popleft()
                pol.on_release(old, "completed")
                loads[d] -= 1

        for _ in range(repeat // 10):
            step()
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        out[stride] = statistics.median(ts) * 1e6
    return out


def synthetic(rates, seeds) -> dict:
    """(rate, stride) → [(Δ p50 %, Δ p99 %) against JSQ per seed] on the task trace."""
    from eldr.routing import make_policy
    from eldr.sim import SimConfig, TokenBank, simulate
    from eldr.sim.steptime import routing_resources
    from eldr.traces.synth import default_trace

    trace = default_trace()
    meta = trace.meta
    tokens = TokenBank(trace, seed=0)

    def profile(r: int) -> np.ndarray:
        return prefill_profile(trace.prefill_counts[r], int(trace.prompt_lens[r]), meta.top_k)

    out: dict = collections.defaultdict(list)
    for qps in rates:
        for seed in seeds:
            cfg = SimConfig(num_prefill=8, num_decode=16, qps=qps, warmup_s=30.0,
                            duration_s=120.0, seed=seed)
            base = simulate(trace, cfg, make_policy("jsq", num_workers=16,
                                                    random_state=seed), tokens=tokens)
            b = base.summary()
            for stride in STRIDES:
                pol = _policy(stride, 16, num_layers=meta.num_layers,
                              num_experts=meta.num_experts, **routing_resources(cfg))
                s = simulate(trace, cfg, pol, tokens=tokens, profiles=profile).summary()
                out[(qps, stride)].append(
                    (100 * (s["tpot_median_ms"] / b["tpot_median_ms"] - 1),
                     100 * (s["tpot_p99_ms"] / b["tpot_p99_ms"] - 1)))
            print(f"   task, {qps:g} req/s, seed {seed}: done", flush=True)
    return out


def real(seeds: int = 3) -> dict:
    """case → stride → [(Δ p50 %, Δ p99 %) against JSQ per seed] on the shipped routing."""
    from eldr.reproduce.recorded import cap_outputs, compare
    from eldr.routing.registry import POLICIES, register_policy
    from eldr.traces.real import load_real_trace

    for stride in STRIDES[1:]:
        name = f"eldr_cost_s{stride}"
        if name not in POLICIES:
            register_policy(name, lambda K, s=stride, **kw: _policy(s, K, **kw),
                            needs={"num_layers", "num_experts"},
                            options={"context_weight", "capacity", "decoder_profiles",
                                     "load_slack"}, role="locality")  # one row each
    names = {1: "eldr_cost", **{s: f"eldr_cost_s{s}" for s in STRIDES[1:]}}
    out = {}
    for label, trace_name, K, cap in (("GPT-OSS-20B", "gpt-oss-20b", 8, None),
                                      ("ESFT, as recorded", "esft-vanilla-lite", 4, None),
                                      ("ESFT, outputs capped at 64", "esft-vanilla-lite", 4,
                                       64)):
        trace = load_real_trace(trace_name)
        if cap:
            trace = cap_outputs(trace, cap)
        cmp = compare(trace, num_decode=K, seeds=seeds, warmup_s=10.0, duration_s=30.0,
                      policies=("jsq", *names.values()))
        by = collections.defaultdict(dict)
        for r in cmp.rows:
            by[r["policy"]][r["seed"]] = (r["tpot_median_ms"], r["tpot_p99_ms"])
        out[label] = {s: [(100 * (by[p][j][0] / by["jsq"][j][0] - 1),
                           100 * (by[p][j][1] / by["jsq"][j][1] - 1)) for j in by["jsq"]]
                      for s, p in names.items()}
        print(f"   {label}: {cmp.qps:.1f} req/s, {seeds} seeds, {trace.meta.num_layers} "
              f"layers", flush=True)
    return out


def _cell(deltas) -> str:
    p50 = [d[0] for d in deltas]
    p99 = [d[1] for d in deltas]
    return f"{np.mean(p50):+5.1f} % / {np.mean(p99):+5.1f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[60.0, 100.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--skip-sim", action="store_true", help="section 1 only")
    args = ap.parse_args()
    print("1. decide + dispatch/release, 48x128, fitted decoder profiles, 32 in flight "
          "(median us, this process)")
    for K in (2, 16):
        cost = decision_cost(K)
        print(f"   K = {K:>2}: " + ", ".join(
            f"every {s} layer{'s' if s > 1 else ''} ({-(-48 // s)}) {us:6.1f}"
            for s, us in cost.items()))
    if args.skip_sim:
        return
    print("\n2. simulator, synthetic task trace, 8P16D H200: TPOT p50 / p99 against JSQ, "
          f"mean over seeds {args.seeds}")
    syn = synthetic(args.rates, args.seeds)
    for qps in args.rates:
        print(f"   {qps:>5g} req/s: " + "; ".join(
            f"every {s}: {_cell(syn[(qps, s)])}" for s in STRIDES))
    print("\n3. simulator, shipped real routing (eldr reproduce's 'Real models' set-up, "
          "held-out splits): TPOT p50 / p99 against JSQ, mean over 3 seeds")
    for label, rows in real().items():
        print(f"   {label:<27}: " + "; ".join(f"every {s}: {_cell(d)}"
                                             for s, d in rows.items()))


if __name__ == "__main__":
    main()
