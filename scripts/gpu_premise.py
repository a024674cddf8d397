#!/usr/bin/env python3
"""Measure, in one command, what the simulator's step-time model needs from a lent GPU.

    python3 scripts/gpu_premise.py --out DIR [--budget-s 240]     # on a GPU (CUDA)
    python3 scripts/gpu_premise.py --out DIR --cpu                # smoke run, < 60 s

Steps, each printed as it runs (``[  12.3 s] ...``), all under ``--budget-s``:

1. **Micro-benchmarks**: a large device-to-device copy (bytes read + written per second:
   ``hbm_bandwidth``) and a dense square matmul (``peak_flops``), medians of repeats.
2. **One MoE layer against the number of distinct experts D and the batch B**, with random
   weights at a model's dimensions (Qwen3-30B-A3B: hidden 2048, expert width 768, 128
   experts, top-8; also the shipped tiny MoE's). The router runs, then its top-k ids are
   FORCED: slot j of token t gets expert ``perm[(t·k + j) mod D]``, so exactly D distinct
   experts run (k ≤ D ≤ min(E, B·k)). Experts are computed by ``torch._grouped_mm`` over
   all E experts with empty groups for the unselected ones (one kernel per projection, as
   fused-MoE kernels do; an empty group computes nothing, and the fitted b shows whether
   its weights are read anyway), or, where this torch lacks it or it disagrees with the reference,
   by a loop over the selected experts (``index_select`` + ``mm``); ``premise.json`` says
   which. On a GPU each cell is captured as a CUDA graph where possible (decode runs under
   graphs in vLLM) and timed with CUDA events after a write that evicts L2, so every
   expert's weights come from HBM as in a 48-layer model; on a CPU with the thread's CPU
   time (:class:`CpuTimer`). Cells × repeats are visited in a seeded random order (drift hits
   every cell alike, and a budget cut leaves every cell with about as many repeats); the
   median per cell is fitted by least squares to ``t = a + b·D + c·B`` and, per B, to
   ``t = a + b·D``.
3. **A transformers capture of the shipped tiny MoE** on 16 prompts of four domains with
   :func:`eldr.capture.hf.capture_ids` (``<repo>/src`` is put on ``sys.path``; that chain
   needs numpy, torch and transformers only). Where eldr's capture cannot run, the same
   greedy loop runs here with hooks on the routers; ``premise.json`` says which path ran.

Writes into ``--out``: ``hardware.json`` (format ``eldr-hardware/1``, for ``eldr simulate
--hardware``), ``premise.json`` (every figure, the tables, fits, versions, the paths taken,
errors), ``capture_tiny.npz`` (per-request expert counts) and, from eldr's path,
``capture_tiny_trace.npz`` (an eldr trace). Exit code 0: all done; 2: hardware.json
written but the capture failed; 1: no MoE fit, so no hardware.json. docs/gpu.md explains
the figures and how to use them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
TINY_DIR = SRC / "eldr" / "data" / "tiny_moe"
T_FIXED_S = 0.002  # assumed, as the h200 preset (docs/simulator.md); not measured here


@dataclass(frozen=True)
class MoeShape:
    """The routed-expert part of one MoE layer, named as eldr's model preset."""

    model: str  # eldr model preset the fit is stored under
    hidden: int  # model width H
    intermediate: int  # one expert's FFN width I (gate and up are H x I, down I x H)
    num_experts: int  # E routed experts
    top_k: int  # k experts per token
    num_layers: int  # MoE layers of the model (the fit is of ONE layer)

    def distincts(self) -> tuple[int, ...]:
        """D values swept: E × (1/16, 1/8, 1/4, 1/2, 3/4, 1), none below k."""
        ds = {max(self.top_k, self.num_experts * n // 16) for n in (1, 2, 4, 8, 12, 16)}
        return tuple(sorted(ds))

    def expert_bytes(self, itemsize: int) -> int:
        return 3 * self.hidden * self.intermediate * itemsize


QWEN3_30B = MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, 48)
TINY_MOE = MoeShape("tiny-moe", 128, 32, 64, 4, 6)

# 16 prompts, 4 per domain, of the kinds the tiny MoE was trained on (code, licences,
# PARI/GP-style maths, ICD-style medical text); written for this script.
PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", 'def load_settings(path):\n    """Read a settings file."""\n    with open(path'),
    ("code", "import os\nimport sys\n\nclass Cache:\n    def __init__(self, size):\n"),
    ("code", "for index, value in enumerate(items):\n    if value is None:\n        continue\n"),
    ("code", "try:\n    result = parse(text)\nexcept ValueError as exc:\n    raise"),
    ("legal", "Permission is granted to copy and distribute this software, provided that"),
    ("legal", "THE SOFTWARE IS PROVIDED WITHOUT WARRANTY OF ANY KIND. IN NO EVENT SHALL"),
    ("legal", "Redistribution in binary form must reproduce the above copyright notice,"),
    ("legal", "You may not impose any further restrictions on the exercise of the rights"),
    ("math", "\\subsec{ellinit}{$(x)$}: initializes an elliptic curve given by its"),
    ("math", "Let $p$ be a prime and $K$ a number field. The function returns the valuation"),
    ("math", "\\fun{GEN}{gadd}{GEN x, GEN y} returns the sum $x + y$ of two objects"),
    ("math", "The polynomial $f = x^3 - 2$ is irreducible over $\\Q$ and its discriminant"),
    ("medical", "Type 2 diabetes mellitus with diabetic chronic kidney disease"),
    ("medical", "Fracture of shaft of left femur, initial encounter for closed fracture"),
    ("medical", "Acute bronchitis due to respiratory syncytial virus"),
    ("medical", "Essential (primary) hypertension. Excludes: hypertensive heart disease"),
)


class Clock:
    """Seconds since the start, a deadline, and progress lines on stdout."""

    def __init__(self, budget_s: float, *, started: float | None = None) -> None:
        self.t0 = time.monotonic() if started is None else started
        self.deadline = self.t0 + budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)


# -- timing ---------------------------------------------------------------------------------
class CudaTimer:
    """Times ``fn()`` between two CUDA events; results come back on :meth:`collect`.

    ``flush_bytes`` > 0: a buffer that large is overwritten before each timed call (outside
    the events), so weights the previous call read are no longer in L2.
    """

    def __init__(self, flush_bytes: int = 0) -> None:
        import torch

        self.torch = torch
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda") \
            if flush_bytes else None
        self.pending: list = []

    def visit(self, key, fn: Callable[[], object]) -> None:
        if self.flush is not None:
            self.flush.zero_()
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        self.pending.append((key, start, end))

    def collect(self) -> list[tuple[object, float]]:
        self.torch.cuda.synchronize()
        out = [(k, s.elapsed_time(e) * 1e-3) for k, s, e in self.pending]
        self.pending = []
        return out


class CpuTimer:
    """Times ``inner`` calls of ``fn()``; seconds per call.

    The clock is ``time.thread_time``, the CPU time of the calling thread: torch runs on
    that one thread (``set_num_threads(1)``), and time the core spends on other processes
    of a shared machine is not counted (with wall-clock time a loaded 2-core machine made
    the fitted b negative).
    """

    def __init__(self, inner: int) -> None:
        self.inner = inner
        self.pending: list = []

    def visit(self, key, fn: Callable[[], object]) -> None:
        t0 = time.thread_time()
        for _ in range(self.inner):
            fn()
        self.pending.append((key, (time.thread_time() - t0) / self.inner))

    def collect(self) -> list[tuple[object, float]]:
        out, self.pending = self.pending, []
        return out


def median_time(timer, fn: Callable[[], object], *, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` timed calls after ``warmup`` untimed."""
    for _ in range(warmup):
        fn()
    for _ in range(repeats):
        timer.visit(None, fn)
    return float(np.median([t for _, t in timer.collect()]))


def _time_copy(n: int, device: str, dtype, timer, repeats: int) -> float:
    """Median seconds of copying ``n`` elements; both buffers are freed on return."""
    import torch

    src = torch.ones(n, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    return median_time(timer, lambda: dst.copy_(src), warmup=3, repeats=repeats)


def measure_device(device: str, dtype, *, copy_bytes: int, matmul_n: int, timer,
                   repeats: int) -> dict:
    """Copy bandwidth (bytes read + written per second) and dense matmul FLOP/s.

    Read + written, as bandwidth tests count a copy: the weight reads of decode are one
    direction only, so compare ``b`` with ``expert_bytes / hbm_bandwidth`` knowing that a
    copy's mix of reads and writes runs a little below a pure read stream.
    """
    import torch

    n = copy_bytes // torch.empty((), dtype=dtype).element_size()
    moved = 2 * n * torch.empty((), dtype=dtype).element_size()  # bytes read + written
    t_copy = _time_copy(n, device, dtype, timer, repeats)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(matmul_n, matmul_n, generator=g, device=device, dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, generator=g, device=device, dtype=dtype)
    t_mm = median_time(timer, lambda: a @ b, warmup=3, repeats=repeats)
    return {"copy_bytes": moved, "copy_s": t_copy, "hbm_bandwidth": moved / t_copy,
            "matmul_n": matmul_n, "matmul_s": t_mm, "peak_flops": 2 * matmul_n ** 3 / t_mm}


# -- the MoE layer --------------------------------------------------------------------------
def forced_ids(num_tokens: int, num_distinct: int, top_k: int, num_experts: int,
               rng: np.random.Generator) -> np.ndarray:
    """(B, k) int64 expert ids whose union is exactly ``num_distinct`` experts.

    Slot j of token t gets ``perm[(t·k + j) mod D]``: k consecutive slots mod D are distinct
    since D ≥ k, and the B·k ≥ D slots cover all D.
    """
    if not top_k <= num_distinct <= min(num_experts, num_tokens * top_k):
        raise ValueError(f"D={num_distinct} needs k={top_k} <= D <= min(E, B*k)="
                         f"{min(num_experts, num_tokens * top_k)}")
    perm = rng.permutation(num_experts)[:num_distinct]
    return perm[np.arange(num_tokens * top_k).reshape(num_tokens, top_k) % num_distinct]


class MoeLayer:
    """A Qwen3-MoE sparse block (router, softmax, top-k renormalised, SwiGLU experts) with
    random weights: ``router`` (H, E), ``w_gate_up`` (E, H, 2I), ``w_down`` (E, I, H).

    ``forward(x, ids)`` takes x (B, H) and forced ids (B, k) int64 and returns (B, H). The
    router's logits are computed (their cost belongs to the layer) and its probabilities
    are read at the forced ids. Slots are sorted by expert on the device, as fused-MoE
    kernels do; ``impl`` "grouped_mm" runs each projection as one grouped GEMM over all E
    experts (an unselected expert is an empty group whose weights are never read), "loop"
    one ``mm`` per selected expert, whose slot ranges ``groups`` the caller computed on
    the host from the same ids (no device→host sync inside the timed call).
    """

    def __init__(self, shape: MoeShape, *, device: str, dtype, seed: int) -> None:
        import torch

        hidden, inter, E = shape.hidden, shape.intermediate, shape.num_experts
        g = torch.Generator(device=device).manual_seed(seed)
        kw = {"generator": g, "device": device, "dtype": dtype}
        self.shape = shape
        self.router = torch.randn(hidden, E, **kw).mul_(hidden ** -0.5)
        self.w_gate_up = torch.randn(E, hidden, 2 * inter, **kw).mul_(hidden ** -0.5)
        self.w_down = torch.randn(E, inter, hidden, **kw).mul_(inter ** -0.5)
        self.impl = "grouped_mm"

    @staticmethod
    def groups(ids: np.ndarray) -> list[tuple[int, int, int]]:
        """(expert, first slot, end slot) of each selected expert in sorted-slot order."""
        flat = ids.reshape(-1)
        experts, counts = np.unique(flat, return_counts=True)
        ends = np.cumsum(counts)
        return [(int(e), int(t - c), int(t)) for e, c, t in zip(experts, counts, ends,
                                                               strict=True)]

    def forward(self, x, ids, groups=None, impl: str | None = None):
        import torch
        import torch.nn.functional as F

        impl = impl or self.impl
        inter, k = self.shape.intermediate, ids.shape[1]
        probs = torch.softmax((x @ self.router).float(), dim=-1)
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k  # (B·k,) token of each sorted slot
        xs = x.index_select(0, tokens)
        if impl == "grouped_mm":
            counts = torch.zeros(self.shape.num_experts, dtype=torch.int64, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat))
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(xs, self.w_gate_up, offs=offs)
            y = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], self.w_down, offs=offs)
        else:
            h = torch.cat([xs[s:t] @ self.w_gate_up[e] for e, s, t in groups])
            act = F.silu(h[:, :inter]) * h[:, inter:]
            y = torch.cat([act[s:t] @ self.w_down[e] for e, s, t in groups])
        y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, y)


def choose_impl(layer: MoeLayer, device: str, rng: np.random.Generator) -> tuple[str, str]:
    """("grouped_mm" | "loop", why): grouped_mm where this torch has it and it matches the
    per-expert loop on a forced cell (relative error < 2 % in bf16, 1e-4 in fp32)."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return "loop", f"torch {torch.__version__} has no torch._grouped_mm"
    s = layer.shape
    ids_np = forced_ids(4, 2 * s.top_k, s.top_k, s.num_experts, rng)
    x = torch.randn(4, s.hidden, device=device, dtype=layer.router.dtype)
    ids = torch.from_numpy(ids_np).to(device)
    try:
        with torch.no_grad():
            got = layer.forward(x, ids, impl="grouped_mm").float()
            ref = layer.forward(x, ids, MoeLayer.groups(ids_np), impl="loop").float()
    except Exception as exc:  # unsupported dtype, alignment, architecture, ...
        return "loop", f"torch._grouped_mm failed: {type(exc).__name__}: {exc}"
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    tol = 2e-2 if layer.router.dtype == torch.bfloat16 else 1e-4
    if not err < tol:
        return "loop", f"torch._grouped_mm differs from the loop by {err:.2e} (> {tol})"
    return "grouped_mm", f"torch._grouped_mm matches the loop ({err:.1e} relative)"


def as_cuda_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured as a CUDA graph (after warm-up on a side stream); its replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _cell_call(layer: MoeLayer, x, ids, groups) -> Callable[[], object]:
    """``layer.forward`` on one cell's fixed inputs, as a call without arguments."""
    return lambda: layer.forward(x, ids, groups)


def sweep_moe(shape: MoeShape, *, device: str, dtype, batches, clock: Clock, deadline: float,
              repeats: int, warmup: int, inner: int, graphs: str, seed: int) -> dict:
    """Time one MoE layer on every feasible (B, D) cell; medians in µs, fits, the paths.

    ``graphs``: "auto" (CUDA graphs when the first capture works, else eager), "on",
    "off". Stops visiting at ``deadline``; a cell with no timed call is left out.
    """
    import torch

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)  # the activations x (CPU and CUDA generators)
    layer = MoeLayer(shape, device=device, dtype=dtype, seed=seed)
    layer.impl, impl_why = choose_impl(layer, device, rng)
    clock.log(f"{shape.model}: experts by {layer.impl} ({impl_why})")
    k, E = shape.top_k, shape.num_experts
    cells = [(B, D) for B in batches for D in shape.distincts() if k <= D <= min(E, B * k)]
    on_gpu = device == "cuda"
    mode = "eager"
    use_graphs = on_gpu and graphs != "off"
    graph_error = None
    runners: dict = {}
    with torch.no_grad():
        for B, D in cells:
            ids_np = forced_ids(B, D, k, E, rng)
            x = torch.randn(B, shape.hidden, device=device, dtype=dtype)
            ids = torch.from_numpy(ids_np).to(device)
            fn = _cell_call(layer, x, ids, MoeLayer.groups(ids_np))
            if use_graphs:
                try:
                    fn = as_cuda_graph(fn)
                    mode = "cuda-graph"
                except Exception as exc:
                    if graphs == "on" or mode == "cuda-graph":
                        raise
                    graph_error = f"{type(exc).__name__}: {exc}"
                    clock.log(f"{shape.model}: CUDA graph capture failed, timing eagerly "
                              f"({graph_error})")
                    use_graphs = False
                    torch.cuda.synchronize()
            for _ in range(warmup):
                fn()
            runners[(B, D)] = fn
        timer = CudaTimer(flush_bytes=_l2_flush_bytes()) if on_gpu else CpuTimer(inner)
        if on_gpu:
            torch.cuda.synchronize()
        clock.log(f"{shape.model}: {len(cells)} cells ready ({mode}), timing up to "
                  f"{repeats} repeats each in random order")
        schedule = [c for _ in range(repeats) for c in cells]
        schedule = [schedule[i] for i in rng.permutation(len(schedule))]
        times: dict = {c: [] for c in cells}
        chunk = 64
        for start in range(0, len(schedule), chunk):
            for c in schedule[start:start + chunk]:
                timer.visit(c, runners[c])
            for c, t in timer.collect():
                times[c].append(t)
            if time.monotonic() > deadline:
                clock.log(f"{shape.model}: budget reached after {start + chunk} of "
                          f"{len(schedule)} timed calls")
                break
    impl = "torch._grouped_mm" if layer.impl == "grouped_mm" else "loop over experts"
    del runners, layer
    if on_gpu:
        torch.cuda.empty_cache()
    table = [{"B": B, "D": D, "us": float(np.median(v)) * 1e6, "n": len(v)}
             for (B, D), v in times.items() if v]
    out = {"shape": asdict(shape), "impl": impl, "impl_why": impl_why, "mode": mode,
           "graph_error": graph_error, "dtype": str(dtype).replace("torch.", ""),
           "cells": table}
    if len(table) >= 3:
        a, b, c, r2 = fit_plane([(r["B"], r["D"]) for r in table], [r["us"] for r in table])
        out["fit"] = {"a_us": a, "b_us": b, "c_us": c, "r2": r2}
        d = np.array([r["D"] for r in table], float)
        y = np.array([r["us"] for r in table], float)
        b2, a2 = np.polyfit(d, y, 1)  # the published fits' form, no per-token term
        out["fit_ab"] = {"a_us": float(a2), "b_us": float(b2),
                         "r2": _r2(y, y - (a2 + b2 * d))}
    out["per_batch"] = per_batch_fits(table)
    return out


def _l2_flush_bytes() -> int:
    """Four times the device's L2 (50 MB when torch does not say), at least 64 MiB."""
    import torch

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 50 * 2 ** 20
    return max(4 * int(l2), 64 * 2 ** 20)


# -- fits -----------------------------------------------------------------------------------
def _r2(y: np.ndarray, resid: np.ndarray) -> float:
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float((resid ** 2).sum())
    if ss_tot == 0.0:  # every time equal: a perfect fit or none
        return 1.0 if ss_res == 0.0 else 0.0
    return 1.0 - ss_res / ss_tot


def fit_plane(cells, ys) -> tuple[float, float, float, float]:
    """Least squares ``y = a + b·D + c·B`` over (B, D) cells: (a, b, c, R²)."""
    B, D = (np.array(v, float) for v in zip(*cells, strict=True))
    y = np.asarray(ys, float)
    X = np.stack([np.ones_like(D), D, B], axis=1)
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    return float(coef[0]), float(coef[1]), float(coef[2]), _r2(y, y - X @ coef)


def per_batch_fits(table: list[dict]) -> list[dict]:
    """``t = a + b·D`` per batch size B with at least two D values: how much B matters."""
    out = []
    for B in sorted({r["B"] for r in table}):
        rows = [r for r in table if r["B"] == B]
        if len({r["D"] for r in rows}) < 2:
            continue
        d = np.array([r["D"] for r in rows], float)
        y = np.array([r["us"] for r in rows], float)
        b, a = np.polyfit(d, y, 1)
        out.append({"B": B, "a_us": float(a), "b_us": float(b),
                    "r2": _r2(y, y - (a + b * d))})
    return out


def format_sweep(res: dict) -> str:
    """The table (rows B, columns D, µs) and the fits, as printed."""
    s = res["shape"]
    rows = res["cells"]
    ds = sorted({r["D"] for r in rows})
    bs = sorted({r["B"] for r in rows})
    us = {(r["B"], r["D"]): r["us"] for r in rows}
    n = min((r["n"] for r in rows), default=0)
    lines = [f"{s['model']}: one MoE layer (H {s['hidden']}, I {s['intermediate']}, "
             f"E {s['num_experts']}, top-{s['top_k']}, {res['dtype']}), {res['impl']}, "
             f"{res['mode']}; µs, median of >= {n} calls",
             "B \\ D " + "".join(f"{d:>9d}" for d in ds)]
    for B in bs:
        lines.append(f"{B:>5d} " + "".join(
            f"{us[(B, d)]:9.1f}" if (B, d) in us else f"{'-':>9}" for d in ds))
    if "fit" in res:
        f = res["fit"]
        lines.append(f"fit t = a + b·D + c·B: a = {f['a_us']:.2f} µs, b = {f['b_us']:.3f} "
                     f"µs/expert, c = {f['c_us']:.3f} µs/token, R² = {f['r2']:.4f}")
    if "fit_ab" in res:
        f = res["fit_ab"]
        lines.append(f"fit t = a + b·D (all B): a = {f['a_us']:.2f} µs, b = {f['b_us']:.3f} "
                     f"µs/expert, R² = {f['r2']:.4f}")
    for f in res["per_batch"]:
        lines.append(f"  B = {f['B']:>3d}: t = {f['a_us']:.2f} + {f['b_us']:.3f}·D µs, "
                     f"R² = {f['r2']:.4f}")
    return "\n".join(lines)


# -- capture --------------------------------------------------------------------------------
def load_tiny(device: str):
    """The shipped tiny MoE (float32, as ``eldr capture`` runs it) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32,
                                                     local_files_only=True)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(TINY_DIR, torch_dtype=torch.float32,
                                                     local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(TINY_DIR, local_files_only=True)
    return model.float().to(device).eval(), tokenizer


def capture_with_eldr(model, prompts, *, max_new_tokens: int, eos: int | None, device: str):
    """eldr's own capture: (prefill (R, L, E), decode (R, L, E) counts, prompt and output
    lengths, the trace, a note). Off the CPU, eldr's recorder is given a ``take`` that
    first copies the recorded tensors to the host (its own calls ``.numpy()``, which
    needs host tensors)."""
    from eldr.capture import hf

    note = "eldr.capture.hf.capture_ids"
    recorder_cls = hf.RoutingRecorder
    if device != "cpu":
        class HostRecorder(recorder_cls):
            def take(self):
                self._ids = [[t.cpu() for t in x] for x in self._ids]
                self._logits = [[t.cpu() for t in x] for x in self._logits]
                return super().take()
        hf.RoutingRecorder = HostRecorder
        note += " (recorded tensors copied to the host before take)"
    try:
        results = hf.capture_ids(model, prompts, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, progress=False)
    finally:
        hf.RoutingRecorder = recorder_cls
    num_experts = int(results[0].prefill_logits.shape[2])
    trace = hf.to_trace(results, model_name="tiny_moe", num_experts=num_experts,
                        domains=[d for d, _ in PROMPTS][: len(results)])
    return (trace.prefill_counts, trace.decode_counts, trace.prompt_lens, trace.output_lens,
            trace, note)


def find_router_modules(model) -> list:
    """Per layer, the module whose output carries the routing: a ``*TopKRouter`` (returns
    (logits, scores, ids)) or, in older transformers, the ``mlp.gate`` linear (logits)."""
    pat = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
    found = {}
    for name, module in model.named_modules():
        m = pat.search(name)
        if m is not None:
            found[int(m.group(1))] = module
    if not found:
        raise ValueError("no layers.N.mlp.gate modules in this model")
    return [found[i] for i in sorted(found)]


def capture_direct(model, prompts, *, max_new_tokens: int, eos: int | None, top_k: int,
                   num_experts: int):
    """The same greedy capture as eldr's, written here: hooks on every router record the
    top-k ids of each forward pass; the prompt runs once, each generated token but the
    last is fed back with the KV cache. Counts as in :func:`capture_with_eldr`."""
    import torch

    routers = find_router_modules(model)
    seen: list[list] = [[] for _ in routers]

    def hook_for(layer: int):
        def hook(module, inputs, output):
            if isinstance(output, tuple):  # (logits, scores, ids)
                ids = next(o for o in reversed(output) if not o.is_floating_point())
            else:  # logits: softmax is monotone, so top-k of the logits is the routing
                ids = output.topk(top_k, dim=-1).indices
            seen[layer].append(ids.detach().reshape(-1, top_k).cpu().numpy())
        return hook

    def take() -> np.ndarray:  # (L, E) counts since the last call
        counts = np.zeros((len(routers), num_experts), np.int32)
        for layer, chunks in enumerate(seen):
            for ids in chunks:
                np.add.at(counts[layer], ids.reshape(-1), 1)
            chunks.clear()
        return counts

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    device = next(model.parameters()).device
    pre, dec, plen, olen = [], [], [], []
    try:
        with torch.no_grad():
            for prompt in prompts:
                out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
                pre.append(take())
                token = int(out.logits[0, -1].argmax())
                generated = [token]
                while len(generated) < max_new_tokens and token != eos:
                    out = model(input_ids=torch.tensor([[token]], device=device),
                                past_key_values=out.past_key_values, use_cache=True)
                    token = int(out.logits[0, -1].argmax())
                    generated.append(token)
                dec.append(take())
                plen.append(len(prompt))
                olen.append(len(generated))
    finally:
        for h in handles:
            h.remove()
    return (np.stack(pre), np.stack(dec), np.array(plen, np.int64), np.array(olen, np.int64),
            None, "direct: transformers forward hooks on layers.N.mlp.gate (this script)")


def run_capture(device: str, out_dir: Path, *, path: str, max_new_tokens: int,
                clock: Clock) -> dict:
    """Capture the tiny MoE on :data:`PROMPTS`; write ``capture_tiny.npz``; a summary."""
    import torch

    model, tokenizer = load_tiny(device)
    cfg = model.config
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for _, p in PROMPTS]
    eos = tokenizer.eos_token_id
    top_k = int(cfg.num_experts_per_tok)
    num_experts = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    errors = []
    got = None
    t0 = time.perf_counter()
    if path in ("auto", "eldr"):
        try:
            if str(SRC) not in sys.path:
                sys.path.insert(0, str(SRC))
            got = capture_with_eldr(model, prompts, max_new_tokens=max_new_tokens, eos=eos,
                                    device=device)
        except Exception as exc:
            if path == "eldr":
                raise
            errors.append(f"eldr path: {type(exc).__name__}: {exc}")
            clock.log(f"capture: eldr's capture failed ({errors[-1]}); running the direct path")
            t0 = time.perf_counter()
    if got is None:
        got = capture_direct(model, prompts, max_new_tokens=max_new_tokens, eos=eos,
                             top_k=top_k, num_experts=num_experts)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    pre, dec, plen, olen, trace, how = got
    np.savez(out_dir / "capture_tiny.npz", prefill_counts=pre.astype(np.int32),
             decode_counts=dec.astype(np.int32), prompt_lens=plen, output_lens=olen,
             domains=np.array([d for d, _ in PROMPTS]))
    files = ["capture_tiny.npz"]
    if trace is not None:
        from eldr.traces.trace import save

        save(trace, out_dir / "capture_tiny_trace.npz")
        files.append("capture_tiny_trace.npz")
    forwards = int(plen.sum() + (olen - 1).sum())  # tokens that went through the model
    return {"path": how, "errors": errors, "device": device, "dtype": "float32",
            "requests": len(prompts), "max_new_tokens": max_new_tokens,
            "prompt_tokens": int(plen.sum()), "generated_tokens": int(olen.sum()),
            "wall_s": wall, "tokens_per_s": forwards / wall,
            "generated_tokens_per_s": float(olen.sum()) / wall,
            "shape": list(pre.shape), "files": files}


# -- main -----------------------------------------------------------------------------------
def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def hardware_record(*, name: str, device_name: str, micro: dict, hbm_bytes: int,
                    sweeps: list[dict], note: str) -> dict:
    """The ``eldr-hardware/1`` record (docs/gpu.md)."""
    fits = [{"model": s["shape"]["model"], "a_us": s["fit"]["a_us"], "b_us": s["fit"]["b_us"],
             "c_us": s["fit"]["c_us"], "r2": s["fit"]["r2"],
             "layers": s["shape"]["num_layers"], "experts": s["shape"]["num_experts"],
             "top_k": s["shape"]["top_k"]} for s in sweeps if "fit" in s]
    return {"format": "eldr-hardware/1", "name": name,
            "hbm_bandwidth": float(micro["hbm_bandwidth"]), "hbm_bytes": int(hbm_bytes),
            "peak_flops": float(micro["peak_flops"]), "t_fixed_s": T_FIXED_S,
            "moe_fits": fits,
            "source": {"how": "scripts/gpu_premise.py", "device": device_name,
                       "steps": int(sum(len(s["cells"]) for s in sweeps if "fit" in s)),
                       "date": datetime.now(UTC).isoformat(timespec="seconds"),
                       "note": note}}


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for hardware.json, premise.json, "
                   "capture_tiny.npz (created)")
    p.add_argument("--cpu", action="store_true", help="the CPU smoke run (automatic when "
                   "CUDA is not available): tiny sizes, one thread, not a measurement")
    p.add_argument("--budget-s", type=float, default=None,
                   help="cap on the whole run (default 240 s on a GPU, 50 s on the CPU)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per MoE cell (default 200 on a GPU, 15 on the CPU)")
    p.add_argument("--batches", default=None,
                   help="comma-separated B (default 1,8,32,64,128 on a GPU, 1,2,4,8,16 on the CPU)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                   help="CUDA graphs for the MoE cells (default auto: when capture works)")
    p.add_argument("--capture-path", choices=("auto", "eldr", "direct"), default="auto",
                   help="auto: eldr's capture, the direct hooks if it fails")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="greedy tokens per prompt in the capture (default 16 on a GPU, 8 on "
                   "the CPU)")
    p.add_argument("--skip-sweep", action="store_true",
                   help="capture only (no micro-benchmarks, no MoE sweep, no hardware.json)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@dataclass(frozen=True)
class Plan:
    """What this run measures where, resolved once from the arguments and the machine."""

    device: str  # "cuda" or "cpu"
    device_name: str  # torch.cuda.get_device_name, or the CPU's description
    name: str  # hardware name written to hardware.json
    hbm_bytes: int  # device memory (the machine's RAM on the CPU)
    dtype: object  # torch dtype of weights and activations
    shapes: tuple[MoeShape, ...]  # MoE layers to sweep, the first gets most of the budget
    batches: tuple[int, ...]  # B values
    repeats: int  # timed calls per cell
    warmup: int  # untimed calls per cell
    inner: int  # calls per clock reading (CPU only)
    micro: dict  # measure_device keywords
    max_new_tokens: int  # capture
    note: str  # hardware.json source.note


def make_plan(args: argparse.Namespace) -> Plan:
    import torch

    if torch.cuda.is_available() and not args.cpu:
        device_name = torch.cuda.get_device_name(0)
        plan = Plan("cuda", device_name, slug(device_name),
                    int(torch.cuda.get_device_properties(0).total_memory), torch.bfloat16,
                    (QWEN3_30B, TINY_MOE), (1, 8, 32, 64, 128), 200, 5, 1,
                    {"copy_bytes": 2 * 2 ** 30, "matmul_n": 8192, "repeats": 20}, 16,
                    "t_fixed_s assumed, not measured")
    else:
        torch.set_num_threads(1)  # one core: steadier figures, and fair on a shared machine
        plan = Plan("cpu", f"cpu: {platform.processor() or platform.machine()} (torch, 1 thread)",
                    "cpu-smoke", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    torch.float32, (TINY_MOE,), (1, 2, 4, 8, 16), 15, 2, 10,
                    {"copy_bytes": 64 * 2 ** 20, "matmul_n": 512, "repeats": 5}, 8,
                    "SMOKE RUN on a CPU, not a measurement of any accelerator: tiny sizes, "
                    "float32, one thread, thread CPU time; t_fixed_s assumed, not measured")
    over = {}
    if args.batches:
        over["batches"] = tuple(int(b) for b in args.batches.split(","))
    if args.repeats:
        over["repeats"] = args.repeats
    if args.max_new_tokens:
        over["max_new_tokens"] = args.max_new_tokens
    return replace(plan, **over)


def measure(plan: Plan, args: argparse.Namespace, clock: Clock, report: dict,
            out_dir: Path, capture_reserve: float) -> bool:
    """Micro-benchmarks and MoE sweeps into ``report``; True when hardware.json was written.

    A sweep that fails with CUDA graphs (``--graphs auto``) is run once more eagerly.
    """
    import torch

    timer = CudaTimer() if plan.device == "cuda" else CpuTimer(inner=1)
    micro = measure_device(plan.device, plan.dtype, timer=timer, **plan.micro)
    report["micro"] = micro
    clock.log(f"copy {micro['copy_bytes'] / 1e9:.2f} GB (read + written) in "
              f"{micro['copy_s'] * 1e3:.3f} ms: {micro['hbm_bandwidth'] / 1e12:.3f} TB/s; "
              f"matmul {micro['matmul_n']}^3: {micro['peak_flops'] / 1e12:.2f} TFLOP/s")
    itemsize = torch.empty((), dtype=plan.dtype).element_size()
    sweeps = []
    for i, shape in enumerate(plan.shapes):
        share = 0.8 if i == 0 and len(plan.shapes) > 1 else 1.0
        deadline = time.monotonic() + share * max(1.0, clock.left() - capture_reserve)
        kw = {"device": plan.device, "dtype": plan.dtype, "batches": plan.batches,
              "clock": clock, "deadline": deadline, "repeats": plan.repeats,
              "warmup": plan.warmup, "inner": plan.inner, "seed": args.seed + i}
        res = None
        for graphs in dict.fromkeys([args.graphs, "off"]):
            try:
                res = sweep_moe(shape, graphs=graphs, **kw)
                break
            except Exception as exc:
                report["errors"].append(f"sweep {shape.model} (graphs {graphs}): "
                                        f"{type(exc).__name__}: {exc}")
                clock.log(f"{shape.model}: FAILED (graphs {graphs})\n{traceback.format_exc()}")
                if plan.device != "cuda" or args.graphs != "auto":
                    break
        if res is None:
            continue
        if "fit" in res:  # expert bytes / copy bandwidth against the fitted b
            res["b_from_bandwidth_us"] = shape.expert_bytes(itemsize) / micro["hbm_bandwidth"] * 1e6
            res["eta"] = (res["b_from_bandwidth_us"] / res["fit"]["b_us"]
                          if res["fit"]["b_us"] > 0 else None)
        sweeps.append(res)
        print(format_sweep(res), flush=True)
    report["moe"] = sweeps
    # a fit the step-time model cannot take (a < 0 or b <= 0: noise, on a loaded CPU) is
    # left out of the hardware file, said so in premise.json, never clamped
    fitted = [s for s in sweeps if "fit" in s]
    report["omitted_fits"] = [
        {"model": s["shape"]["model"], "why": f"a = {s['fit']['a_us']:.3g} µs, b = "
         f"{s['fit']['b_us']:.3g} µs: the step-time model needs a >= 0 and b > 0"}
        for s in fitted if not (s["fit"]["a_us"] >= 0 and s["fit"]["b_us"] > 0)]
    for o in report["omitted_fits"]:
        clock.log(f"{o['model']}: fit left out of hardware.json ({o['why']})")
    omitted = {o["model"] for o in report["omitted_fits"]}
    fitted = [s for s in fitted if s["shape"]["model"] not in omitted]
    if not any("fit" in s for s in sweeps):
        return False
    modes = ", ".join(f"{s['shape']['model']} {s['impl']} {s['mode']}" for s in fitted)
    if omitted:
        modes += f"; fits left out (see premise.json): {', '.join(sorted(omitted))}"
    hw = hardware_record(name=plan.name, device_name=plan.device_name, micro=micro,
                         hbm_bytes=plan.hbm_bytes, sweeps=fitted,
                         note=f"{plan.note}; MoE layer: {modes}")
    write_json(out_dir / "hardware.json", hw)
    clock.log(f"wrote {out_dir / 'hardware.json'}")
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()  # the budget covers the imports too
    import torch
    import transformers

    try:  # the weight-loading bar would interleave with the progress lines
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    plan = make_plan(args)
    clock = Clock(args.budget_s if args.budget_s is not None
                  else (240.0 if plan.device == "cuda" else 50.0), started=started)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": plan.device_name, "device_kind": plan.device,
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "python": sys.version.split()[0], "argv": sys.argv[1:],
                    "budget_s": clock.deadline - clock.t0, "errors": []}
    clock.log(f"{plan.device_name}; torch {torch.__version__}, transformers "
              f"{transformers.__version__}; budget {report['budget_s']:.0f} s -> {out_dir}")
    wrote_hardware = False
    if not args.skip_sweep:
        wrote_hardware = measure(plan, args, clock, report, out_dir,
                                 capture_reserve=min(40.0, 0.25 * clock.left()))
        write_json(out_dir / "premise.json", report)
    captured = False
    try:
        cap = run_capture(plan.device, out_dir, path=args.capture_path,
                          max_new_tokens=plan.max_new_tokens, clock=clock)
        report["capture"] = cap
        captured = True
        clock.log(f"capture: {cap['requests']} requests, {cap['prompt_tokens']} prompt + "
                  f"{cap['generated_tokens']} generated tokens in {cap['wall_s']:.2f} s: "
                  f"{cap['tokens_per_s']:.0f} tokens/s through the model "
                  f"({cap['generated_tokens_per_s']:.0f} generated/s, batch 1); counts "
                  f"{tuple(cap['shape'])}; path: {cap['path']}")
    except Exception as exc:
        report["errors"].append(f"capture: {type(exc).__name__}: {exc}")
        clock.log(f"capture: FAILED\n{traceback.format_exc()}")
    report["elapsed_s"] = clock.elapsed()
    write_json(out_dir / "premise.json", report)
    clock.log(f"done in {clock.elapsed():.1f} s; wrote {out_dir / 'premise.json'}")
    if not wrote_hardware and not args.skip_sweep:
        return 1
    return 0 if captured else 2


if __name__ == "__main__":
    sys.exit(main())
