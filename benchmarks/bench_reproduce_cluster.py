"""`eldr reproduce`'s sweep locally (joblib processes) and on a Dask LocalCluster of the same
size on this machine: wall time per phase, the bytes each set-up ships to every worker,
and whether the rows agree (every column but the wall-time ones). docs/cluster.md.

    python benchmarks/bench_reproduce_cluster.py [--plan small|quick] [--workers 2]

``small``: the quick plan's task workload alone at 40 req/s, 5 + 10 s per point, a
600-request trace, no grid, no tiny-MoE trace (34 simulations); ``quick``:
``eldr reproduce --quick``'s plan.
The local run uses ``--workers`` processes, the cluster ``--workers`` worker processes of
one thread each, started (and stopped) here.
"""

from __future__ import annotations

import argparse
import pickle
import time
from dataclasses import replace

from eldr.reproduce import QUICK, run_plan
from eldr.reproduce.dask_cluster import connect, shipped_setup

SMALL = replace(QUICK, name="small", workloads=("task",), num_requests=600,
                calib_requests=300, rates=(40.0,), tau_rate=40.0, pool_rates=(40.0,),
                warmup_s=5.0, duration_s=10.0, grid=False, tiny=False)
VOLATILE = ("wall_s", "sim_requests_per_wall_s")


def _stable(rows):
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def _shipped_mb(results) -> dict[str, float]:
    """MB each set-up sends every worker: its pickled shipped form (the slab, dropped at
    the end of a run, counted from its size)."""
    return {k: (len(pickle.dumps(shipped_setup(st), protocol=5)) + st.tokens.nbytes_all)
            / 1e6 for k, st in results.setups.items()}


def main() -> None:
    from distributed import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", choices=("small", "quick"), default="small")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    plan = SMALL if args.plan == "small" else QUICK

    def quiet(msg):
        pass

    t0 = time.perf_counter()
    local = run_plan(plan, jobs=args.workers, log=quiet, progress=False)
    t_local = time.perf_counter() - t0
    t0 = time.perf_counter()
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=40) as lc:
        t_start = time.perf_counter() - t0
        t1 = time.perf_counter()
        with connect(lc.scheduler_address) as cluster:
            remote = run_plan(plan, log=quiet, progress=False, cluster=cluster)
        t_cluster = time.perf_counter() - t1
    same = _stable(local.rows) == _stable(remote.rows) and \
        local.decoder_rows == remote.decoder_rows
    print(f"plan {plan.name}: {len(local.rows)} simulations, {args.workers} local processes "
          f"vs {args.workers} Dask workers x 1 thread (LocalCluster)")
    print(f"{'':<12} {'total s':>8} {'setup s':>8} {'centroids s':>12} {'simulate s':>11}")
    for name, res, total in (("local", local, t_local), ("LocalCluster", remote, t_cluster)):
        s = res.seconds
        print(f"{name:<12} {total:>8.1f} {s['setup']:>8.1f} {s['centroids']:>12.1f} "
              f"{s['simulate']:>11.1f}")
    print(f"LocalCluster start-up {t_start:.1f} s (not in its total)")
    for key, mb in _shipped_mb(remote).items():
        print(f"shipped to each worker: {key} {mb:.0f} MB")
    print(f"rows identical in every non-timing column: {same}")


if __name__ == "__main__":
    main()
