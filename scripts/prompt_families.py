"""The prompt predictor on GPT-OSS-20B's real routing, in family and on a held-out family
(docs/real-models.md, "The prompt predictor on real data"):
:func:`eldr.fit.prompt_family.evaluate_families` fitted on half of the MMLU families' requests,
measured on their other half, on SORRY-Bench (never fitted on) and on both mixed.

    python scripts/prompt_families.py [--resamples 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from eldr.fit.prompt_family import VARIANTS, evaluate_families
from eldr.traces import load_real_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="gpt-oss-20b")
    p.add_argument("--fit-domains", nargs="+", default=["mmlu", "mmlu_pro"])
    p.add_argument("--heldout-domains", nargs="+", default=["sorry_bench"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--decoders", "-K", type=int, default=8)
    p.add_argument("--resamples", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    args = p.parse_args()
    t0 = time.perf_counter()
    results, facts = evaluate_families(
        load_real_trace(args.trace), fit_domains=args.fit_domains,
        heldout_domains=args.heldout_domains, num_decoders=args.decoders,
        resamples=args.resamples, seed=args.seed, variants=args.variants)
    facts["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"fit on {facts['requests']['fit']} requests of {args.fit_domains}; routed: "
          f"{facts['requests']['in_family']} in family, {facts['requests']['heldout_family']} "
          f"of {args.heldout_domains}; K = {args.decoders}, decode steps "
          f"{facts['window'][0]}-{facts['window'][1] - 1}, {args.resamples} resamples "
          f"({facts['seconds']} s)")
    for variant, gates in facts["gates"].items():
        for g in gates.values():
            print(f"gate [{variant}] {g['statistic']}: cv R^2 {g['cv_r2']:.3f} (min "
                  f"{g['min_r2']}), threshold {g['threshold']:.3f} (the {g['quantile']:g} "
                  f"quantile of the fit folds' held-out prompts)")
    for r in results:
        adm = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r.admitted.items())
        print(f"\n{r.variant} / {r.routed_set}: {r.requests} requests, R^2 {r.r2:.3f}, "
              f"gates admit: {adm}")
        for name, (rho, lo, hi) in r.rho.items():
            cuts = "  ".join(f"B={c.batch_size}: {100 * c.cut:+.1f}% [{100 * c.low:+.1f}, "
                             f"{100 * c.high:+.1f}] ({c.requests} req)" for c in r.cuts[name])
            print(f"  {name:<18} rho {rho:.3f} [{lo:.3f}, {hi:.3f}]  {cuts}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"facts": facts, "results": [r.as_dict() for r in results]}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
