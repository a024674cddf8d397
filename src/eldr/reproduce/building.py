"""Building the routing set-ups of a reproduction plan (split out of :mod:`eldr.reproduce.sweeps`).

:func:`build_setups` generates (or loads) each workload's trace and fits it; the shipped
real traces get :func:`_real_trace_setup`; :func:`_share` / :func:`_map_to_files` /
:func:`_to_file` move large arrays to read-only memory-mapped files.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from eldr.reproduce.setup import RoutingSetup, fit_setup
from eldr.sim import SimConfig

if TYPE_CHECKING:
    from eldr.reproduce.sweeps import Plan

__all__ = ["build_setups"]


def build_setups(plan: Plan, *, trace=None, log=print,
                 folder: str | None = None) -> dict[str, RoutingSetup]:
    """Generate each workload's trace (or use ``trace`` for the first) and fit it; plus the
    per-token trace of the prefix experiment and the large model's trace of the EP one.

    ``folder``: as soon as a set-up is fitted, build its decode-token slab into a file
    there and move its held-out split's large arrays and signatures to files mapped
    read-only (:func:`_share`), so this process never holds two set-ups' arrays at once."""
    from eldr.reproduce.sweeps import TINY_SETUP  # lazy: sweeps imports this module
    from eldr.traces.synth import generate

    wl0 = plan.workloads[0]
    jobs = [(wl, wl, plan.model, plan.num_requests, False) for wl in plan.workloads]
    if plan.prefix:
        jobs.append((f"{wl0}+topk", wl0, plan.model, plan.prefix_requests, True))
    if plan.ep_experiment:
        jobs.append((f"{wl0}@{plan.ep_model}", wl0, plan.ep_model, plan.ep_requests, False))
    from eldr.traces.arrivals import DEFAULT_ARRIVALS

    real = []
    for wl in plan.grid_workloads if plan.grid else ():
        if wl in DEFAULT_ARRIVALS:
            real.append(wl)
        elif wl not in {j[0] for j in jobs}:  # a synthetic workload only the grid uses
            jobs.append((wl, wl, plan.model, plan.num_requests, False))
    setups = {}
    for n, (key, wl, model, num_requests, keep_topk) in enumerate(jobs):
        t0 = time.perf_counter()
        if n == 0 and trace is not None:
            tr = trace
        else:
            tr = generate(model, wl, num_requests=num_requests, seed=plan.trace_seed,
                          keep_topk=keep_topk)
        t1 = time.perf_counter()
        # the count-based encoder and the simulator never read the summed gate outputs:
        # (R, L, E) float32 twice, half of a generated trace's bytes
        tr = replace(tr, prefill_gate_prob=None, prefill_gate_logit=None)
        calib = min(plan.calib_requests, tr.num_requests // 2)
        setups[key] = fit_setup(tr, wl, calib_requests=calib, seed=plan.seed,
                                selection_max_pairs=plan.selection_max_pairs,
                                max_pairs=plan.max_pairs)
        num_requests = tr.num_requests
        del tr  # the splits are copies; do not hold the whole trace while making the next
        st = setups[key]
        if folder is not None:
            _share(st, os.path.join(folder, f"setup-{n}"))
        log(f"[{key}] trace {num_requests} requests ({t1 - t0:.1f}s); calibration "
            f"{st.calib.num_requests}, held-out {st.eval.num_requests}; encoder rho "
            f"{st.encoder.rho_:.3f} on {st.encoder.layers_.size} layers "
            f"({st.fit_seconds:.1f}s)")
    n = len(jobs)
    for wl in real:
        t0 = time.perf_counter()
        st = setups[wl] = _real_trace_setup(plan, wl)
        if folder is not None:
            _share(st, os.path.join(folder, f"setup-{n}"))
        n += 1
        log(f"[{wl}] {st.eval.num_requests} replayed arrivals (file {st.arrival_rate:.2f} "
            f"req/s), calibration {st.calib.num_requests} ({time.perf_counter() - t0:.1f}s); "
            f"encoder rho {st.encoder.rho_:.3f} on {st.encoder.layers_.size} layers")
    if plan.tiny:
        from eldr.capture import tiny_moe_trace_path
        from eldr.reproduce.setup import fit_setup as fit
        from eldr.traces.trace import load

        tr = load(tiny_moe_trace_path())
        st = setups[TINY_SETUP] = fit(tr, "tiny_moe", calib_requests=tr.num_requests // 3,
                                      seed=plan.seed, selection_max_pairs=None,
                                      max_pairs=None)
        if folder is not None:
            _share(st, os.path.join(folder, f"setup-{n}"))
        log(f"[{TINY_SETUP}] shipped trace {tr.num_requests} requests; calibration "
            f"{st.calib.num_requests}, held-out {st.eval.num_requests}; encoder rho "
            f"{st.encoder.rho_:.3f}")
    return setups


def _real_trace_setup(plan: Plan, name: str) -> RoutingSetup:
    """The set-up of a shipped real trace for the grid: the file's first arrivals that any
    grid rate replays within the grid window, lengths clipped to what the model's context
    and one decoder's KV hold, routing for those lengths from one synthetic draw that also
    gives the calibration requests (:func:`eldr.traces.arrivals.calibration_and_replay`;
    the conversation traces use the ``language`` mixture)."""
    from eldr.reproduce.setup import fit_split
    from eldr.reproduce.sweeps import grid_duration  # lazy: sweeps imports this module
    from eldr.sim.steptime import StepModel
    from eldr.traces import arrivals as arr
    from eldr.traces.models import get_preset

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
                                           seed=plan.seed)
    st = fit_split(calib, ev, name, seed=plan.seed,
                   selection_max_pairs=plan.selection_max_pairs, max_pairs=plan.max_pairs)
    st.arrival_times = np.asarray(head.times, dtype=np.float64)
    st.arrival_rate = float(real.mean_rate)
    return st


def _share(setup: RoutingSetup, prefix: str) -> None:
    """Build the set-up's decode-token slab into a file (before its counts go to files:
    building reads them all) and move its held-out arrays and signatures to files."""
    setup.tokens.build_all(f"{prefix}-tokens.npy")
    _map_to_files(setup.eval, f"{prefix}-eval")
    setup.signatures = _to_file(setup.signatures, f"{prefix}-signatures.npy")


def _map_to_files(trace, prefix: str, min_bytes: int = 1 << 20) -> None:
    """Move the trace's large arrays into ``.npy`` files and map them read-only, in place.

    The values do not change, only where they live: this process no longer holds them in
    its own memory (it rarely reads them again), and joblib sends workers the file
    names, so every process maps one copy and reads in only the pages it touches.
    (Trace is frozen; its arrays are swapped without re-validating, which would read
    every page back in.)"""
    for name, arr in list(vars(trace).items()):
        if isinstance(arr, np.ndarray) and arr.nbytes >= min_bytes:
            object.__setattr__(trace, name, _to_file(arr, f"{prefix}-{name}.npy"))


def _to_file(arr: np.ndarray, path: str) -> np.ndarray:
    """``arr`` saved to ``path`` and mapped back read-only (a plain view of the map)."""
    if isinstance(arr.base, np.memmap):
        return arr
    np.save(path, arr)
    return np.load(path, mmap_mode="r").view(np.ndarray)
