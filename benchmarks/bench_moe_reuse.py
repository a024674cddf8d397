"""Does an expert used in the previous decode step cost less? vLLM-CPU's fused-MoE kernel.

The step model ``t = t0 + b·Σ_l D_l + c·B`` (docs/engine-latency.md) prices every distinct
expert of a step the same. On a CPU an expert's weights that the previous step streamed
may still be in the last-level cache, and ELDR makes that more likely: a decoder that gets
one domain's requests selects a smaller, steadier set of experts from step to step. This
benchmark measures the effect at the kernel the engines run (``cpu_fused_moe``, float32,
isa ``vec``, as in ``bench_vllm_moe_kernel.py``), on decode-like sequences of steps.

A sequence is ``--steps`` steps; a step calls the kernel once per layer (``--layers``
copies of the tiny MoE's expert weights at width ``--width``) on a batch of ``--batch``
tokens whose routing selects exactly ``D`` distinct experts per layer. From one step to the
next, each layer keeps a fraction ``r`` of its previous set and draws the rest anew from
the experts it did not use (r = 1: the same experts every step; r = 0: none repeats).
Scenarios (D, r) are interleaved in a random order per repeat; the figure is the median
time of a step. Then ``t = a + b_new·N + b_kept·K`` over all scenarios (N new and K kept
distinct experts per layer): what a fresh expert and a repeated one cost.

    taskset -c 1 python benchmarks/bench_moe_reuse.py [--width 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench_vllm_moe_kernel import HIDDEN, NUM_EXPERTS, TOP_K, packed_layers


def step_sets(num_steps: int, num_layers: int, distinct: int, keep: float,
              rng: np.random.Generator) -> list[list[np.ndarray]]:
    """[step][layer] -> (D,) expert ids; each step keeps ``round(keep·D)`` of the
    previous step's experts of that layer and draws the others from the unused ones."""
    kept = round(keep * distinct)
    current = [rng.permutation(NUM_EXPERTS)[:distinct] for _ in range(num_layers)]
    out = [current]
    for _ in range(num_steps - 1):
        nxt = []
        for ids in current:
            stay = rng.permutation(ids)[:kept]
            fresh = rng.permutation(np.setdiff1d(np.arange(NUM_EXPERTS), ids))
            nxt.append(np.concatenate([stay, fresh[:distinct - kept]]))
        out.append(nxt)
        current = nxt
    return out


def routing(ids: np.ndarray, num_tokens: int) -> np.ndarray:
    """(B, k) int32 token routing whose union is exactly the experts ``ids`` (D ≤ B·k)."""
    slots = np.arange(num_tokens * TOP_K).reshape(num_tokens, TOP_K) % ids.size
    return ids[slots].astype(np.int32)


def bench(width: int, batch: int, distincts, keeps, *, num_layers: int, num_steps: int,
          repeats: int, seed: int = 0) -> dict:
    """{(D, r): median seconds of one step (all layers)}."""
    import torch
    import vllm._custom_ops as ops

    rng = np.random.default_rng(seed)
    layers = packed_layers(width, num_layers, seed)
    x = torch.randn(batch, HIDDEN)
    out = torch.empty_like(x)
    wts = torch.full((batch, TOP_K), 1.0 / TOP_K)
    cells = [(D, r) for D in distincts for r in keeps]
    times: dict = {c: [] for c in cells}

    def run(seq) -> float:
        ids = [[torch.from_numpy(routing(s, batch)) for s in step] for step in seq]
        t0 = time.perf_counter()
        for step in ids:
            for (w13, w2), tok in zip(layers, step, strict=True):
                ops.cpu_fused_moe(out, x, w13, w2, None, None, wts, tok, "silu", "vec")
        return (time.perf_counter() - t0) / len(ids)

    run(step_sets(num_steps, num_layers, distincts[0], 0.0, rng))  # warm-up
    for _ in range(repeats):
        for i in rng.permutation(len(cells)):
            D, r = cells[i]
            seq = step_sets(num_steps, num_layers, D, r, rng)
            run(seq[:2])  # the sequence's first sets: the timed steps all have a previous
            times[(D, r)].append(run(seq[1:]))
    return {c: float(np.median(v)) for c, v in times.items()}


def main() -> None:
    import torch
    import vllm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--distinct", default="8,16,24")
    p.add_argument("--keep", default="0,0.5,0.75,1")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    distincts = [int(v) for v in args.distinct.split(",")]
    keeps = [float(v) for v in args.keep.split(",")]
    mib = 3 * args.width * HIDDEN * 4 / 2**20
    print(f"vLLM {vllm.__version__} cpu_fused_moe (vec, float32), 1 thread; W={args.width} "
          f"({mib:.1f} MiB an expert), B={args.batch}, {args.layers} layers, "
          f"{args.steps} steps a sequence, {args.repeats} repeats; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    t = bench(args.width, args.batch, distincts, keeps, num_layers=args.layers,
              num_steps=args.steps, repeats=args.repeats)
    print(f"{'D':>3} {'kept':>5} {'MiB/step':>9} {'step ms':>8} {'vs kept 0':>9}")
    for D in distincts:
        base = t[(D, 0.0)] if (D, 0.0) in t else t[(D, keeps[0])]
        for r in keeps:
            print(f"{D:>3} {r:>5.2f} {D * args.layers * mib:>9.0f} {1e3 * t[(D, r)]:>8.2f} "
                  f"{100 * (t[(D, r)] / base - 1):>+8.1f}%")
    rows = [(1.0, D - round(r * D), round(r * D), t[(D, r)]) for D in distincts for r in keeps]
    A = np.array([r[:3] for r in rows], dtype=float)
    y = np.array([r[3] for r in rows])
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    r2 = 1 - ((A @ coef - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    a, b_new, b_kept = coef / args.layers
    print(f"per layer: t = {1e6 * a:.0f} us + {1e6 * b_new:.1f} us x new experts + "
          f"{1e6 * b_kept:.1f} us x kept experts (R2 {r2:.3f}); a kept expert costs "
          f"{100 * b_kept / b_new:.0f} % of a new one")


if __name__ == "__main__":
    main()
