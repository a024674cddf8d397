"""Benchmark the offline fit (prints figures): balanced assignment steps, K-means, a whole fit.

1. One balanced assignment step, K = 16, cap = ⌈N/K⌉ (per-column caps for ``unequal``),
   at N = 1,000 and N = 100,000, side by side with k-means-constrained's step (its OR-tools
   min-cost flow on costs ×1000 rounded to int32: ``minimum_cost_flow_problem_graph`` +
   ``solve_min_cost_flow_graph``) on the SAME cost matrix, in the same run, per instance
   family (cost = 1 − cos between unit rows and 16 centres drawn from the rows):
   ``mixture`` (6 skewed domains, d = 256), ``uniform`` (isotropic, d = 32), ``blobs``
   (16 well-separated blobs of Dirichlet sizes, d = 64), ``gamma`` (5 gamma-distributed
   topics, d = 192), ``duplicates`` (N/40 distinct rows, each repeated: exact ties),
   ``unequal`` (per-column capacities from 0.3..1.7 weights, 5% slack).
   ``cold``: the first K-means step, no prior; ``warm``: K-means step 5 (centres moved to
   their clusters' means four times) warm-started with step 4's duals, as
   ``BalancedKMeans`` does from its second step on.
   k-means-constrained solves both from scratch (it has no warm start). Ratio = its time
   / ours (min CPU over repeats). Totals are printed so exactness is visible: ours is the
   exact optimum, k-means-constrained's is off by its ×1000 rounding.
2. Balanced K-means (n_init=1) at N = 1,000 and 100,000 (``gamma`` rows, K = 16), with
   warm-started assignment steps (as shipped) and with every step cold, same run.
3. The whole ``eldr fit`` (encoder: IDF + greedy layer mask by ρ; then balanced K-means,
   n_init=4) for R = 1,000 synthetic Qwen3-30B-A3B requests (48 × 128, k = 8), K = 16.

CPU = process time (this machine is shared: wall clock there mostly measures waiting for a
core). k-means-constrained is a benchmark-only dependency (``pip install -e .[bench]``);
without it, its columns are skipped.
Run: ``python benchmarks/bench_fit.py [--smoke] [--skip-fit] [--repeats 7]``
(``--smoke``: N = 1,000 only, 2 repeats).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

import eldr.fit.cluster as cluster
from eldr.fit.cluster import BalancedKMeans, balanced_assign

K = 16
WARM_AFTER = 4  # the warm instance: K-means step 5, warm-started with step 4's duals
FAMILIES = ("mixture", "uniform", "blobs", "gamma", "duplicates", "unequal")


def _unit(X: np.ndarray) -> np.ndarray:
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def rows(family: str, N: int, rng: np.random.Generator) -> np.ndarray:
    """Unit rows (N, d) of one instance family."""
    if family == "mixture":
        shares = np.array([0.3, 0.2, 0.15, 0.15, 0.1, 0.1])
        proto = rng.random((shares.size, 256)) ** 4
        return _unit(proto[rng.choice(shares.size, N, p=shares)]
                     + 0.5 * rng.random((N, 256)) ** 4)
    if family == "uniform":
        return _unit(rng.standard_normal((N, 32)))
    if family == "blobs":
        centres = _unit(rng.standard_normal((K, 64)))
        sizes = rng.multinomial(N, rng.dirichlet(np.ones(K)))
        return _unit(np.repeat(centres, sizes, axis=0) + 0.05 * rng.standard_normal((N, 64)))
    if family == "gamma":
        shares = rng.gamma(0.7, size=5)
        proto = rng.gamma(0.3, size=(5, 192))
        return _unit(proto[rng.choice(5, N, p=shares / shares.sum())]
                     + rng.gamma(0.3, 0.3, size=(N, 192)))
    if family == "duplicates":
        base = _unit(rng.random((max(1, N // 40), 48)) ** 3)
        return base[rng.integers(0, base.shape[0], N)]
    if family == "unequal":
        proto = rng.random((6, 128)) ** 4
        return _unit(proto[rng.integers(0, 6, N)] + 0.5 * rng.random((N, 128)) ** 4)
    raise ValueError(family)


def instance(family: str, N: int, seed: int = 0):
    """(first step's cost, capacity, step WARM_AFTER's cost, step WARM_AFTER + 1's cost)."""
    rng = np.random.default_rng(seed)
    X = rows(family, N, rng)
    centres = X[rng.choice(N, K, replace=False)]
    cap: int | np.ndarray = -(-N // K)
    if family == "unequal":
        w = rng.uniform(0.3, 1.7, K)
        cap = np.ceil(1.05 * N * w / w.sum()).astype(np.int64)
    cost = first = 1.0 - X @ centres.T
    for _ in range(WARM_AFTER):  # K-means steps; the last cost is the warm instance's
        labels = balanced_assign(cost, cap)
        sums = np.zeros_like(centres)
        np.add.at(sums, labels, X)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        centres = np.where(norms > 0, sums / np.maximum(norms, 1e-300), centres)
        cost, prev = 1.0 - X @ centres.T, cost
    return first, cap, prev, cost


def cpu_min(fn, repeats: int):
    best, out = np.inf, None
    for _ in range(repeats):
        c = time.process_time()
        out = fn()
        best = min(best, time.process_time() - c)
    return out, best


def _kmc():
    try:
        from k_means_constrained.k_means_constrained_ import (
            minimum_cost_flow_problem_graph,
            solve_min_cost_flow_graph,
        )
    except ImportError:
        print("k-means-constrained is not installed (pip install -e .[bench]): ours only")
        return None

    def solve(cost: np.ndarray, cap) -> np.ndarray:
        N = cost.shape[0]  # its graph builder only reads X's and C's lengths
        graph = minimum_cost_flow_problem_graph(np.zeros((N, 1)), np.zeros((K, 1)),
                                                cost.copy(), 0, cap)
        return solve_min_cost_flow_graph(*graph)

    return solve


def bench_assign(sizes: tuple[int, ...], repeats: int) -> None:
    kmc = _kmc()
    print(f"1. one balanced assignment step, K={K}; min CPU over repeats; ratio = kmc / ours")
    print(f"  {'N':>7} {'family':<11} {'step':<5} {'overfill':>8} {'ours':>10} {'kmc':>10} "
          f"{'ratio':>6}  total cost ours / kmc")
    for N in sizes:
        reps = repeats if N <= 10_000 else 1
        for family in FAMILIES:
            cost, cap, prev, nxt = instance(family, N)
            _, prices = balanced_assign(prev, cap, return_prices=True)
            for step, C, warm in (("cold", cost, None), ("warm", nxt, prices)):
                caps = np.broadcast_to(cap, (K,))
                over = int(np.maximum(np.bincount(C.argmin(1), minlength=K) - caps, 0).sum())
                labels, ours = cpu_min(lambda C=C, c=cap, w=warm: balanced_assign(C, c, prices=w),
                                       reps)
                mine = C[np.arange(N), labels].sum()
                line = f"  {N:>7} {family:<11} {step:<5} {over:>8} {ours * 1e3:>7.2f} ms"
                if kmc is None:
                    print(f"{line}  {mine:.6f}")
                    continue
                lab2, theirs = cpu_min(lambda C=C, c=cap: kmc(C, c), reps)
                other = C[np.arange(N), lab2].sum()
                print(f"{line} {theirs * 1e3:>7.2f} ms {theirs / ours:>6.1f}  "
                      f"{mine:.6f} / {other:.6f}", flush=True)


def bench_kmeans(sizes: tuple[int, ...]) -> None:
    print("2. balanced K-means, n_init=1, K=16, gamma rows: warm-started steps vs all cold")
    shipped = cluster.balanced_assign

    def cold(cost, capacity=None, *, prices=None, return_prices=False):
        return shipped(cost, capacity, return_prices=return_prices)

    for N in sizes:
        X = rows("gamma", N, np.random.default_rng(1))
        max_iter = 100 if N <= 10_000 else 15
        out = {}
        for name, fn in (("warm", shipped), ("cold", cold)):
            cluster.balanced_assign = fn
            try:
                km, cpu = cpu_min(lambda X=X, m=max_iter: BalancedKMeans(
                    K, n_init=1, max_iter=m, random_state=0).fit(X), 1)
            finally:
                cluster.balanced_assign = shipped
            out[name] = (km, cpu)
        (kw, tw), (kc, tc) = out["warm"], out["cold"]
        print(f"  N={N:>7}: {kw.n_iter_} iterations (max {max_iter}); warm {tw:.3f} s, "
              f"cold {tc:.3f} s CPU ({tc / tw:.1f}x); inertia {kw.inertia_:.6f} / "
              f"{kc.inertia_:.6f}")


def bench_whole_fit() -> None:
    from eldr.fit.artifact import fit_artifact
    from eldr.traces.synth import generate

    print("3. whole fit: R=1000 synthetic qwen3-30b-a3b (48x128, k=8) task requests, K=16")
    trace = generate("qwen3-30b-a3b", "task", num_requests=1000, seed=0, keep_topk=False)
    ids = [f"decode-{k}" for k in range(K)]
    w, c = time.perf_counter(), time.process_time()
    art = fit_artifact(trace, worker_ids=ids, random_state=0)
    cpu, wall = time.process_time() - c, time.perf_counter() - w
    s = art.fit_stats
    print(f"    rho {art.rho:.4f}, N* = {art.layers.size} layers, sizes "
          f"{min(s['cluster_sizes'])}..{max(s['cluster_sizes'])}")
    print(f"    cpu {cpu:.2f} s, wall {wall:.2f} s (encoder {s['encoder_seconds']:.2f} s, "
          f"K-means {s['kmeans_seconds']:.2f} s wall)  target <= 10 s, aim <= 3 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="repeats at N=1,000 (1 at 100k)")
    ap.add_argument("--smoke", action="store_true", help="N=1,000 only, 2 repeats, no fit")
    ap.add_argument("--skip-fit", action="store_true", help="only sections 1 and 2")
    args = ap.parse_args()
    sizes = (1000,) if args.smoke else (1000, 100_000)
    bench_assign(sizes, 2 if args.smoke else args.repeats)
    bench_kmeans(sizes)
    if not (args.skip_fit or args.smoke):
        bench_whole_fit()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
