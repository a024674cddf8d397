"""Chosen cells of the never-worse grid, with intervals: are a policy's losses real?

Runs the cells named on the command line exactly as ``eldr reproduce`` runs its grid (the
full plan's traces, windows, seeds and set-ups, which were the default run's until the
plans were split; ``--plan default`` for the default run's 4,000-request traces,
``--plan quick`` for a smoke run), starts
each cell with the plan's ``grid_min_seeds`` seeds and adds one seed per round to every
cell whose widest interval is above ``--target-half-width`` points, up to ``--max-seeds``.
Prints, per cell and per locality policy, the paired Δ against EACH balancer (median and
p99 TPOT, mean ± 95 % half-width over seeds, %) and its class: worse (interval above +1 %),
not distinguishable (straddles +1 %), better or equal (below). Rows go to ``--out`` (CSV).

    python benchmarks/grid_cells.py --cells language:8:40,azure_conv:16:100 \\
        [--max-seeds 10] [--jobs 2] [--out cells.csv]

A cell is ``workload:decoders:req/s`` (workloads: task, language, azure_conv,
mooncake_conv).

``--cost-layer-stride S`` also runs ``eldr_cost`` pricing every S-th layer (``eldr serve
--cost-layer-stride S``) in every cell, as the locality policy ``eldr_cost_sS``, on the
same arrivals. It is registered by this benchmark only: in this process, and in joblib's
worker processes through a ``sitecustomize`` module in a temporary folder put first on
their ``PYTHONPATH`` (they are started afresh and import nothing of this script).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time

from eldr.reproduce.building import build_setups
from eldr.reproduce.grid import UNSURE, WORSE, cells_needing_seeds, class_counts, comparisons
from eldr.reproduce.plan import PLANS, Task, grid_cell_tasks, grid_policies, with_overrides
from eldr.reproduce.sweeps import local_runner, prime_setups, run_tasks


def parse_cells(text: str) -> list[tuple[str, int, float]]:
    """``wl:K:qps,...`` → [(workload, decoders, req/s)], with a clear error per bad cell."""
    cells = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        bits = part.split(":")
        if len(bits) != 3:
            raise SystemExit(f"--cells: {part!r} is not workload:decoders:req/s")
        try:
            cells.append((bits[0], int(bits[1]), float(bits[2])))
        except ValueError:
            raise SystemExit(f"--cells: {part!r}: decoders must be an integer and req/s "
                             "a number") from None
    if not cells:
        raise SystemExit("--cells: give at least one cell")
    return cells


def grid_plan(base, cells, max_seeds: int, half_width: float):
    """``base`` reduced to the set-ups the cells need and nothing but the grid."""
    workloads = tuple(dict.fromkeys(wl for wl, _, _ in cells))
    synthetic = tuple(wl for wl in workloads if wl in ("task", "language")) or ("task",)
    return with_overrides(
        base, workloads=synthetic[:1], rates=(), tau_values=(), tau_rate=-1.0,
        pool_sizes=(), vanilla=False, prefix=False, ep_experiment=False, tiny=False,
        prompt_rates=(), grid_workloads=workloads,
        grid_pools=tuple(sorted({K for _, K, _ in cells})),
        grid_rates=tuple(sorted({q for _, _, q in cells})), grid_max_seeds=max_seeds,
        target_half_width=half_width)


def register_stride(stride: int) -> str:
    """Register ``eldr_cost`` pricing every ``stride``-th layer as a grid policy of this
    process (and of processes forked from it); its name."""
    from eldr.routing import make_policy
    from eldr.routing.registry import POLICIES, register_policy
    from eldr.routing.roles import ReportRole

    name = f"eldr_cost_s{stride}"
    if name in POLICIES:
        return name
    spec = POLICIES["eldr_cost"]

    def build(K, **kw):
        pol = make_policy("eldr_cost", num_workers=K, layer_stride=stride, **kw)
        pol.name = name  # the rows carry the policy's name
        return pol

    order = 1 + max(s.report.order for s in POLICIES.values() if s.report is not None)
    register_policy(name, build, needs=spec.needs, options=spec.options, role="locality",
                    report=ReportRole(order=order, grid=True,
                                      title=f"The cost policy on every {stride}th layer",
                                      sweep_weight=spec.report.sweep_weight))
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", required=True, help="workload:decoders:req/s, comma-separated")
    ap.add_argument("--plan", choices=tuple(PLANS), default="full",
                    help="the plan whose traces and windows the cells use (default: full, "
                         "the plan of docs/simulator.md's cell figures, which was the "
                         "default run's before the plans were split)")
    ap.add_argument("--max-seeds", type=int, default=10)
    ap.add_argument("--target-half-width", type=float, default=0.5)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", help="write every simulation row here (CSV)")
    ap.add_argument("--cost-layer-stride", type=int, default=None, metavar="S",
                    help="also run eldr_cost pricing every S-th layer, as eldr_cost_sS")
    args = ap.parse_args()
    cells = parse_cells(args.cells)
    if args.cost_layer_stride is None:
        return _run(args, cells)
    if args.cost_layer_stride < 2:
        raise SystemExit("--cost-layer-stride: give S >= 2 (1 is eldr_cost itself)")
    register_stride(args.cost_layer_stride)
    with tempfile.TemporaryDirectory(prefix="eldr-grid-stride-") as hook:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
            f.write(f"import sys\nsys.path.insert(0, {here!r})\nimport grid_cells\n"
                    f"grid_cells.register_stride({args.cost_layer_stride})\n")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (hook, os.environ.get("PYTHONPATH")) if p)
        return _run(args, cells)


def _run(args, cells) -> int:
    plan = grid_plan(PLANS[args.plan], cells, args.max_seeds, args.target_half_width)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eldr-grid-cells-") as tmp:
        setups = build_setups(plan, folder=tmp)
        unknown = sorted({wl for wl, _, _ in cells} - set(setups))
        if unknown:
            raise SystemExit(f"--cells: no set-up for {unknown}")
        # a Parallel per call (eldr.reproduce.sweeps.local_runner says why)
        runner = local_runner(n_jobs=args.jobs, temp_folder=tmp, max_nbytes="1M")

        tasks = [t for wl, K, q in cells for j in range(plan.grid_start_seeds)
                 for t in grid_cell_tasks(plan, wl, K, q, j)]
        prime_setups(setups, tasks)
        print(f"set-ups {time.perf_counter() - t0:.0f}s; {len(tasks)} simulations",
              flush=True)
        rows = [row for row, _ in run_tasks(plan, setups, tasks, runner)]
        while more := [t for (wl, K, q), n in cells_needing_seeds(
                rows, plan.target_half_width, plan.grid_max_seeds)
                for t in grid_cell_tasks(plan, wl, K, q, n)]:
            per_cell = len(grid_cell_tasks(plan, *cells[0], 0))
            print(f"{time.perf_counter() - t0:.0f}s: {len(more) // per_cell} cell(s) get one "
                  "more seed", flush=True)
            rows += [row for row, _ in run_tasks(plan, setups, more, runner)]
        for st in setups.values():
            st.tokens.drop_all()
    variant_of = {p: Task("grid", "", p, 0.0, 0, plan.tau).variant for p in grid_policies()}
    comps = comparisons(rows, variant_of)
    print(f"\n{len(cells)} cells, {len(rows)} simulations, "
          f"{time.perf_counter() - t0:.0f}s; Δ vs each balancer, mean ± 95 % half-width (%)")
    print(f"{'cell':26} {'policy':12} {'metric':6} " + "  ".join(
        f"{'vs ' + b:>24}" for b in sorted({c['balancer'] for c in comps})))
    by = {}
    for c in comps:
        by.setdefault((c["workload"], c["num_decode"], c["qps"], c["policy"], c["metric"]),
                      {})[c["balancer"]] = c
    tag = {WORSE: "WORSE", UNSURE: "unsure"}
    for (wl, K, q, pol, metric), m in by.items():
        cols = [f"{m[b]['mean']:+6.2f}±{m[b]['half']:.2f} n={m[b]['n']:<2} "
                f"{tag.get(m[b]['cls'], 'ok'):>6}" for b in sorted(m)]
        print(f"{f'{wl}:{K}:{q:g}':26} {pol:12} {metric:6} " + "  ".join(cols))
    for pol in grid_policies():
        k = class_counts([c for c in comps if c["policy"] == pol])
        print(f"{pol}: " + ", ".join(f"{v} {n}" for n, v in k.items()))
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
