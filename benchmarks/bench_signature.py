"""Benchmark ρ and the greedy layer selection at the paper's scale (prints figures).

R=1000 requests, L=48 layers, E=128 experts, k=8: ρ on all 499,500 pairs, and the greedy
forward layer selection over 48 layers. Targets on one core: ρ ≤ 0.5 s, selection ≤ 5 s.
Run: ``python benchmarks/bench_signature.py [--requests 1000]``. The trace is a constructed
one (domain signal in half the layers, noise in the rest) so the search has real work.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from eldr.fit.signature import SignatureEncoder, rho
from eldr.traces.trace import Trace, TraceMeta


def constructed_trace(R: int, L: int, E: int, k: int, seed: int = 0) -> Trace:
    """Counts drawn from a domain-dependent distribution in even layers, uniform in odd."""
    rng = np.random.default_rng(seed)
    domains = rng.integers(0, 4, R)
    pref = rng.dirichlet(np.full(E, 0.3), size=(4, L))  # (D, L, E)
    probs = np.where((np.arange(L) % 2 == 0)[None, :, None], pref[domains], 1.0 / E)
    prompt = rng.integers(50, 400, R)
    out = rng.integers(20, 200, R)

    def draw(tokens):
        c = np.empty((R, L, E), dtype=np.int32)
        for r in range(R):
            for layer in range(L):
                c[r, layer] = rng.multinomial(k * tokens[r], probs[r, layer])
        return c

    return Trace(
        meta=TraceMeta("constructed", L, E, k, source="synthetic:bench"),
        prefill_counts=draw(prompt), decode_counts=draw(out - 1),
        prompt_lens=prompt, output_lens=out,
        domains=domains, domain_names=("a", "b", "c", "d"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--synthetic", action="store_true",
                    help="use the calibrated Qwen3-30B task generator instead of the "
                    "constructed trace (more layers carry signal: a longer greedy search)")
    args = ap.parse_args()
    if args.synthetic:
        from eldr.traces.synth import generate

        trace = generate("qwen3-30b-a3b", "task", num_requests=args.requests, seed=0,
                         keep_topk=False)
        print(f"trace: {trace.describe()}")
    else:
        trace = constructed_trace(args.requests, args.layers, args.experts, 8)
    L = trace.meta.num_layers
    sig = SignatureEncoder(layers=list(range(L))).fit(trace).transform(trace)
    times, cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        value = rho(sig, trace.decode_counts)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    pairs = args.requests * (args.requests - 1) // 2
    print(f"rho on all {pairs:,} pairs: {min(times):.3f} s wall, {min(cpu):.3f} s CPU "
          f"(best of 3), rho={value:.4f} "
          f"[target <= 0.5 s]")
    for sel_pairs in (20_000, 100_000, None):
        t0, c0 = time.perf_counter(), time.process_time()
        enc = SignatureEncoder(selection_max_pairs=sel_pairs, random_state=0).fit(trace)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        label = "all pairs" if sel_pairs is None else f"{sel_pairs:,} sampled pairs"
        print(f"fit with greedy layer selection over {L} layers ({label}): "
              f"{dt:.2f} s wall, {dc:.2f} s CPU, "
              f"N*={enc.layers_.size}, rho={enc.rho_:.4f} [target <= 5 s]")


if __name__ == "__main__":
    main()
