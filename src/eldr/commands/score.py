"""``eldr score TRACE``: signature quality ρ per representation, and the premise check."""

from __future__ import annotations

import argparse
import json

import numpy as np

HELP = "Score a trace: rho per signature representation, layer curve, prefill-decode Pearson."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eldr.fit.signature import REPRESENTATIONS

    p.add_argument("trace", help="trace file (.npz) written by eldr synth / capture")
    p.add_argument(
        "--representation", "-r", action="append", choices=REPRESENTATIONS, metavar="R",
        help=f"representation(s) to score (repeatable; default: all the trace supports). "
        f"One of: {', '.join(REPRESENTATIONS)}",
    )
    p.add_argument("--max-pairs", type=int, default=None,
                   help="rank a seeded sample of this many request pairs (default: all pairs)")
    p.add_argument("--selection-max-pairs", type=int, default=20_000,
                   help="pairs sampled during the greedy layer search (default 20000; 0 = all)")
    p.add_argument("--seed", type=int, default=0, help="seed for pair sampling")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def run(args: argparse.Namespace) -> int:
    from eldr.fit.premises import prefill_decode_pearson
    from eldr.fit.signature import REPRESENTATIONS, SignatureEncoder
    from eldr.traces.trace import load

    trace = load(args.trace)
    reps = args.representation or [
        r for r in REPRESENTATIONS
        if not (r == "gate_prob" and trace.prefill_gate_prob is None)
        and not (r == "gate_logit" and trace.prefill_gate_logit is None)
    ]
    sel_pairs = args.selection_max_pairs or None
    results = []
    for rep in reps:
        enc = SignatureEncoder(representation=rep, max_pairs=args.max_pairs,
                               selection_max_pairs=sel_pairs, random_state=args.seed)
        enc.fit(trace)
        all_layers = SignatureEncoder(representation=rep, layers=range(trace.meta.num_layers),
                                      max_pairs=args.max_pairs, random_state=args.seed).fit(trace)
        results.append({
            "representation": rep,
            "rho": enc.rho_,
            "rho_all_layers": all_layers.rho_,
            "layers": enc.layers_.tolist(),
            "num_layers_selected": int(enc.layers_.size),
            "rho_curve": [[layer, val] for layer, val in enc.rho_curve_],
        })
    pearson = prefill_decode_pearson(trace)
    finite = pearson[np.isfinite(pearson)]
    premise = {
        "requests": int(finite.size),
        "mean": float(finite.mean()) if finite.size else None,
        "quartiles": np.percentile(finite, [25, 50, 75]).tolist() if finite.size else None,
    }
    if args.json:
        print(json.dumps({"trace": trace.describe(), "representations": results,
                          "prefill_decode_pearson": premise}, indent=2))
        return 0
    print(trace.describe())
    print(f"\n{'representation':<14} {'rho':>7} {'rho(all L)':>10} {'N*':>4}  layers")
    for res in results:
        layers = ",".join(map(str, res["layers"]))
        print(f"{res['representation']:<14} {res['rho']:7.4f} {res['rho_all_layers']:10.4f} "
              f"{res['num_layers_selected']:4d}  {layers}")
    for res in results:
        if res["representation"] == "count_idf" and res["rho_curve"]:
            curve = "  ".join(f"+L{layer}:{val:.4f}" for layer, val in res["rho_curve"])
            print(f"\ncount_idf rho as layers are added (greedy): {curve}")
    if premise["mean"] is None:
        print("\nprefill-decode Pearson: undefined (no request has decode tokens)")
    else:
        q = premise["quartiles"]
        print(f"\nprefill-decode Pearson per request (n={premise['requests']}): mean "
              f"{premise['mean']:.3f}, quartiles {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} "
              f"(paper: 0.70-0.92 by model)")
    return 0
