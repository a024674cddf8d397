"""The paper's experiments as simulation sweeps (docs/method.md#results-to-reproduce).

A :class:`Plan` fixes sizes (``QUICK`` for CI and a first look, ``FULL`` for the paper's
setting); :func:`run_plan` builds the traces and the routing set-ups, runs every
simulation (optionally in worker processes) and returns tidy rows:

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
import sys
import time
from dataclasses import dataclass, field, replace

from eldr.reproduce.setup import RoutingSetup, fit_setup
from eldr.sim import SimConfig, simulate
from eldr.sim.steptime import routing_resources

__all__ = ["FULL", "LOAD_BALANCERS", "QUICK", "Plan", "Task", "build_setups", "run_plan"]

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
    policies: tuple[str, ...] = (*LOAD_BALANCERS, "domain", "eldr", "oracle_signature")
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
    selection_max_pairs: int | None = 100_000  # layer-mask search pairs (encoder fit)
    max_pairs: int | None = 200_000  # pairs for the reported ρ
    hardware: str = "h200"


QUICK = Plan(
    name="quick", rates=(40, 80), warmup_s=5.0, duration_s=20.0,
    tau_values=(0.0, 0.1, 0.3, 1.0), tau_rate=80, pool_sizes=(8, 16, 24), pool_rates=(80,),
    selection_max_pairs=10_000, max_pairs=50_000,
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

    @property
    def variant(self) -> str:
        v = self.policy
        if self.policy in ("eldr", "oracle_signature", "eldr_top1"):
            v = f"{self.policy}[tau={self.tau:g},{self.kind}]"
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
            for p in (*LOAD_BALANCERS, "eldr"):
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
    return tasks


def build_setups(plan: Plan, *, trace=None, log=print) -> dict[str, RoutingSetup]:
    """Generate each workload's trace (or use ``trace`` for the first) and fit it; plus the
    per-token trace of the prefix experiment and the large model's trace of the EP one."""
    from eldr.traces.synth import generate

    wl0 = plan.workloads[0]
    jobs = [(wl, wl, plan.model, plan.num_requests, False) for wl in plan.workloads]
    if plan.prefix:
        jobs.append((f"{wl0}+topk", wl0, plan.model, plan.prefix_requests, True))
    if plan.ep_experiment:
        jobs.append((f"{wl0}@{plan.ep_model}", wl0, plan.ep_model, plan.ep_requests, False))
    setups = {}
    for n, (key, wl, model, num_requests, keep_topk) in enumerate(jobs):
        t0 = time.perf_counter()
        if n == 0 and trace is not None:
            tr = trace
        else:
            tr = generate(model, wl, num_requests=num_requests, seed=plan.trace_seed,
                          keep_topk=keep_topk)
        t1 = time.perf_counter()
        calib = min(plan.calib_requests, tr.num_requests // 2)
        setups[key] = fit_setup(tr, wl, calib_requests=calib, seed=plan.seed,
                                selection_max_pairs=plan.selection_max_pairs,
                                max_pairs=plan.max_pairs)
        st = setups[key]
        log(f"[{key}] trace {tr.num_requests} requests ({t1 - t0:.1f}s); calibration "
            f"{st.calib.num_requests}, held-out {st.eval.num_requests}; encoder rho "
            f"{st.encoder.rho_:.3f} on {st.encoder.layers_.size} layers "
            f"({st.fit_seconds:.1f}s)")
    return setups


_SETUPS: dict[str, RoutingSetup] = {}  # set before forking worker processes
_PLAN: Plan | None = None


def _config(plan: Plan, task: Task) -> SimConfig:
    src = task.signature_source
    warmup, duration = plan.warmup_s, plan.duration_s
    if src is not None:
        # Replayed trace requests repeat once arrivals outnumber them, and a repeat hits
        # the prefix cache with its WHOLE prompt: not what real traffic does. So the
        # prefix experiment stops arrivals before the held-out requests run out.
        horizon = min(warmup + duration,
                      0.95 * _SETUPS[task.workload].eval.num_requests / task.qps)
        warmup, duration = 0.2 * horizon, 0.8 * horizon
    return SimConfig(model=task.model or plan.model, hardware=plan.hardware,
                     num_prefill=task.num_prefill or plan.num_prefill,
                     num_decode=task.num_decode, qps=float(task.qps), warmup_s=warmup,
                     duration_s=duration, seed=plan.seed, tp=task.tp, ep=task.ep,
                     prefix_caching=src is not None, signature_source=src or "trace")


def run_task(task: Task) -> tuple[dict, list[dict]]:
    """Run one task on the module-level set-ups; returns (summary row, decoder rows)."""
    plan, st = _PLAN, _SETUPS[task.workload]
    config = _config(plan, task)
    policy = st.policy(task.policy, task.num_decode, tau=task.tau, seed=plan.seed,
                       kind=task.kind, **routing_resources(config))
    placement = None
    if task.ep > 1 and task.placement != "contiguous":
        placement = st.placement(task.num_decode, task.ep, task.placement)
    res = simulate(st.eval, config, policy, tokens=st.tokens,
                   placement=placement, encoder=st.encoder, **st.inputs(policy))
    head = {"experiment": task.experiment, "workload": task.workload,
            "variant": task.variant, "tau": task.tau, "kind": task.kind,
            "model": task.model or plan.model}
    row = {**head, **res.summary()}
    if "signature_exact" in res.requests:
        m = res.measured
        row["signature_exact_share"] = float(res.requests["signature_exact"][m].mean())
        row["prefix_hit_share"] = float((res.requests["cached_tokens"][m] > 0).mean())
    dec = [{**head, "qps": task.qps, **d} for d in res.decoder_table()] \
        if task.keep_decoders else []
    return row, dec


def _prime(task: Task) -> None:
    """Fit centroids in the parent so forked workers inherit them (no refits)."""
    st = _SETUPS[task.workload]
    st.prime(task.policy, task.num_decode, task.kind)
    if task.ep > 1 and task.placement != "contiguous":
        st.placement(task.num_decode, task.ep, task.placement)


@dataclass
class Results:
    """Rows of a finished plan and its timings."""

    plan: Plan
    rows: list[dict]
    decoder_rows: list[dict]
    setups: dict[str, RoutingSetup]
    seconds: dict[str, float] = field(default_factory=dict)


def run_plan(plan: Plan, *, jobs: int = 1, trace=None, log=print,
             progress: bool = True) -> Results:
    """Build set-ups and run every task of ``plan`` (``jobs`` worker processes)."""
    global _PLAN
    t0 = time.perf_counter()
    setups = build_setups(plan, trace=trace, log=log)
    t1 = time.perf_counter()
    _SETUPS.clear()
    _SETUPS.update(setups)
    _PLAN = plan
    tasks = plan_tasks(plan)
    for t in tasks:
        _prime(t)
    if jobs > 1:  # forked workers then share the decode-token rows copy-on-write
        for st in setups.values():
            st.tokens.build_all()
    t2 = time.perf_counter()
    log(f"fit centroids for {len({(t.num_decode, t.kind) for t in tasks})} pool sizes/kinds "
        f"({t2 - t1:.1f}s); running {len(tasks)} simulations with {jobs} process(es)")
    rows, dec_rows = [], []
    from eldr._progress import Progress

    with Progress(len(tasks), "reproduce", enabled=None if progress else False) as bar:
        if jobs > 1 and sys.platform != "win32":
            import multiprocessing as mp

            with mp.get_context("fork").Pool(jobs) as pool:
                for row, dec in pool.imap(run_task, tasks):
                    rows.append(row)
                    dec_rows += dec
                    bar.update(1)
        else:
            for t in tasks:
                row, dec = run_task(t)
                rows.append(row)
                dec_rows += dec
                bar.update(1)
    t3 = time.perf_counter()
    return Results(plan, rows, dec_rows, setups,
                   {"setup": t1 - t0, "centroids": t2 - t1, "simulate": t3 - t2,
                    "total": t3 - t0, "jobs": jobs, "cpus": os.cpu_count() or 1})


def with_overrides(plan: Plan, **changes) -> Plan:
    """A plan with some fields replaced (CLI overrides); ``None`` values are ignored."""
    return replace(plan, **{k: v for k, v in changes.items() if v is not None})
