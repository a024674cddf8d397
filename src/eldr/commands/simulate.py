"""``eldr simulate``: sweep decode-routing policies × request rates in the cluster simulator."""

from __future__ import annotations

import argparse
import json
import sys
import time

HELP = "Simulate a PD-disaggregated MoE cluster: policies x request rates -> TPOT/TTFT table."


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eldr.sim import HARDWARE

    p.add_argument("--trace", help="trace file (.npz); "
                   "default: generate one with eldr.traces.synth")
    p.add_argument("--model", default="qwen3-30b-a3b", help="model preset (default "
                   "qwen3-30b-a3b)")
    p.add_argument("--workload", default="task", help="workload for a generated trace "
                   "(task or language)")
    p.add_argument("--requests", type=int, default=2000,
                   help="requests of a generated trace (default 2000)")
    p.add_argument("--calib", type=int, default=1000,
                   help="calibration requests the artifact is fitted on; the rest is replayed")
    p.add_argument("--prefill", type=int, default=8, help="prefill workers")
    p.add_argument("--decode", type=int, default=16, help="decode workers")
    p.add_argument("--qps", type=_floats, default=[20, 40, 60, 80, 100],
                   help="request rates (comma-separated)")
    p.add_argument("--policies", default="random,round_robin,jsq,p2c,domain,eldr",
                   help="comma-separated routing policies (eldr_top1, oracle_signature too)")
    p.add_argument("--tau", type=float, default=0.1, help="ELDR band width")
    p.add_argument("--vanilla", action="store_true", help="ELDR centroids from vanilla K-means")
    p.add_argument("--duration", type=float, default=120.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=30.0, help="warm-up seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE))
    p.add_argument("--t-fixed-ms", type=float, help="per-step fixed overhead (ms)")
    p.add_argument("--moe-a-us", type=float, help="MoE layer fixed time a (µs)")
    p.add_argument("--moe-b-us", type=float, help="MoE layer time per distinct expert b (µs)")
    p.add_argument("--bandwidth-tbs", type=float, help="HBM bandwidth (TB/s)")
    p.add_argument("--max-batch", type=int, default=256, help="max running requests per decoder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--prefix-caching", action="store_true",
                   help="prefill workers keep an LRU prefix cache")
    p.add_argument("--link-gbs", type=float, default=50.0, help="KV link bandwidth (GB/s)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--csv", help="also write the rows to this CSV file")


def run(args: argparse.Namespace) -> int:
    from eldr.reproduce.setup import fit_setup
    from eldr.routing import POLICIES
    from eldr.sim import SimConfig, simulate, write_csv
    from eldr.sim.steptime import routing_resources

    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    t0 = time.perf_counter()
    if args.trace:
        from eldr.traces.trace import load

        trace = load(args.trace)
    else:
        from eldr.traces.synth import generate

        trace = generate(args.model, args.workload, num_requests=args.requests, seed=args.seed,
                         keep_topk=False, progress=True)
    calib = min(args.calib, trace.num_requests // 2)
    setup = fit_setup(trace, args.workload, calib_requests=calib, seed=args.seed,
                      selection_max_pairs=20_000, max_pairs=50_000)
    print(f"{trace.describe()}\nfitted on {setup.calib.num_requests} requests (rho "
          f"{setup.encoder.rho_:.3f}, {setup.encoder.layers_.size} layers), replaying "
          f"{setup.eval.num_requests} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)

    def ms(x):
        return None if x is None else x * 1e-3

    from eldr.traces.models import PRESETS

    # a trace names its model; a trace of an unknown model uses --model's costs (shapes
    # are checked by the simulator)
    model = trace.meta.model if trace.meta.model in PRESETS else args.model
    rows = []
    for q in args.qps:
        cfg = SimConfig(model=model,
                        hardware=args.hardware, num_prefill=args.prefill,
                        num_decode=args.decode, qps=q, warmup_s=args.warmup,
                        duration_s=args.duration, seed=args.seed, max_batch=args.max_batch,
                        tp=args.tp, ep=args.ep, prefix_caching=args.prefix_caching,
                        link_bandwidth=args.link_gbs * 1e9, t_fixed_s=ms(args.t_fixed_ms),
                        moe_a_s=None if args.moe_a_us is None else args.moe_a_us * 1e-6,
                        moe_b_s=None if args.moe_b_us is None else args.moe_b_us * 1e-6,
                        hbm_bandwidth=None if args.bandwidth_tbs is None
                        else args.bandwidth_tbs * 1e12)
        for name in policies:
            pol = setup.policy(name, args.decode, tau=args.tau, seed=args.seed,
                               kind="vanilla" if args.vanilla else "balanced",
                               **routing_resources(cfg))
            res = simulate(setup.eval, cfg, pol, tokens=setup.tokens, progress=True,
                           **setup.inputs(pol))
            row = {"workload": args.workload, **res.summary()}
            rows.append(row)
            print(f"  {name:<16} {q:>6g} req/s: TPOT p50 {row['tpot_median_ms']:.2f} ms, "
                  f"{row['sim_requests_per_wall_s']:.0f} simulated req/s of wall",
                  file=sys.stderr)
    if args.csv:
        write_csv(rows, args.csv)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'policy':<17} {'req/s':>6} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p50':>9} "
          f"{'tok/s':>8} {'batch':>6} {'D/layer':>8}")
    for r in rows:
        print(f"{r['policy']:<17} {r['qps']:>6g} {r['tpot_median_ms']:>9.2f} "
              f"{r['tpot_p99_ms']:>9.2f} {r['ttft_median_ms']:>9.2f} "
              f"{r['throughput_tok_s']:>8.0f} {r['mean_batch']:>6.1f} "
              f"{r['mean_distinct_per_layer']:>8.1f}")
    return 0
