"""``eldr reproduce [--quick] [--out DIR]``: the paper's main experiments in one command."""

from __future__ import annotations

import argparse
import os
import sys
import time

from eldr.commands._args import positive_floats

HELP = ("Reproduce the paper's experiments in simulation on the embedded default data and "
        "write DIR/report.md with tables and plots (the main command).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="every section once on small inputs (one workload at one rate, "
                      "20 s per point, 2,000-request traces): the shortest run "
                      "(docs/simulator.md has the measured times)")
    size.add_argument("--full", action="store_true",
                      help="the paper's setting: full-size traces, 5 rates with 120 s "
                      "windows, prefix caching, expert parallelism and the whole 112-cell "
                      "grid (several times the default run, which makes every claim on "
                      "less; measured times in docs/simulator.md)")
    p.add_argument("--out", default="eldr-report", help="output directory (default "
                   "./eldr-report)")
    p.add_argument("--trace", help="use this trace (.npz) for the first workload instead of "
                   "generating it")
    p.add_argument("--workloads", help="comma-separated workloads (default task,language)")
    p.add_argument("--rates", type=positive_floats, help="request rates, e.g. 20,40,60,80,100")
    p.add_argument("--duration", type=float, help="measured seconds per point")
    p.add_argument("--warmup", type=float, help="warm-up seconds per point")
    p.add_argument("--requests", type=int, help="requests per generated trace")
    p.add_argument("--hardware", help="hardware preset: h200 (default) or mi300x, or a "
                   "hardware file (.json, eldr calibrate) with fits of every model the plan "
                   "simulates")
    p.add_argument("--seed", type=int, help="simulation seed (default 0)")
    p.add_argument("--max-seeds", type=int, help="most seeds per never-worse grid cell; "
                   "seeds are added from 3 until every interval of the cell is within "
                   "--target-half-width (default 3, i.e. exactly 3; 10 reaches for the "
                   "±0.5-point target at several times the run time)")
    p.add_argument("--target-half-width", type=float, help="percentage points: a grid cell "
                   "stops getting seeds once every 95 %% interval of it is at most this "
                   "wide on each side (default 0.5)")
    p.add_argument("--main-seeds", type=int, help="seeds of every headline point, for its "
                   "± figures (default 2; 1: no intervals)")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default: number of CPUs, at most 4)")
    p.add_argument("--cluster", metavar="ADDRESS", help="run the simulations on the Dask "
                   "distributed cluster whose scheduler is at ADDRESS (tcp://host:8786) "
                   "instead of local processes; needs the cluster extra (docs/cluster.md)")


def run(args: argparse.Namespace) -> int:
    from eldr.reproduce import Analysis, headline_text, run_plan, with_overrides, write_report
    from eldr.reproduce.plan import PLANS
    from eldr.reproduce.plots import require_matplotlib

    require_matplotlib()  # the report ends in plots: fail now, not after the whole run
    if args.cluster is not None and args.jobs is not None:
        raise ValueError("--jobs sets local worker processes: not with --cluster, whose "
                         "workers have their own threads")
    plan = PLANS["quick" if args.quick else "full" if args.full else "default"]
    workloads = None
    if args.workloads:
        from eldr.traces.workloads import get_workload

        workloads = tuple(get_workload(w).name for w in args.workloads.split(","))
    plan = with_overrides(plan, workloads=workloads, rates=args.rates,
                          duration_s=args.duration, warmup_s=args.warmup,
                          num_requests=args.requests, hardware=args.hardware, seed=args.seed,
                          grid_max_seeds=args.max_seeds,
                          target_half_width=args.target_half_width,
                          main_seeds=args.main_seeds)
    if args.rates and plan.tau_rate not in plan.rates:
        plan = with_overrides(plan, tau_rate=max(plan.rates), pool_rates=plan.rates)
    _check_hardware(plan)
    jobs = args.jobs if args.jobs is not None else min(os.cpu_count() or 1, 4)
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    trace = None
    if args.trace:
        from eldr.traces.trace import load

        trace = load(args.trace)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f"eldr reproduce ({plan.name}): {len(plan.workloads)} workload(s), rates "
        f"{list(plan.rates)}, {plan.warmup_s:g}+{plan.duration_s:g} s per point")
    if args.cluster is None:
        results = run_plan(plan, jobs=jobs, trace=trace, log=log)
    else:  # connected before the set-up: an unreachable address fails in seconds
        from eldr.reproduce.dask_cluster import connect

        with connect(args.cluster) as cluster:
            log(f"connected to {cluster}")
            results = run_plan(plan, trace=trace, log=log, cluster=cluster)
    t1 = time.perf_counter()
    path = write_report(results, args.out)
    log(f"report written ({time.perf_counter() - t1:.1f}s)")
    print(headline_text(Analysis(results)))
    print(f"\nreport: {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _check_hardware(plan) -> None:
    """Refuse, before hours of simulation, a hardware (a file, typically) without constants
    of a model the plan simulates on it (the tiny MoE runs on ``cpu`` regardless)."""
    from eldr.sim.config import get_hardware, moe_constants
    from eldr.traces.models import get_preset

    hw = get_hardware(plan.hardware)
    for model in {plan.model, *((plan.ep_model,) if plan.ep_experiment else ())}:
        moe_constants(hw, get_preset(model))
