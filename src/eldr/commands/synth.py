"""``eldr synth``: write a calibrated synthetic routing trace and check it against the paper."""

from __future__ import annotations

import argparse
import sys
import time

HELP = "Generate a calibrated synthetic expert-routing trace (.npz) and print its premises."

# Refuse per-token top-k arrays beyond this size unless --force (they live in memory).
_TOPK_LIMIT_BYTES = 2 * 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eldr.traces.models import PRESETS
    from eldr.traces.synth import DEFAULT_TRACE
    from eldr.traces.workloads import WORKLOADS

    p.add_argument("--model", default=DEFAULT_TRACE["model"], choices=sorted(PRESETS),
                   help=f"model preset (default {DEFAULT_TRACE['model']})")
    p.add_argument("--workload", default=DEFAULT_TRACE["workload"], choices=sorted(WORKLOADS),
                   help=f"request mix (default {DEFAULT_TRACE['workload']})")
    p.add_argument("--requests", "-n", type=int, default=None,
                   help="number of requests (default: the workload's, 12000 task / 14000 "
                   "language)")
    p.add_argument("--seed", "-s", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--no-topk", action="store_true",
                   help="do not route tokens one by one: draw per-request counts directly "
                   "(much faster: docs/synth.md, 'Speed'; no prefill_topk/decode_topk in "
                   "the trace)")
    p.add_argument("--default", action="store_true",
                   help="write the embedded default trace (eldr.traces.synth.DEFAULT_TRACE) "
                   "and ignore "
                   "--model/--workload/--requests/--seed/--no-topk")
    p.add_argument("--force", action="store_true",
                   help=f"allow per-token top-k arrays above {_TOPK_LIMIT_BYTES >> 30} GiB")
    p.add_argument("--no-check", action="store_true",
                   help="skip the calibration report (premises vs published targets)")
    p.add_argument("-o", "--output", required=True, help="output trace file (.npz)")


def run(args: argparse.Namespace) -> int:
    from eldr.fit.premises import calibration_report, format_report
    from eldr.traces.models import get_preset
    from eldr.traces.synth import DEFAULT_TRACE, default_trace, generate
    from eldr.traces.trace import save
    from eldr.traces.workloads import get_workload

    t0 = time.perf_counter()
    if args.default:
        trace = default_trace(progress=True)
    else:
        preset, wl = get_preset(args.model), get_workload(args.workload)
        n = wl.num_requests if args.requests is None else args.requests
        if n <= 0:
            raise ValueError(f"--requests must be positive, got {n}")
        if not args.no_topk:
            tokens = n * (wl.prompt_len.mean() + wl.output_len.mean())
            est = tokens * preset.num_layers * preset.top_k * 2
            if est > _TOPK_LIMIT_BYTES and not args.force:
                raise ValueError(
                    f"per-token top-k for {n} requests needs about {est / 2**30:.1f} GiB of "
                    f"memory; use --no-topk (counts only), fewer --requests, or --force")
        trace = generate(preset, wl, num_requests=n, seed=args.seed,
                         keep_topk=not args.no_topk, progress=True)
    gen_s = time.perf_counter() - t0
    path = save(trace, args.output)
    print(f"{trace.describe()}\nwrote {path} in {gen_s:.1f} s"
          + (f" (embedded default {DEFAULT_TRACE})" if args.default else ""))
    if not args.no_check:
        rows = calibration_report(trace)
        print("\ncalibration (measured on this trace vs the paper's premises):")
        print(format_report(rows))
        if any(r.ok is False for r in rows):
            print("warning: some premises are outside their targets (small traces are "
                  "noisy; see docs/synth.md)", file=sys.stderr)
    return 0
