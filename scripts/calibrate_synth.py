"""Offline helper used to fit ``eldr.traces.synth.CALIBRATION`` by hand, against the premises only.

It generates count-path traces for one model and workload with some parameters changed,
and prints every premise next to its published target (plus ρ of the other
representations, for insight). It never looks at a routing outcome (TPOT, TTFT, ...):
the generator must not be tuned to the results it is used to evaluate.

    python scripts/calibrate_synth.py qwen3-30b-a3b task --requests 600 \
        --set domain_strength=1.8 --set decode_drift=0.5,0.6

Each ``--set name=v1,v2,...`` adds a grid axis; every combination is measured.
"""

from __future__ import annotations

import argparse
import itertools
import time

from eldr.fit.premises import calibration_report, representation_rho
from eldr.traces.synth import generate, with_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--topk", action="store_true", help="use the token path (slow)")
    ap.add_argument("--all-reps", action="store_true", help="also print ρ of count, gate_logit")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2")
    args = ap.parse_args()
    axes = []
    for item in args.set:
        name, _, values = item.partition("=")
        axes.append([(name, float(v) if "." in v else int(v)) for v in values.split(",")])
    for combo in itertools.product(*axes) if axes else [()]:
        changes = dict(combo)
        params = with_params(args.model, args.workload, **changes)
        t0 = time.perf_counter()
        trace = generate(args.model, args.workload, num_requests=args.requests,
                         seed=args.seed, keep_topk=args.topk, params=params)
        gen_s = time.perf_counter() - t0
        rows = calibration_report(trace, workload=args.workload)
        cells = [f"{'ok' if r.ok else 'NO'} {r.measured:+.3f}" for r in rows]
        extra = ""
        if args.all_reps:
            rho = representation_rho(trace, ("count", "gate_logit"), max_requests=600)
            extra = " ".join(f"{k}={v:.3f}" for k, v in rho.items())
        detail = " | ".join(r.detail for r in rows[2:3])
        print(f"{changes} gen {gen_s:.1f}s :: " + " | ".join(cells) + f" :: {detail} {extra}",
              flush=True)


if __name__ == "__main__":
    main()
