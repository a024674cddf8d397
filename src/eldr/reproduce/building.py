"""Building the routing set-ups of a reproduction plan: each workload's trace, fitted.

:func:`build_setups` generates each synthetic workload's trace (or takes the one given)
and fits it; the shipped real request traces of the grid get :func:`_real_trace_setup`,
and the shipped tiny MoE's captured trace is fitted as it is. With a folder, each set-up's
large arrays go to memory-mapped files as soon as it is fitted
(:func:`eldr.reproduce.memmaps.share_setup`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from eldr.capture import tiny_moe_trace_path
from eldr.reproduce.memmaps import share_setup
from eldr.reproduce.plan import TINY_SETUP, Plan, grid_duration
from eldr.reproduce.setup import RoutingSetup, fit_setup, fit_split
from eldr.sim import SimConfig
from eldr.sim.steptime import StepModel
from eldr.traces import arrivals as arr
from eldr.traces.models import get_preset
from eldr.traces.synth import generate
from eldr.traces.trace import load

__all__ = ["build_setups"]


def build_setups(plan: Plan, *, trace=None, log=print,
                 folder: str | None = None) -> dict[str, RoutingSetup]:
    """Generate each workload's trace (or use ``trace`` for the first) and fit it; plus the
    per-token trace of the prefix experiment, the large model's trace of the EP one, the
    grid's real request traces and the tiny MoE's trace.

    ``folder``: as soon as a set-up is fitted, build its decode-token slab into a file
    there and move its held-out split's large arrays and signatures to files mapped
    read-only (:func:`~eldr.reproduce.memmaps.share_setup`), so this process never holds
    two set-ups' arrays at once."""
    setups = {}
    for n, (key, st) in enumerate(_fitted_setups(plan, trace, log)):
        if folder is not None:
            share_setup(st, os.path.join(folder, f"setup-{n}"))
        setups[key] = st
    return setups


def _fitted_setups(plan: Plan, trace, log) -> Iterator[tuple[str, RoutingSetup]]:
    """(set-up key, fitted set-up) in build order, one at a time: the next trace is made
    only once the caller has taken (and shared) the previous set-up."""
    jobs, real = _trace_jobs(plan)
    for n, (key, wl, model, num_requests, keep_topk) in enumerate(jobs):
        t0 = time.perf_counter()
        if n == 0 and trace is not None:
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
        log(f"[{key}] trace {num_requests} requests ({t1 - t0:.1f}s); calibration "
            f"{st.calib.num_requests}, held-out {st.eval.num_requests}; encoder rho "
            f"{st.encoder.rho_:.3f} on {st.encoder.layers_.size} layers "
            f"({st.fit_seconds:.1f}s)")
        yield key, st
    for wl in real:
        t0 = time.perf_counter()
        st = _real_trace_setup(plan, wl)
        log(f"[{wl}] {st.eval.num_requests} replayed arrivals (file {st.arrival_rate:.2f} "
            f"req/s), calibration {st.calib.num_requests} ({time.perf_counter() - t0:.1f}s); "
            f"encoder rho {st.encoder.rho_:.3f} on {st.encoder.layers_.size} layers")
        yield wl, st
    if plan.tiny:
        tr = load(tiny_moe_trace_path())
        st = fit_setup(tr, "tiny_moe", calib_requests=tr.num_requests // 3, seed=plan.seed,
                       selection_max_pairs=None, max_pairs=None)
        log(f"[{TINY_SETUP}] shipped trace {tr.num_requests} requests; calibration "
            f"{st.calib.num_requests}, held-out {st.eval.num_requests}; encoder rho "
            f"{st.encoder.rho_:.3f}")
        yield TINY_SETUP, st


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
