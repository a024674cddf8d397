"""Running a reproduction plan's simulations (docs/simulator.md, "Running the sweep").

:func:`run_plan` builds the traces and the routing set-ups
(:func:`eldr.reproduce.building.build_setups`), turns each :class:`~eldr.reproduce.plan.Task`
of :func:`eldr.reproduce.plan.plan_tasks` into a self-contained :class:`SimJob`
(:func:`make_job`) and runs them through joblib (local worker processes) or on a Dask
cluster (:mod:`eldr.reproduce.dask_cluster`, docs/cluster.md), and returns tidy rows in
:class:`Results`.

Every run of one (workload, rate, seed) replays the SAME arrivals and tokens (seeded), so
the policies are compared on identical input. A task's seed is
:func:`~eldr.reproduce.plan.replicate_seed` of the plan's seed and its ``replicate``: it
draws the Poisson arrivals (which times, which held-out requests), or, for a replayed
real trace, where in the trace the window starts (:func:`replayed_arrivals`), and the
policies' own random choices. The per-token expert draws of each held-out request are
the set-up's, the same for every seed. After the plan's tasks, grid cells whose
intervals are still wide get more seeds, one per round (:func:`run_plan`).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
from joblib import Parallel, delayed

from eldr._progress import Progress
from eldr.reproduce.building import build_setups, prime_setup
from eldr.reproduce.grid import cells_needing_seeds
from eldr.reproduce.memmaps import map_to_files
from eldr.reproduce.plan import Plan, Task, grid_cell_tasks, plan_tasks, replicate_seed
from eldr.reproduce.setup import RoutingSetup
from eldr.routing import POLICIES, decode_patterns
from eldr.sim import SimConfig, TokenBank, simulate
from eldr.sim.steptime import routing_resources

__all__ = ["Results", "SimJob", "local_runner", "make_job", "prime_setups",
           "replayed_arrivals", "run_job", "run_plan", "run_task", "run_tasks"]


@dataclass(frozen=True)
class SimJob:
    """What one task's simulation needs, and nothing else: built in the parent process
    (:func:`make_job`), run anywhere (:func:`run_job`). Its large arrays (the held-out
    trace's, the token slab) are shared with workers by joblib as memory-mapped files."""

    task: Task  # the run it performs
    config: SimConfig  # the cluster and load it simulates
    policy: object  # a fresh policy instance (policies keep state)
    tokens: TokenBank  # rows of the held-out split; ``tokens.trace`` is what it replays
    inputs: dict  # further simulate() keywords: signatures, profiles, placement, encoder
    needs_patterns: bool  # compute the oracle's decode patterns where it runs
    head: dict  # leading columns of its rows


def _config(plan: Plan, task: Task, num_eval_requests: int) -> SimConfig:
    src = task.signature_source
    warmup = plan.warmup_s if task.warmup_s is None else task.warmup_s
    duration = plan.duration_s if task.duration_s is None else task.duration_s
    if src is not None:
        # Replayed trace requests repeat once arrivals outnumber them, and a repeat hits
        # the prefix cache with its WHOLE prompt: not what real traffic does. So the
        # prefix experiment stops arrivals before the held-out requests run out.
        horizon = min(warmup + duration, 0.95 * num_eval_requests / task.qps)
        warmup, duration = 0.2 * horizon, 0.8 * horizon
    return SimConfig(model=task.model or plan.model, hardware=task.hardware or plan.hardware,
                     num_prefill=task.num_prefill or plan.num_prefill,
                     num_decode=task.num_decode, qps=float(task.qps), warmup_s=warmup,
                     duration_s=duration, seed=replicate_seed(plan.seed, task.replicate),
                     tp=task.tp, ep=task.ep,
                     prefix_caching=src is not None, signature_source=src or "trace")


def make_job(plan: Plan, setup: RoutingSetup, task: Task) -> SimJob:
    """The :class:`SimJob` of ``task`` on ``setup`` (fits centroids it needs if not yet)."""
    config = _config(plan, task, setup.eval.num_requests)
    policy = setup.policy(task.policy, task.num_decode, tau=task.tau, seed=config.seed,
                          kind=task.kind, **routing_resources(config))
    inputs = setup.inputs(policy, patterns=False)
    if task.ep > 1 and task.placement != "contiguous":
        inputs["placement"] = setup.placement(task.num_decode, task.ep, task.placement)
    if config.signature_source != "trace":
        inputs["encoder"] = setup.encoder
    replay = replayed_arrivals(setup, task.qps, config.horizon_s, task.replicate,
                               config.seed)
    if replay is not None:  # a real trace: its own arrival process, scaled to the rate
        inputs["arrivals"] = replay
    head = {"experiment": task.experiment, "workload": task.workload,
            "variant": task.variant, "tau": task.tau, "kind": task.kind,
            "model": task.model or plan.model, "replicate": task.replicate,
            "seed": config.seed}
    return SimJob(task, config, policy, setup.tokens, inputs,
                  "decode_pattern" in policy.inputs, head)


def replayed_arrivals(setup: RoutingSetup, qps: float, horizon_s: float, replicate: int,
                      seed: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A real trace's (times (N,), eval index (N,)) at ``qps`` for seed number
    ``replicate`` (None for a Poisson workload).

    Seed number 0 replays the trace from its first arrival (:meth:`RoutingSetup.arrivals`).
    Another seed starts at a held-out arrival drawn from ``seed`` and wraps around to the
    first after the last (one mean gap between them): the real gaps, bursts and lengths,
    each arrival with its own request, over a different stretch of the trace — what a
    different seed is to Poisson arrivals."""
    if replicate == 0 or setup.arrival_times is None:
        return setup.arrivals(qps, horizon_s)
    t = setup.arrival_times * (setup.arrival_rate / float(qps))
    R = t.size
    start = int(np.random.default_rng((seed, 0x5EED)).integers(R))
    gap = (t[-1] - t[0]) / max(R - 1, 1)
    times = np.concatenate([t[start:] - t[start], t[:start] - t[0] + (t[-1] - t[start]) + gap])
    index = np.concatenate([np.arange(start, R), np.arange(start)]).astype(np.int64)
    n = int(np.searchsorted(times, horizon_s, side="left"))
    return times[:n].copy(), index[:n]


def run_job(job: SimJob) -> tuple[dict, list[dict]]:
    """Simulate one job; returns (summary row, decoder rows)."""
    inputs = dict(job.inputs)
    trace = job.tokens.trace
    if job.needs_patterns:  # (R, L·E) float32: cheap to compute, costly to keep and ship
        inputs["decode_patterns"] = decode_patterns(trace.decode_counts)
    res = simulate(trace, job.config, job.policy, tokens=job.tokens, **inputs)
    row = {**job.head, **res.summary()}
    if "signature_exact" in res.requests:
        m = res.measured
        row["signature_exact_share"] = float(res.requests["signature_exact"][m].mean())
        row["prefix_hit_share"] = float((res.requests["cached_tokens"][m] > 0).mean())
    dec = [{**job.head, "qps": job.task.qps, **d} for d in res.decoder_table()] \
        if job.task.keep_decoders else []
    return row, dec


def run_task(plan: Plan, setups: dict[str, RoutingSetup], task: Task) -> tuple[dict,
                                                                                 list[dict]]:
    """Run one task in this process; returns (summary row, decoder rows)."""
    return run_job(make_job(plan, setups[task.workload], task))


@dataclass
class Results:
    """Rows of a finished plan and its timings."""

    plan: Plan  # the plan that ran
    rows: list[dict]  # one summary row per task: plan order, then added grid seeds
    decoder_rows: list[dict]  # per-decoder rows of the tasks that keep them
    setups: dict[str, RoutingSetup]  # set-up key → its fitted set-up
    seconds: dict[str, float] = field(default_factory=dict)  # phase → wall seconds


def run_plan(plan: Plan, *, jobs: int = 1, trace=None, log=print,
             progress: bool = True, backend: str | None = None, cluster=None) -> Results:
    """Build set-ups and run every task of ``plan`` through :class:`joblib.Parallel` (or
    on ``cluster``), then add grid seeds round by round.

    ``jobs`` worker processes (joblib's ``n_jobs``; 1 runs in this process); ``backend``:
    a joblib backend name (``None``: joblib's default, local processes). Every set-up's
    decode-token rows are built once into a memory-mapped file of a temporary folder, and
    its held-out arrays moved to files there (:func:`build_setups` with ``folder``), so
    all processes map one copy; other large arrays go to workers as joblib memory maps in
    that folder.

    ``cluster``: a connected :class:`eldr.reproduce.dask_cluster.DaskCluster` (``jobs``
    and ``backend`` are then unused): the same tasks run on its workers, each set-up
    scattered to them in turn, since a remote worker cannot read this machine's
    temporary folder. The rows are those of a local run but for the wall-time columns.

    Seeds: after the plan's tasks (``grid_min_seeds`` per grid cell), every grid cell whose
    widest interval is above ``target_half_width`` and that has fewer than
    ``grid_max_seeds`` seeds runs one more seed (:func:`grid_cell_tasks`), until none is
    left: deterministic, since which cells continue depends on the seeded rows only.
    """
    t0 = time.perf_counter()
    rows, dec_rows = [], []
    with tempfile.TemporaryDirectory(prefix="eldr-reproduce-", ignore_cleanup_errors=True) \
            as tmp:
        setups = build_setups(plan, trace=trace, log=log, folder=tmp)
        t1 = time.perf_counter()
        log(f"set-ups built ({t1 - t0:.1f}s)")
        tasks = plan_tasks(plan)
        prime_setups(setups, tasks)  # every centroid set once, here
        for n, st in enumerate(setups.values()):  # fitted: the parent is done with it
            map_to_files(st.calib, os.path.join(tmp, f"setup-{n}-calib"))
        t2 = time.perf_counter()
        if cluster is None:
            runner = local_runner(n_jobs=jobs, backend=backend, temp_folder=tmp,
                                  max_nbytes="1M")
            where = f"with {jobs} process(es)"
        else:
            runner, jobs, where = cluster.run, cluster.num_threads, f"on {cluster}"
        log(f"fit centroids for {len({(t.num_decode, t.kind) for t in tasks})} pool "
            f"sizes/kinds ({t2 - t1:.1f}s); running {len(tasks)} simulations {where}")
        for row, dec in run_tasks(plan, setups, tasks, runner, desc="reproduce",
                                  progress=progress):
            rows.append(row)
            dec_rows += dec
        log(_done_line(rows, time.perf_counter() - t2, jobs))
        while more := _more_grid_seeds(plan, rows):
            log(f"grid: {len({(t.workload, t.num_decode, t.qps) for t in more})} cell(s) "
                f"with an interval wider than ±{plan.target_half_width:g} points get one "
                "more seed")
            ta = time.perf_counter()
            added = [row for row, _ in run_tasks(plan, setups, more, runner,
                                                 desc="grid seeds", progress=progress)]
            rows += added
            log(_done_line(added, time.perf_counter() - ta, jobs))
        for st in setups.values():  # the slab's file goes with the folder
            st.tokens.drop_all()
    t3 = time.perf_counter()
    return Results(plan, rows, dec_rows, setups,
                   {"setup": t1 - t0, "centroids": t2 - t1, "simulate": t3 - t2,
                    "total": t3 - t0, "jobs": jobs, "cpus": os.cpu_count() or 1})


def _done_line(rows: list[dict], wall: float, jobs: int) -> str:
    """A progress line after a batch of simulations: its wall time, and the summed time
    of each experiment's simulate() calls (where the batch's time went)."""
    spent: dict[str, float] = {}
    for r in rows:
        spent[r["experiment"]] = spent.get(r["experiment"], 0.0) + float(r.get("wall_s", 0))
    parts = ", ".join(f"{k} {v:.1f}" for k, v in spent.items())
    return (f"{len(rows)} simulations done ({wall:.1f}s wall with {jobs} process(es); "
            f"simulate() seconds summed: {parts})")


def run_tasks(plan: Plan, setups: dict[str, RoutingSetup], tasks: list[Task], runner, *,
              desc: str = "simulations", progress: bool = False) -> list[tuple[dict,
                                                                               list[dict]]]:
    """(summary row, decoder rows) of every task, in the order of ``tasks``, each set-up's
    tasks run together by ``runner(plan, setup, tasks)``, which yields (position in its
    ``tasks``, output) pairs in any order: the rows do not depend on the runner.

    The set-ups must already hold every centroid set, profile and layout the tasks use
    (:func:`prime_setups`): a runner may ship a set-up without its calibration split."""
    done: list = [None] * len(tasks)
    with Progress(len(tasks), desc, enabled=None if progress else False) as bar:
        # One set-up at a time: all workers then read the same token slab, so the
        # machine holds one set-up's rows (up to 2 GB at full size), not two.
        for key, st in setups.items():
            idx = [i for i, t in enumerate(tasks) if t.workload == key]
            if not idx:
                continue
            for j, out in runner(plan, st, [tasks[i] for i in idx]):
                done[idx[j]] = out
                bar.update(1)
    return done


def prime_setups(setups: dict[str, RoutingSetup], tasks: list[Task]) -> None:
    """Fit every centroid set, cluster profile and expert layout ``tasks`` use, here and
    once, so that no worker fits one (and a set-up shipped without its calibration split
    has all it needs)."""
    for key, st in setups.items():
        prime_setup(st, [t for t in tasks if t.workload == key])


def local_runner(**parallel_args):
    """A runner of :func:`run_tasks` on local worker processes: each call runs its tasks
    through a joblib ``Parallel(return_as="generator", **parallel_args)`` of its own, the
    longest tasks first (:func:`task_weight`), so that the batch does not end on one long
    task while the other workers wait; each output is yielded with its position in
    ``tasks``.

    A new ``Parallel`` per call, not one reused: joblib names a call's memmapping folder
    after the ``Parallel`` object, and the (reused) worker pool remembers which arrays it
    has dumped there. A second call of the same object that sends the same large array
    again (a set-up's cached centroids or cluster profiles, in every round of grid seeds)
    dumps it to the same file without the extra reference the first call took, while the
    call's clean-up still drops one: loky's resource tracker then counts below zero and
    prints ``KeyError`` tracebacks on stderr. The worker processes are reused either way."""
    def run(plan: Plan, setup: RoutingSetup, tasks: list[Task]):
        order = sorted(range(len(tasks)), key=lambda i: -task_weight(plan, tasks[i]))
        parallel = Parallel(return_as="generator", **parallel_args)
        outs = parallel(delayed(run_job)(make_job(plan, setup, tasks[i])) for i in order)
        yield from zip(order, outs, strict=True)
    return run


def task_weight(plan: Plan, task: Task) -> float:
    """A task's expected simulate() time in arbitrary units: its arrivals (rate × warm-up
    and window) times the policy's report role ``sweep_weight`` (its simulate() time per
    request relative to a balancer's; 1 without a report role). Only the order of tasks
    depends on it (the longest first), never a row."""
    warmup = plan.warmup_s if task.warmup_s is None else task.warmup_s
    duration = plan.duration_s if task.duration_s is None else task.duration_s
    role = POLICIES[task.policy].report
    factor = 1.0 if role is None else float(role.sweep_weight)
    return float(task.qps) * (warmup + duration) * factor


def _more_grid_seeds(plan: Plan, rows: list[dict]) -> list[Task]:
    """The tasks of the next seed of every grid cell that needs one (none: done)."""
    if not plan.grid:
        return []
    return [t for (wl, K, q), n in cells_needing_seeds(rows, plan.target_half_width,
                                                       plan.grid_max_seeds)
            for t in grid_cell_tasks(plan, wl, K, q, n)]
