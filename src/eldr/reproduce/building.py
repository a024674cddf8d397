"""Building the routing set-ups of a reproduction plan: each workload's trace, fitted.

:func:`build_setups` generates each synthetic workload's trace (or takes the one given)
and fits it; the shipped real request traces of the grid get :func:`_real_trace_setup`,
and the shipped tiny MoE's captured trace is fitted as it is. Each set-up is then primed
with the centroid sets its tasks use. Small plans build two set-ups at a time in worker
processes (:func:`setup_jobs`). With a folder, each set-up's large arrays go to
memory-mapped files as soon as it is fitted (:func:`eldr.reproduce.memmaps.share_setup`).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
from joblib import Parallel, delayed

from eldr.capture import tiny_moe_trace_path
from eldr.reproduce.memmaps import share_setup, slab_path
from eldr.reproduce.plan import TINY_SETUP, Plan, Task, grid_duration, plan_tasks
from eldr.reproduce.setup import RoutingSetup, fit_setup, fit_split
from eldr.sim import SimConfig
from eldr.sim.steptime import StepModel
from eldr.traces import arrivals as arr
from eldr.traces.models import get_preset
from eldr.traces.synth import generate
from eldr.traces.trace import load
from eldr.traces.workloads import get_workload

__all__ = ["build_setups", "prime_setup", "setup_jobs"]


def build_setups(plan: Plan, *, trace=None, log=print, folder: str | None = None,
                 jobs: int | None = None) -> dict[str, RoutingSetup]:
    """Generate each workload's trace (or use ``trace`` for the first) and fit it; plus the
    per-token trace of the prefix experiment, the large model's trace of the EP one, the
    grid's real request traces and the tiny MoE's trace. Each set-up also fits every
    centroid set, cluster profile and expert layout the plan's tasks use
    (:func:`prime_setup`), so the sweep finds them made.

    ``jobs``: set-ups built at once, each in a worker process (joblib), which returns it
    fitted; ``None`` (default) takes two when the machine has two CPUs and every trace is
    small (:func:`setup_jobs`), else one, in this process. The set-ups are independent
    (their own seeds and streams) and a worker's BLAS runs one thread, which gives the
    same bits: the set-ups come out identical either way.

    ``folder``: as soon as a set-up is fitted, the process that fitted it (a worker, or
    this one) builds its decode-token slab into a file there, and this process maps it and
    moves the held-out split's large arrays and signatures to files mapped read-only
    (:func:`~eldr.reproduce.memmaps.share_setup`), so this process holds one set-up's
    arrays at a time (workers hold their own while they build) and the slabs, seconds
    each, are built two at a time as well."""
    units = _setup_units(plan)
    jobs = setup_jobs(plan) if jobs is None else max(1, int(jobs))
    tasks = plan_tasks(plan)
    prefixes = [None if folder is None else os.path.join(folder, f"setup-{n}")
                for n in range(len(units))]
    args = [(plan, unit, trace if n == 0 else None, tasks, prefixes[n])
            for n, unit in enumerate(units)]
    if jobs == 1 or len(units) == 1:
        built = (_build_unit(*a) for a in args)
    else:
        built = Parallel(n_jobs=min(jobs, len(units)), return_as="generator")(
            delayed(_build_unit)(*a) for a in args)
    setups = {}
    for prefix, (key, st, message) in zip(prefixes, built, strict=True):
        if prefix is not None:
            share_setup(st, prefix, slab_built=True)
        log(message)
        setups[key] = st
    return setups


# Largest trace (requests) whose set-ups are built two at a time by default: a generated
# trace's arrays and fit take ~0.1 GB per 1,000 requests, so two quick-size set-ups cost
# ~0.5 GB more than one, while two full-size ones (12k-14k requests) would push the run
# past its memory target.
_PARALLEL_MAX_REQUESTS = 4000


def setup_jobs(plan: Plan) -> int:
    """Set-ups :func:`build_setups` builds at once by default: 2 when this process may use
    two CPUs and no synthetic trace of the plan exceeds 4,000 requests (``--quick``; the
    real traces' replayed heads are of that order there), else 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    jobs, _ = _trace_jobs(plan)
    sizes = [n if n is not None else get_workload(wl).num_requests
             for _, wl, _, n, _ in jobs]
    small = all(n <= _PARALLEL_MAX_REQUESTS for n in sizes)
    return 2 if cpus >= 2 and small else 1


def _setup_units(plan: Plan) -> list[tuple]:
    """The set-ups to build, in build order: ("synth", key, workload, model, requests,
    keep_topk) rows, then ("real", name) and ("tiny",)."""
    jobs, real = _trace_jobs(plan)
    units: list[tuple] = [("synth", *job) for job in jobs]
    units += [("real", wl) for wl in real]
    if plan.tiny:
        units.append(("tiny",))
    return units


def _build_unit(plan: Plan, unit: tuple, trace, tasks: list[Task], prefix: str | None = None
                ) -> tuple[str, RoutingSetup, str]:
    """(set-up key, fitted and primed set-up, its log line) of one unit of
    :func:`_setup_units`; ``trace``: use it instead of generating (first unit only). The
    log line ends with the unit's wall times.

    ``prefix``: also write the set-up's decode-token slab to
    :func:`~eldr.reproduce.memmaps.slab_path` of it and return the bank without it (the
    caller maps the file: a returned slab would be pickled back whole)."""
    t0 = time.perf_counter()
    if unit[0] == "synth":
        key, st, message = _synthetic_setup(plan, *unit[1:], trace=trace)
    elif unit[0] == "real":
        key, st = unit[1], _real_trace_setup(plan, unit[1])
        message = (f"[{key}] {st.eval.num_requests} replayed arrivals (file "
                   f"{st.arrival_rate:.2f} req/s), calibration {st.calib.num_requests} "
                   f"({time.perf_counter() - t0:.1f}s); encoder rho {st.encoder.rho_:.3f} "
                   f"on {st.encoder.layers_.size} layers")
    else:
        tr = load(tiny_moe_trace_path())
        key = TINY_SETUP
        st = fit_setup(tr, "tiny_moe", calib_requests=tr.num_requests // 3, seed=plan.seed,
                       selection_max_pairs=None, max_pairs=None)
        message = (f"[{TINY_SETUP}] shipped trace {tr.num_requests} requests; calibration "
                   f"{st.calib.num_requests}, held-out {st.eval.num_requests}; encoder rho "
                   f"{st.encoder.rho_:.3f}")
    t1 = time.perf_counter()
    prime_setup(st, [t for t in tasks if t.workload == key])
    message += f"; centroid sets {time.perf_counter() - t1:.1f}s"
    if prefix is not None:
        t2 = time.perf_counter()
        st.tokens.build_all(slab_path(prefix))
        st.tokens.drop_all()
        message += f"; token slab {time.perf_counter() - t2:.1f}s"
    return key, st, f"{message}; set-up {time.perf_counter() - t0:.1f}s"


def prime_setup(setup: RoutingSetup, tasks: list[Task]) -> None:
    """Fit every centroid set, cluster profile and expert layout ``tasks`` (of this
    set-up) use, once; :func:`eldr.reproduce.sweeps.prime_setups` then finds them made."""
    for t in tasks:
        setup.prime(t.policy, t.num_decode, t.kind)
        if t.ep > 1 and t.placement != "contiguous":
            setup.placement(t.num_decode, t.ep, t.placement)


def _synthetic_setup(plan: Plan, key: str, wl: str, model: str, num_requests: int | None,
                     keep_topk: bool, *, trace=None) -> tuple[str, RoutingSetup, str]:
    """Generate (or take ``trace``) and fit one synthetic workload's set-up."""
    t0 = time.perf_counter()
    if trace is not None:
        tr = trace
    else:
        tr = generate(model, wl, num_requests=num_requests, seed=plan.trace_seed,
                      keep_topk=keep_topk, gate_sums=False)
    t1 = time.perf_counter()
    # the count-based encoder and the simulator never read the summed gate outputs:
    # (R, L, E) float32 twice, half of a generated trace's bytes, so they are not made
    # (generate's gate_sums=False, same counts) and a given trace's are dropped
    tr = replace(tr, prefill_gate_prob=None, prefill_gate_logit=None)
    calib = min(plan.calib_requests, tr.num_requests // 2)
    st = fit_setup(tr, wl, calib_requests=calib, seed=plan.seed,
                   selection_max_pairs=plan.selection_max_pairs, max_pairs=plan.max_pairs)
    num_requests = tr.num_requests
    del tr  # the splits are copies; do not hold the whole trace while making the next
    message = (f"[{key}] trace {num_requests} requests ({t1 - t0:.1f}s); calibration "
               f"{st.calib.num_requests}, held-out {st.eval.num_requests}; encoder rho "
               f"{st.encoder.rho_:.3f} on {st.encoder.layers_.size} layers "
               f"({st.fit_seconds:.1f}s)")
    return key, st, message


def _trace_jobs(plan: Plan) -> tuple[list[tuple], list[str]]:
    """The synthetic traces to generate, as (set-up key, workload, model, requests,
    keep_topk) rows in build order, and the grid's real request traces (their names)."""
    wl0 = plan.workloads[0]
    jobs = [(wl, wl, plan.model, plan.num_requests, False) for wl in plan.workloads]
    if plan.prefix:
        jobs.append((f"{wl0}+topk", wl0, plan.model, plan.prefix_requests, True))
    if plan.ep_experiment:
        jobs.append((f"{wl0}@{plan.ep_model}", wl0, plan.ep_model, plan.ep_requests, False))
    real = []
    for wl in plan.grid_workloads if plan.grid else ():
        if wl in arr.DEFAULT_ARRIVALS:
            real.append(wl)
        elif wl not in {j[0] for j in jobs}:  # a synthetic workload only the grid uses
            jobs.append((wl, wl, plan.model, plan.num_requests, False))
    return jobs, real


def _real_trace_setup(plan: Plan, name: str) -> RoutingSetup:
    """The set-up of a shipped real trace for the grid: the file's first arrivals that any
    grid rate replays within the grid window, lengths clipped to what the model's context
    and one decoder's KV hold, routing for those lengths from one synthetic draw that also
    gives the calibration requests (:func:`eldr.traces.arrivals.calibration_and_replay`;
    the conversation traces use the ``language`` mixture)."""
    real = arr.default_arrivals(name)
    n = 1 + max(int(np.searchsorted(real.times * (real.mean_rate / q),
                                    plan.grid_warmup_s + grid_duration(plan, q), side="left"))
                for q in plan.grid_rates)
    head = arr.head(real, n)
    model = get_preset(plan.model)
    kv = StepModel(SimConfig(model=plan.model, hardware=plan.hardware)).kv_capacity_bytes
    fit = int((kv - model.kv_fixed_bytes_per_request) // model.kv_bytes_per_token)
    limit = fit if model.max_context_tokens is None else min(fit, model.max_context_tokens)
    calib, ev = arr.calibration_and_replay(arr.clip_lengths(head, limit), plan.model,
                                           "language", num_calibration=plan.calib_requests,
                                           seed=plan.seed, gate_sums=False)
    st = fit_split(calib, ev, name, seed=plan.seed,
                   selection_max_pairs=plan.selection_max_pairs, max_pairs=plan.max_pairs)
    st.arrival_times = np.asarray(head.times, dtype=np.float64)
    st.arrival_rate = float(real.mean_rate)
    return st
