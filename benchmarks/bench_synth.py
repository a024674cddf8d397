"""Speed of the synthetic trace generator (target: 12k Qwen3-30B requests in <= 60 s, 1 core).

Measures, in one process pinned to one BLAS thread:

* count path (``keep_topk=False``): the full default ``task`` workload (12,000 requests)
  for Qwen3-30B-A3B: the figure the target is about;
* token path (``keep_topk=True``): a smaller run, reported per request and as a ratio to
  the count path measured in the same run (the baseline);
* the calibration report of the 12k trace (premises vs targets).

    python benchmarks/bench_synth.py [--requests 12000] [--topk-requests 300]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import time  # noqa: E402

from eldr.fit.premises import calibration_report, format_report  # noqa: E402
from eldr.traces.synth import generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--workload", default="task")
    ap.add_argument("--requests", type=int, default=12_000)
    ap.add_argument("--topk-requests", type=int, default=300)
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core

    t0, c0 = time.perf_counter(), time.process_time()
    trace = generate(args.model, args.workload, num_requests=args.requests, seed=0,
                     keep_topk=False)
    count_s, count_cpu = time.perf_counter() - t0, time.process_time() - c0
    per_count = count_s / args.requests
    tokens = int(trace.prompt_lens.sum() + trace.decode_lens.sum())
    print(f"count path: {args.requests} requests ({tokens:,} tokens, "
          f"L={trace.meta.num_layers}) in {count_s:.1f} s wall, {count_cpu:.1f} s CPU "
          f"({per_count * 1e3:.2f} ms/request); target <= 60 s: "
          f"{'met' if count_s <= 60 else 'MISSED'}")

    t0 = time.perf_counter()
    small = generate(args.model, args.workload, num_requests=args.topk_requests, seed=0,
                     keep_topk=True)
    topk_s = time.perf_counter() - t0
    per_topk = topk_s / args.topk_requests
    mib = (small.prefill_topk.nbytes + small.decode_topk.nbytes) / 2**20
    print(f"token path: {args.topk_requests} requests in {topk_s:.1f} s "
          f"({per_topk * 1e3:.1f} ms/request, {per_topk / per_count:.0f}x the count path; "
          f"top-k arrays {mib:.0f} MiB)")

    if not args.no_report:
        t0 = time.perf_counter()
        rows = calibration_report(trace)
        print(f"calibration report of the count-path trace ({time.perf_counter() - t0:.1f} s):")
        print(format_report(rows))


if __name__ == "__main__":
    main()
