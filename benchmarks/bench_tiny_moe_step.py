"""What a decode step of the shipped tiny MoE costs on this CPU: the `cpu` hardware preset.

Measures, on one core (run it under ``taskset -c 1``; torch gets one thread):

(a) one MoE layer (router + experts of layer 0, the transformers module as loaded) for a
    decode batch of B tokens whose routing selects EXACTLY D distinct experts. The router
    runs as usual (its cost belongs to the layer), then its top-k ids are replaced: slot j
    of token t gets expert ``perm[(t·k + j) mod D]`` (k consecutive ids mod D are distinct
    since D ≥ k, and B·k ≥ D slots cover all D). Fit ``t_layer = a + b·D`` by least squares
    over every (B, D) cell, and per B, to show how much B matters at fixed D; then
    ``a + b·D + c·B``, whose a and b the preset takes (high D needs large B here, so the
    plain fit would book the per-token cost c on the experts).
(b) whole decode steps at batch 1 with a KV cache of ``--ctx`` and ``--ctx-long`` tokens:
    the slope is the per-context-token cost, read as an effective bandwidth
    ``BW = kv_bytes_per_token / slope``; then, with a and b of the (B, D) fit,
    ``t_fixed = t_step(ctx) − L·(a + b·k) − dense_bytes/BW − ctx·kv_bytes_per_token/BW``.
(c) prefill forwards of ``--ctx`` and ``--ctx-long`` tokens: the per-token slope, read as
    the effective FLOP/s that the simulator's ``prefill_mfu = 0.5`` turns into that slope.
(d) a check: decode steps at batch B with the model's own routing, measured against the
    step-time model with the fitted constants and the D_l the router really selected.

Every time is the CPU time of the calling thread (``time.thread_time``: torch runs on
that one thread, and time the core spends on OTHER processes of a shared machine is not
counted), a median over ``--repeats`` timed runs of ``--inner`` calls each (cells
interleaved in random order, so drift hits all of them alike).

    taskset -c 1 python benchmarks/bench_tiny_moe_step.py [--dtype float32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _load(dtype: str, experts: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    from eldr.capture import tiny_moe_dir

    kw = {} if experts is None else {"experts_implementation": experts}
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir(), dtype=getattr(torch, dtype),
                                                 local_files_only=True, **kw)
    return model.eval()


def _forced_gate(gate):
    """A wrapper of ``gate`` that runs it, then returns the ids set in ``.ids`` (B, k)."""
    import torch

    class ForcedGate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = gate
            self.ids: torch.Tensor | None = None
            self.top_k = gate.top_k
            self.num_experts = gate.num_experts

        def forward(self, hidden):
            logits, scores, _ = self.inner(hidden)
            return logits, torch.full_like(scores, 1.0 / self.top_k), self.ids

    return ForcedGate()


def forced_ids(num_tokens: int, num_distinct: int, top_k: int, num_experts: int,
               rng: np.random.Generator) -> np.ndarray:
    """(B, k) int64 expert ids whose union is exactly ``num_distinct`` experts."""
    if not top_k <= num_distinct <= min(num_experts, num_tokens * top_k):
        raise ValueError(f"D={num_distinct} needs k={top_k} <= D <= min(E, B*k)="
                         f"{min(num_experts, num_tokens * top_k)}")
    perm = rng.permutation(num_experts)[:num_distinct]
    slots = np.arange(num_tokens * top_k).reshape(num_tokens, top_k) % num_distinct
    return perm[slots]


def _median_time(fn, inner: int) -> float:
    t0 = time.thread_time()
    for _ in range(inner):
        fn()
    return (time.thread_time() - t0) / inner


def bench_layer(model, batches, distincts, repeats: int, inner: int, seed: int = 0) -> dict:
    """{(B, D): median seconds of one MoE layer forward}."""
    import torch

    block = model.model.layers[0].mlp
    gate = block.gate
    E, k, H = gate.num_experts, gate.top_k, gate.hidden_dim
    block.gate = _forced_gate(gate)
    rng = np.random.default_rng(seed)
    dtype = next(model.parameters()).dtype
    cells = [(B, D) for B in batches for D in distincts if k <= D <= min(E, B * k)]
    inputs = {c: (torch.randn(c[0], 1, H, dtype=dtype),
                  torch.from_numpy(forced_ids(c[0], c[1], k, E, rng))) for c in cells}
    times: dict = {c: [] for c in cells}
    try:
        with torch.inference_mode():
            for c in cells:  # warm-up
                block.gate.ids = inputs[c][1]
                block(inputs[c][0])
            for _ in range(repeats):
                for i in rng.permutation(len(cells)):
                    c = cells[i]
                    x, block.gate.ids = inputs[c]
                    times[c].append(_median_time(lambda x=x: block(x), inner))
    finally:
        block.gate = gate
    return {c: float(np.median(v)) for c, v in times.items()}


def fit_line(xs, ys) -> tuple[float, float, float]:
    """Least squares ``y = a + b·x``: (a, b, R²)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    return float(a), float(b), float(1 - (resid ** 2).sum() / ((y - y.mean()) ** 2).sum())


def fit_plane(cells, ys) -> tuple[float, float, float, float]:
    """Least squares ``y = a + b·D + c·B`` over (B, D) cells: (a, b, c, R²)."""
    B, D = (np.array(v, float) for v in zip(*cells, strict=True))
    y = np.asarray(ys, float)
    X = np.stack([np.ones_like(D), D, B], axis=1)
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    resid = y - X @ coef
    r2 = 1 - (resid ** 2).sum() / ((y - y.mean()) ** 2).sum()
    return float(coef[0]), float(coef[1]), float(coef[2]), float(r2)


def _prefilled(model, batch: int, ctx: int, seed: int):
    """(cache, last ids) after a prefill of ``ctx`` random tokens per sequence."""
    import torch
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (batch, ctx), generator=g)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)


def bench_decode(model, batch: int, ctx: int, repeats: int, inner: int, record=None) -> float:
    """Median seconds of one decode step at ``batch`` with ``ctx`` tokens of KV each."""
    import torch

    cache, nxt = _prefilled(model, batch, ctx, seed=batch * 1000 + ctx)
    times = []
    with torch.inference_mode():
        model(input_ids=nxt, past_key_values=cache, use_cache=True)  # warm-up
        cache.crop(-1)
        for r in range(repeats):
            tot = 0.0
            for _ in range(inner):
                t0 = time.thread_time()
                model(input_ids=nxt, past_key_values=cache, use_cache=True)
                tot += time.thread_time() - t0
                cache.crop(-1)  # the next step sees the same context again
            times.append(tot / inner)
            if record is not None and r == 0:
                record()
    return float(np.median(times))


def bench_prefill(model, ctx: int, repeats: int) -> float:
    import torch

    ids = torch.randint(1, model.config.vocab_size, (1, ctx),
                        generator=torch.Generator().manual_seed(ctx))
    with torch.inference_mode():
        model(input_ids=ids)
        return float(np.median([_median_time(lambda: model(input_ids=ids), 1)
                                for _ in range(repeats)]))


def main() -> None:
    import torch

    from eldr.capture.hf import RoutingRecorder, find_routers
    from eldr.traces.models import get_preset

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--experts", default=None, help="transformers experts implementation "
                   "(default: what from_pretrained picks, as eldr capture runs it)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--inner", type=int, default=20, help="calls per timed run")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--distinct", default="4,8,16,32,48,64")
    p.add_argument("--ctx", type=int, default=100, help="KV tokens of the batch-1 step")
    p.add_argument("--ctx-long", type=int, default=1000, help="second context for the slope")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = _load(args.dtype, args.experts)
    preset = get_preset("tiny-moe")
    L, k = preset.num_layers, preset.top_k
    impl = getattr(model.config, "_experts_implementation", None)
    print(f"tiny MoE, {args.dtype}, torch {torch.__version__} with {torch.get_num_threads()} "
          f"thread(s), experts implementation {impl!r}; {time.strftime('%Y-%m-%d %H:%M %Z')}")

    batches = [int(x) for x in args.batches.split(",")]
    distincts = [int(x) for x in args.distinct.split(",")]
    layer = bench_layer(model, batches, distincts, args.repeats, args.inner)
    print("\n(a) one MoE layer (router + experts), µs, median of "
          f"{args.repeats} x {args.inner} calls")
    print("   B \\ D " + "".join(f"{d:>8}" for d in distincts))
    for B in batches:
        row = "".join(f"{layer[(B, D)] * 1e6:>8.1f}" if (B, D) in layer else f"{'':>8}"
                      for D in distincts)
        print(f"{B:>8} {row}")
    a2, b2, r2 = fit_line([D for _, D in layer], list(layer.values()))
    print(f"fit a + b·D over all {len(layer)} cells: a = {a2 * 1e6:.2f} µs, b = {b2 * 1e6:.3f} "
          f"µs per distinct expert, R² = {r2:.4f}")
    a, b, c, r3 = fit_plane(list(layer), list(layer.values()))
    print(f"fit a + b·D + c·B over all cells: a = {a * 1e6:.2f} µs, b = {b * 1e6:.3f} µs, "
          f"c = {c * 1e6:.3f} µs per token, R² = {r3:.4f}  <- a, b of the preset (the "
          "simulator has no c·B term; in these cells D grows with B, so a + b·D alone "
          "credits the per-token cost to the experts)")
    for B in batches:
        cells = [(D, t) for (bb, D), t in layer.items() if bb == B]
        if len(cells) >= 3:
            ab, bb_, r2b = fit_line(*zip(*cells, strict=True))
            print(f"  B = {B:>2}: a = {ab * 1e6:6.2f} µs, b = {bb_ * 1e6:.3f} µs, R² = {r2b:.4f}")
    for D in distincts:
        ts = [t for (bb, d), t in layer.items() if d == D]
        if len(ts) >= 2:
            print(f"  D = {D:>2}: max/min over B = {max(ts) / min(ts):.3f} ({len(ts)} batches)")

    kvb, dense = preset.kv_bytes_per_token, preset.dense_bytes_per_step
    reps = args.repeats
    short = bench_decode(model, 1, args.ctx, reps, args.inner)
    long_ = bench_decode(model, 1, args.ctx_long, reps, args.inner)
    slope = (long_ - short) / (args.ctx_long - args.ctx)
    bw = kvb / slope if slope > 0 else float("inf")
    moe = L * (a + b * k)
    t_fixed = short - moe - dense / bw - args.ctx * kvb / bw
    print(f"\n(b) decode step at batch 1: {short * 1e3:.3f} ms at {args.ctx} tokens of KV, "
          f"{long_ * 1e3:.3f} ms at {args.ctx_long}")
    print(f"  per context token {slope * 1e9:.1f} ns -> effective BW = {kvb} B / slope = "
          f"{bw / 1e9:.3f} GB/s")
    print(f"  L(a + b k) = {moe * 1e3:.3f} ms, dense/BW = {dense / bw * 1e3:.3f} ms, "
          f"KV/BW = {args.ctx * kvb / bw * 1e3:.3f} ms")
    print(f"  t_fixed = {t_fixed * 1e3:.3f} ms ({t_fixed / short:.0%} of the step)")

    pf_short = bench_prefill(model, args.ctx, reps)
    pf_long = bench_prefill(model, args.ctx_long, reps)
    pf_slope = (pf_long - pf_short) / (args.ctx_long - args.ctx)
    active = dense / 2 + L * k * 3 * preset.hidden_size * preset.expert_intermediate_size
    flops = 2 * active / (pf_slope * 0.5)
    print(f"\n(c) prefill: {pf_short * 1e3:.2f} ms for {args.ctx} tokens, {pf_long * 1e3:.2f} ms "
          f"for {args.ctx_long}: {pf_slope * 1e6:.1f} µs per token -> peak_flops = "
          f"2 x {active:,.0f} / (slope x 0.5) = {flops / 1e9:.2f} GFLOP/s")

    print(f"\n(d) decode steps with the model's own routing, {args.ctx} tokens of KV each")
    print(f"{'batch':>6} {'ΣD_l':>6} {'measured ms':>12} {'model ms':>9} {'ratio':>6} "
          f"{'+ L·c·(B-1)':>12}")
    routers = find_routers(model)
    for B in batches:
        with RoutingRecorder(routers) as rec:
            seen: list = []
            bench_decode(model, B, args.ctx, 1, args.inner,
                         record=lambda seen=seen, rec=rec: seen.append(rec.take()))
        topk = seen[0][0][-B:] if seen else None  # the last step's B tokens
        dsum = sum(np.unique(topk[:, li]).size for li in range(L))
        measured = bench_decode(model, B, args.ctx, reps, args.inner)
        predicted = t_fixed + L * a + b * dsum + dense / bw + B * args.ctx * kvb / bw
        with_c = predicted + L * c * (B - 1)
        print(f"{B:>6} {dsum:>6} {measured * 1e3:>12.3f} {predicted * 1e3:>9.3f} "
              f"{measured / predicted:>6.2f} {with_c * 1e3:>12.3f}")


if __name__ == "__main__":
    main()
