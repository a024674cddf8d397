"""Running a reproduction plan's simulations (docs/simulator.md, "Running the sweep").

:func:`run_plan` builds the traces and the routing set-ups
(:func:`eldr.reproduce.building.build_setups`), turns each :class:`~eldr.reproduce.plan.Task`
of :func:`eldr.reproduce.plan.plan_tasks` into a self-contained :class:`SimJob`
(:func:`make_job`) and runs them through joblib (worker processes, or a dask / ray
cluster), and returns tidy rows in :class:`Results`.

Every run of one (workload, rate) replays the SAME arrivals and tokens (seeded), so the
policies are compared on identical input.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

from joblib import Parallel, delayed

from eldr._progress import Progress
from eldr.reproduce.building import build_setups
from eldr.reproduce.memmaps import map_to_files
from eldr.reproduce.plan import Plan, Task, plan_tasks
from eldr.reproduce.setup import RoutingSetup
from eldr.routing import decode_patterns
from eldr.sim import SimConfig, TokenBank, simulate
from eldr.sim.steptime import routing_resources

__all__ = ["Results", "SimJob", "make_job", "run_job", "run_plan", "run_task"]


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
                     duration_s=duration, seed=plan.seed, tp=task.tp, ep=task.ep,
                     prefix_caching=src is not None, signature_source=src or "trace")


def make_job(plan: Plan, setup: RoutingSetup, task: Task) -> SimJob:
    """The :class:`SimJob` of ``task`` on ``setup`` (fits centroids it needs if not yet)."""
    config = _config(plan, task, setup.eval.num_requests)
    policy = setup.policy(task.policy, task.num_decode, tau=task.tau, seed=plan.seed,
                          kind=task.kind, **routing_resources(config))
    inputs = setup.inputs(policy, patterns=False)
    if task.ep > 1 and task.placement != "contiguous":
        inputs["placement"] = setup.placement(task.num_decode, task.ep, task.placement)
    if config.signature_source != "trace":
        inputs["encoder"] = setup.encoder
    replay = setup.arrivals(task.qps, config.horizon_s)
    if replay is not None:  # a real trace: its own arrival process, scaled to the rate
        inputs["arrivals"] = replay
    head = {"experiment": task.experiment, "workload": task.workload,
            "variant": task.variant, "tau": task.tau, "kind": task.kind,
            "model": task.model or plan.model}
    return SimJob(task, config, policy, setup.tokens, inputs,
                  "decode_pattern" in policy.inputs, head)


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
    rows: list[dict]  # one summary row per task, in plan order
    decoder_rows: list[dict]  # per-decoder rows of the tasks that keep them
    setups: dict[str, RoutingSetup]  # set-up key → its fitted set-up
    seconds: dict[str, float] = field(default_factory=dict)  # phase → wall seconds


def run_plan(plan: Plan, *, jobs: int = 1, trace=None, log=print,
             progress: bool = True, backend: str | None = None) -> Results:
    """Build set-ups and run every task of ``plan`` through :class:`joblib.Parallel`.

    ``jobs`` worker processes (joblib's ``n_jobs``; 1 runs in this process); ``backend``:
    a joblib backend name (``None``: joblib's default, local processes; ``"dask"`` or
    ``"ray"`` send the same jobs to a cluster once registered). Every set-up's decode-token
    rows are built once into a memory-mapped file of a temporary folder, and its held-out
    arrays moved to files there (:func:`build_setups` with ``folder``), so all processes
    map one copy; other large arrays go to workers as joblib memory maps in that folder.
    """
    t0 = time.perf_counter()
    rows, dec_rows = [], []
    with tempfile.TemporaryDirectory(prefix="eldr-reproduce-", ignore_cleanup_errors=True) \
            as tmp:
        setups = build_setups(plan, trace=trace, log=log, folder=tmp)
        t1 = time.perf_counter()
        tasks = plan_tasks(plan)
        for t in tasks:  # fit every centroid set once, here, not in each worker
            st = setups[t.workload]
            st.prime(t.policy, t.num_decode, t.kind)
            if t.ep > 1 and t.placement != "contiguous":
                st.placement(t.num_decode, t.ep, t.placement)
        for n, st in enumerate(setups.values()):  # fitted: the parent is done with it
            map_to_files(st.calib, os.path.join(tmp, f"setup-{n}-calib"))
        t2 = time.perf_counter()
        log(f"fit centroids for {len({(t.num_decode, t.kind) for t in tasks})} pool "
            f"sizes/kinds ({t2 - t1:.1f}s); running {len(tasks)} simulations with {jobs} "
            "process(es)")
        parallel = Parallel(n_jobs=jobs, backend=backend, return_as="generator",
                            temp_folder=tmp, max_nbytes="1M")
        done: list = [None] * len(tasks)
        with Progress(len(tasks), "reproduce", enabled=None if progress else False) as bar:
            # One set-up at a time: all workers then read the same token slab, so the
            # machine holds one set-up's rows (up to 2 GB at full size), not two.
            for key, st in setups.items():
                idx = [i for i, t in enumerate(tasks) if t.workload == key]
                todo = (delayed(run_job)(make_job(plan, st, tasks[i])) for i in idx)
                for i, out in zip(idx, parallel(todo), strict=True):
                    done[i] = out
                    bar.update(1)
        for row, dec in done:  # rows in plan order
            rows.append(row)
            dec_rows += dec
        for st in setups.values():  # the slab's file goes with the folder
            st.tokens.drop_all()
    t3 = time.perf_counter()
    return Results(plan, rows, dec_rows, setups,
                   {"setup": t1 - t0, "centroids": t2 - t1, "simulate": t3 - t2,
                    "total": t3 - t0, "jobs": jobs, "cpus": os.cpu_count() or 1})

