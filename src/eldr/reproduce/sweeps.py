"""The paper's experiments as simulation sweeps (docs/method.md#results-to-reproduce).

A :class:`Plan` fixes sizes (``QUICK`` for CI and a first look, ``FULL`` for the paper's
setting); :func:`plan_tasks` lists its simulations as :class:`Task` rows; :func:`run_plan`
builds the traces and the routing set-ups, turns each task into a self-contained
:class:`SimJob` and runs them through joblib (worker processes, or a dask / ray cluster),
and returns tidy rows:

- ``main``: every policy × rate × workload at 8P16D (median/p99 TPOT, median TTFT);
  includes ``domain`` (oracle labels) and ``oracle_signature`` (perfect-signature bound);
- ``tau``: ELDR's band width τ on ``task`` at one rate (τ = 0 is top-1, 1 is JSQ);
- ``pool``: decode pools of 8 / 16 / 24 workers (8 prefill), load balancers vs ELDR;
- ``vanilla``: ELDR with vanilla (unbalanced) K-means centroids, every rate;
- ``decoders``: per-decoder batch, distinct experts and request share at one rate.

Every run of one (workload, rate) replays the SAME arrivals and tokens (seeded), so the
policies are compared on identical input.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

from eldr.reproduce.building import _map_to_files, build_setups
from eldr.reproduce.setup import RoutingSetup
from eldr.routing import decode_patterns
from eldr.sim import SimConfig, TokenBank, simulate
from eldr.sim.steptime import routing_resources

__all__ = ["FULL", "LOAD_BALANCERS", "QUICK", "Plan", "SimJob", "Task", "build_setups",
           "make_job", "plan_tasks", "run_job", "run_plan", "run_task"]

LOAD_BALANCERS = ("random", "round_robin", "jsq", "p2c")


@dataclass(frozen=True)
class Plan:
    """Sizes of a reproduction run."""

    name: str  # "quick" or "full"
    model: str = "qwen3-30b-a3b"  # model preset (trace generator and step time)
    workloads: tuple[str, ...] = ("task", "language")
    num_requests: int | None = 2000  # trace size per workload (None: workload default)
    calib_requests: int = 1000  # calibration split (paper: ~1,000 prompts)
    trace_seed: int = 20260402  # eldr.traces.synth's DEFAULT_TRACE seed
    seed: int = 0  # arrivals, tokens, K-means
    rates: tuple[float, ...] = (20, 40, 60, 80, 100)
    warmup_s: float = 30.0
    duration_s: float = 120.0
    num_prefill: int = 8
    num_decode: int = 16
    policies: tuple[str, ...] = (*LOAD_BALANCERS, "domain", "eldr", "eldr_cost",
                                 "oracle_signature")
    tau: float = 0.1
    tau_values: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
    tau_rate: float = 80
    pool_sizes: tuple[int, ...] = (8, 16, 24)
    pool_rates: tuple[float, ...] = (20, 40, 60, 80, 100)
    vanilla: bool = True
    # prefix caching (task, tau_rate): ELDR through the signature cache vs fresh-token counts;
    # needs a per-token trace (slow to generate), so "full" only
    prefix: bool = False
    prefix_requests: int = 2000
    # expert parallelism: Qwen3-235B-A22B at TP4/EP4, 2P8D (paper §6), task workload;
    # placements: vLLM's contiguous layout, one global greedy layout, per-decoder layouts
    ep_experiment: bool = False
    ep_model: str = "qwen3-235b-a22b"
    ep_requests: int = 2000
    ep_num_prefill: int = 2
    ep_num_decode: int = 8
    ep_tp: int = 4
    ep: int = 4
    ep_rates: tuple[float, ...] = (10, 20, 30, 40)
    # "never worse than load balancing": every (workload, decode pool, rate) cell with
    # short windows; azure_conv / mooncake_conv replay real arrivals and lengths
    grid: bool = True
    grid_workloads: tuple[str, ...] = ("task", "language", "azure_conv", "mooncake_conv")
    grid_pools: tuple[int, ...] = (8, 16, 24, 32)
    grid_rates: tuple[float, ...] = (5, 10, 20, 40, 60, 80, 100)
    grid_warmup_s: float = 10.0
    grid_duration_s: float = 40.0
    # a low-rate cell measures at least this many requests (longer window): a p99 of a few
    # hundred requests moves by several percent between seeds
    grid_min_requests: int = 2000
    # the shipped tiny MoE's real captured trace on its measured CPU preset
    tiny: bool = True
    tiny_rates: tuple[float, ...] = (10, 40, 100, 160, 220)
    tiny_num_prefill: int = 8
    tiny_num_decode: int = 4
    tiny_warmup_s: float = 10.0
    tiny_duration_s: float = 60.0
    selection_max_pairs: int | None = 100_000  # layer-mask search pairs (encoder fit)
    max_pairs: int | None = 200_000  # pairs for the reported ρ
    hardware: str = "h200"


QUICK = Plan(
    name="quick", rates=(40, 80), warmup_s=5.0, duration_s=20.0,
    tau_values=(0.0, 0.1, 0.3, 1.0), tau_rate=80, pool_sizes=(8, 16, 24), pool_rates=(80,),
    selection_max_pairs=10_000, max_pairs=50_000,
    grid_workloads=("task", "azure_conv"), grid_pools=(8, 16), grid_rates=(10, 60),
    grid_warmup_s=5.0, grid_duration_s=15.0, grid_min_requests=300, tiny_rates=(40, 160),
    tiny_warmup_s=5.0,
    tiny_duration_s=20.0,
)
FULL = Plan(name="full", num_requests=None, pool_rates=(20, 60, 100), prefix=True,
            ep_experiment=True)


@dataclass(frozen=True)
class Task:
    """One simulation run."""

    experiment: str  # main / tau / pool / vanilla / prefix / ep
    workload: str  # key of the routing set-up (workload, or workload@model, workload+topk)
    policy: str
    qps: float
    num_decode: int
    tau: float
    kind: str = "balanced"  # centroid kind for eldr: balanced / vanilla
    keep_decoders: bool = False  # also return per-decoder rows
    num_prefill: int | None = None  # None: the plan's
    model: str | None = None  # None: the plan's
    tp: int = 1
    ep: int = 1
    placement: str = "contiguous"  # EP layout: contiguous / global / per_decoder
    signature_source: str | None = None  # prefix caching on with this source; None: off
    warmup_s: float | None = None  # None: the plan's
    duration_s: float | None = None  # None: the plan's
    hardware: str | None = None  # None: the plan's

    @property
    def variant(self) -> str:
        v = self.policy
        if self.policy in ("eldr", "oracle_signature", "eldr_top1"):
            v = f"{self.policy}[tau={self.tau:g},{self.kind}]"
        elif self.policy == "eldr_cost" and self.kind != "balanced":
            v = f"eldr_cost[{self.kind}]"  # "online": no fitted cluster profiles
        if self.signature_source is not None:
            v += f"+prefix[{self.signature_source}]"
        if self.ep > 1:
            v += f"+ep[{self.placement}]"
        return v


def plan_tasks(plan: Plan) -> list[Task]:
    """All runs of a plan, without duplicates (later experiments reuse ``main`` rows)."""
    tasks: list[Task] = []
    K = plan.num_decode
    for wl in plan.workloads:
        for q in plan.rates:
            for p in plan.policies:
                tasks.append(Task("main", wl, p, q, K, plan.tau,
                                  keep_decoders=q == plan.tau_rate))
            if "eldr_cost" in plan.policies:  # its calibration-free form too
                tasks.append(Task("main", wl, "eldr_cost", q, K, plan.tau, kind="online"))
    wl0 = plan.workloads[0]
    for tau in plan.tau_values:
        if tau != plan.tau or plan.tau_rate not in plan.rates:
            tasks.append(Task("tau", wl0, "eldr", plan.tau_rate, K, tau))
    if plan.tau_rate not in plan.rates:
        tasks += [Task("tau", wl0, p, plan.tau_rate, K, plan.tau) for p in LOAD_BALANCERS]
    for k in plan.pool_sizes:
        for q in plan.pool_rates:
            if k == K and q in plan.rates:
                continue
            for p in (*LOAD_BALANCERS, "eldr", "eldr_cost"):
                tasks.append(Task("pool", wl0, p, q, k, plan.tau))
    if plan.vanilla:
        for wl in plan.workloads:
            for q in plan.rates:
                tasks.append(Task("vanilla", wl, "eldr", q, K, plan.tau, kind="vanilla"))
    if plan.prefix:
        key = f"{wl0}+topk"
        for p in LOAD_BALANCERS:
            tasks.append(Task("prefix", key, p, plan.tau_rate, K, plan.tau,
                              signature_source="trace"))
        for src in ("sigcache", "fresh"):
            tasks.append(Task("prefix", key, "eldr", plan.tau_rate, K, plan.tau,
                              signature_source=src))
    if plan.ep_experiment:
        key = f"{wl0}@{plan.ep_model}"
        common = dict(num_prefill=plan.ep_num_prefill, model=plan.ep_model, tp=plan.ep_tp,
                      ep=plan.ep)
        for q in plan.ep_rates:
            for p in LOAD_BALANCERS:
                for layout in ("contiguous", "global"):
                    tasks.append(Task("ep", key, p, q, plan.ep_num_decode, plan.tau,
                                      placement=layout, **common))
            for layout in ("contiguous", "global", "per_decoder"):
                tasks.append(Task("ep", key, "eldr", q, plan.ep_num_decode, plan.tau,
                                  placement=layout, **common))
    if plan.grid:
        from eldr.reproduce.grid import GRID_BALANCERS, GRID_POLICIES

        for wl in plan.grid_workloads:
            for k in plan.grid_pools:
                for q in plan.grid_rates:
                    win = dict(warmup_s=plan.grid_warmup_s, duration_s=grid_duration(plan, q))
                    for p in (*GRID_BALANCERS, *GRID_POLICIES):
                        tasks.append(Task("grid", wl, p, q, k, plan.tau, **win))
    if plan.tiny:
        common = dict(num_prefill=plan.tiny_num_prefill, model="tiny-moe", hardware="cpu",
                      warmup_s=plan.tiny_warmup_s, duration_s=plan.tiny_duration_s)
        for q in plan.tiny_rates:
            for p in (*LOAD_BALANCERS, "eldr", "eldr_cost"):
                tasks.append(Task("tiny", TINY_SETUP, p, q, plan.tiny_num_decode, plan.tau,
                                  **common))
    return tasks


TINY_SETUP = "tiny_moe"  # set-up key of the shipped tiny-MoE trace


def grid_duration(plan: Plan, qps: float) -> float:
    """Measured seconds of a grid cell: the plan's window, longer at low rates so that
    every cell measures about ``grid_min_requests`` requests."""
    return max(plan.grid_duration_s, plan.grid_min_requests / float(qps))




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

    plan: Plan
    rows: list[dict]
    decoder_rows: list[dict]
    setups: dict[str, RoutingSetup]
    seconds: dict[str, float] = field(default_factory=dict)


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
    import tempfile

    from joblib import Parallel, delayed

    from eldr._progress import Progress

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
            _map_to_files(st.calib, os.path.join(tmp, f"setup-{n}-calib"))
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


def with_overrides(plan: Plan, **changes) -> Plan:
    """A plan with some fields replaced (CLI overrides); ``None`` values are ignored."""
    return replace(plan, **{k: v for k, v in changes.items() if v is not None})
