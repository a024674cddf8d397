"""The prompt predictor's memory-layout choices, each against the plain numpy it replaced
(docs/fit-and-routing.md, "The prompt predictor", "Layout choices"): why the code does
what its comments say, with the figures here instead of in the code.

1. The weight table's rows 64-byte aligned and padded to whole cache lines
   (:func:`eldr.fit.prompt._aligned_rows`) against numpy's allocation (a large array
   starts 16 bytes past a line): the gather of a 2,048-token prompt's 4,095 n-gram rows
   of a (2**16, rank) float32 table, rank 32 and 46, then summed.
2. The ``tf`` / ``token`` sum: ``ones @ np.take(rows, buckets, axis=0)`` (what predict
   does) against ``rows[buckets].sum(axis=0)``.
3. Sorting a prompt's 4,095 buckets as int32 (what the tfidf features do) against uint64.
4. The target basis of a fit (:func:`eldr.fit.prompt._target_basis`, a seeded randomized
   range finder of rank 64 + 10) against a full SVD, on 700 centred requests of a 48 × 128
   model (700 × 6,144).

Per case the median over ``--repeats`` runs of each, the two run alternately (wall clock,
one thread: the BLAS and OpenMP pools set to 1).

Run: ``python benchmarks/bench_prompt_layout.py [--repeats 2000]``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from eldr.fit.prompt import _aligned_rows, _target_basis


def _paired_us(before, after, repeats: int) -> tuple[float, float]:
    """Median µs of ``before()`` and of ``after()``, run alternately (on a shared machine
    the load drifts: each pair of runs sees the same), after a warm-up of both."""
    for _ in range(min(50, repeats)):  # warm the caches and the allocator
        before()
        after()
    times = np.empty((repeats, 2))
    for i in range(repeats):
        order = (0, 1) if i % 2 else (1, 0)  # which runs first alternates too
        for j in order:
            t0 = time.perf_counter()
            (before, after)[j]()
            times[i, j] = time.perf_counter() - t0
    b, a = np.median(times, axis=0) * 1e6
    return float(b), float(a)


def _off_line(table: np.ndarray, offset: int = 16) -> np.ndarray:
    """A copy of ``table`` starting ``offset`` bytes past a 64-byte line (numpy's usual
    placement of a large array)."""
    nbytes = table.nbytes
    buf = np.zeros(nbytes + 128, dtype=np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    out = buf[start:start + nbytes].view(np.float32).reshape(table.shape)
    out[...] = table
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    buckets = rng.integers(0, 1 << 16, 4095)
    ones = np.ones(buckets.size, dtype=np.float32)
    rows = []
    for rank in (32, 46):
        table = rng.standard_normal((1 << 16, rank)).astype(np.float32)
        plain, aligned = _off_line(table), _aligned_rows(table)
        rows.append((f"1. gather 4,095 rows, rank {rank}: 16 B past a line / aligned+padded"
                     f" (width {aligned.shape[1]})", *_paired_us(
                         lambda t=plain: ones @ np.take(t, buckets, axis=0),
                         lambda t=aligned: ones @ np.take(t, buckets, axis=0), args.repeats)))
        if rank == 32:
            rows.append(("2. sum of the rows: fancy indexing + .sum(0) / np.take + ones @",
                         *_paired_us(lambda t=plain: t[buckets].sum(axis=0),
                                     lambda t=plain: ones @ np.take(t, buckets, axis=0),
                                     args.repeats)))
    b64 = rng.integers(0, 1 << 16, 4095).astype(np.uint64)
    b32 = b64.astype(np.int32)
    rows.append(("3. sort 4,095 buckets: uint64 / int32",
                 *_paired_us(lambda: np.sort(b64), lambda: np.sort(b32), args.repeats)))
    yc = rng.random((700, 6144))
    yc -= yc.mean(axis=0)
    few = max(3, args.repeats // 200)
    rows.append(("4. target basis of 700 x 6,144: full SVD / randomized range finder",
                 *_paired_us(lambda: np.linalg.svd(yc, full_matrices=False),
                             lambda: _target_basis(yc, 64), few)))
    print(f"{'case':<86} {'before us':>11} {'after us':>10} {'ratio':>6}")
    for name, before, after in rows:
        print(f"{name:<86} {before:>11.1f} {after:>10.1f} {before / after:>6.2f}")


if __name__ == "__main__":
    main()
