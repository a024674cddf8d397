"""``eldr score TRACE``: signature quality ρ per representation, the premise check,
(when the trace is a capture with prompt token ids) the prompt predictor beside the prefill
signature on held-out requests, and (on recorded per-token routing: an imported or captured
trace) the distinct-expert cut against round robin per routing input with bootstrap
intervals (:func:`eldr.fit.locality.real_locality`).

A decode-only trace (format version 2, no prefill routing) has no prefill signature: the
representations' ρ, the layer curve, the prefill–decode Pearson and the prefill-profile
prompt predictor are reported as n/a with the reason; the locality section then reports ρ
of what a router could use instead: the prompt prediction (prompt → decode profile, where
the trace has prompt token ids) and, labelled as a stand-in, the first decode tokens'
experts."""

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
    p.add_argument("--no-prompt", action="store_true",
                   help="skip the prompt predictor's held-out evaluation")
    p.add_argument("--prompt-heldout", type=float, default=0.5, metavar="F",
                   help="share of requests held out from the prompt predictor's fit "
                   "(default 0.5)")
    p.add_argument("--prompt-groups", type=int, metavar="K",
                   help="decoders the held-out requests are grouped into for routed "
                   "locality (default: held-out requests / 16, 2 to 8)")
    g = p.add_argument_group("locality: the distinct-expert cut per routing input, fitted on "
                             "half the requests, measured on the other half "
                             "(docs/real-models.md)")
    onoff = g.add_mutually_exclusive_group()
    onoff.add_argument("--locality", action="store_true",
                       help="measure it on any trace with per-token decode experts (default: "
                       "imported and captured traces only)")
    onoff.add_argument("--no-locality", action="store_true", help="skip it")
    g.add_argument("--decoders", "-K", type=int, metavar="K",
                   help="decoders (default: 8, 4 or 2, the most that hold 16 routed "
                   "requests each)")
    g.add_argument("--batch-sizes", type=int, nargs="+", metavar="B",
                   help="lockstep batch sizes (default: 2, 4, 8, ... while every decoder "
                   "holds two batches)")
    g.add_argument("--window", type=int, nargs=2, metavar=("START", "STOP"),
                   help="decode steps counted (default 0 24 with prefill routing, 16 64 "
                   "decode-only: after the 16 stand-in tokens)")
    g.add_argument("--resamples", type=int, default=500,
                   help="bootstrap resamples of the routed requests (default 500)")
    g.add_argument("--tau", type=float, default=0.1, help="locality band width (default 0.1)")


def run(args: argparse.Namespace) -> int:
    from eldr.traces.trace import load

    trace = load(args.trace)
    if trace.has_prefill:
        results, premise = _prefill_sections(trace, args)
        prompt, prompt_note = _prompt_section(trace, args)
    else:
        results, premise = [], None
        prompt, prompt_note = None, (
            "n/a: decode-only trace (the prefill-profile predictor needs prefill counts; "
            "the locality section evaluates prompt -> decode profile instead)")
    locality, locality_note = _locality_section(trace, args)
    if args.json:
        print(json.dumps({"trace": trace.describe(), "has_prefill": trace.has_prefill,
                          "licence": trace.meta.licence,
                          "provenance": trace.meta.provenance,
                          "representations": results,
                          "representations_note": None if trace.has_prefill else _NO_PREFILL,
                          "prefill_decode_pearson": premise, "prompt_predictor": prompt,
                          "prompt_predictor_note": prompt_note,
                          "locality": None if locality is None else locality.as_dict(),
                          "locality_note": locality_note}, indent=2))
        return 0
    print(trace.describe())
    if trace.meta.licence:
        print(f"licence: {trace.meta.licence}")
    if trace.has_prefill:
        _print_prefill(results, premise)
    else:
        print(f"\nrho per representation, layer curve, prefill-decode Pearson: {_NO_PREFILL}")
    _print_prompt(prompt, prompt_note)
    _print_locality(locality, locality_note)
    return 0


_NO_PREFILL = ("n/a: decode-only trace, no prefill routing recorded (no prefill signature to "
               "rank). rho of what a router could use instead is in the locality section: "
               "the prompt prediction's, and the first decode tokens' as a labelled stand-in")


def _prefill_sections(trace, args) -> tuple[list[dict], dict]:
    """(ρ per representation, the prefill-decode Pearson summary)."""
    from eldr.fit.premises import prefill_decode_pearson
    from eldr.fit.signature import REPRESENTATIONS, SignatureEncoder

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
    return results, premise


def _print_prefill(results: list[dict], premise: dict) -> None:
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


def _locality_section(trace, args):
    """(LocalityReport, None) or (None, why it was not measured)."""
    if args.no_locality:
        return None, "skipped (--no-locality)"
    if trace.decode_topk is None:
        return None, "the trace has no per-token decode experts (decode_topk)"
    recorded = trace.meta.source.startswith(("imported:", "captured:"))
    if not (recorded or args.locality):
        return None, (f"not measured on a {trace.meta.source.split(':')[0]} trace by default "
                      "(--locality measures it)")
    from eldr.fit.locality import Window, real_locality

    try:
        rep = real_locality(
            trace, num_decoders=args.decoders, batch_sizes=args.batch_sizes,
            window=None if args.window is None else Window(*args.window), tau=args.tau,
            resamples=args.resamples, seed=args.seed)
    except ValueError as exc:
        return None, f"not measured: {exc}"
    return rep, None


def _print_locality(rep, note: str | None) -> None:
    if rep is None:
        print(f"\nlocality: {note}")
        return
    w = rep.window
    print(f"\nlocality: {rep.num_eligible} requests with >= {w.stop} decode steps, fitted on "
          f"{rep.num_fit}, {rep.num_routed} routed to K = {rep.num_decoders} decoders "
          f"(locality band, tau {rep.tau:g}); distinct experts per layer per decode step "
          f"{w.start}-{w.stop - 1} in lockstep batches of B; 95% intervals over "
          f"{rep.resamples} bootstrap resamples of the routed requests (seed {rep.seed})")
    print(f"{'routing input':<32} {'rho [95% CI]':>22}  {'B':>3} {'routed':>7} {'rr':>7} "
          f"{'cut [95% CI]':>22} {'requests':>9}")
    for item in rep.inputs:
        rho = f"{item.rho:.3f} [{item.rho_low:.3f}, {item.rho_high:.3f}]"
        for i, c in enumerate(item.cuts):
            head = f"{item.label:<32} {rho:>22}" if i == 0 else " " * 55
            cut = f"{100 * c.cut:+.1f}% [{100 * c.low:+.1f}, {100 * c.high:+.1f}]"
            print(f"{head}  {c.batch_size:3d} {c.distinct:7.2f} {c.round_robin:7.2f} "
                  f"{cut:>22} {c.requests:9d}")
        if item.note:
            print(f"{'':<4}({item.note})")
    for name, why in rep.skipped.items():
        print(f"{name}: n/a ({why})")
    print("cut = 1 - routed / round robin (positive: fewer distinct experts); requests = "
          "routed requests the batches rest on (K x batches x B)")


def _prompt_section(trace, args) -> tuple[dict | None, str | None]:
    """(held-out evaluation as a dict, None), or (None, why it was not run)."""
    if args.no_prompt:
        return None, "skipped (--no-prompt)"
    if trace.prompt_token_ids is None:
        return None, "the trace has no prompt_token_ids"
    if trace.meta.source.startswith("synthetic"):
        return None, ("synthetic trace: its token ids are drawn uniformly, so a prompt "
                      "predictor has nothing to learn; evaluate it on a captured trace")
    from eldr.fit.prompt_eval import evaluate_prompt_predictor

    usable = int(((trace.prompt_lens > 0) & (trace.decode_lens > 0)).sum())
    groups = args.prompt_groups
    if groups is None:
        groups = int(min(8, max(2, round(args.prompt_heldout * usable) // 16)))
    try:
        ev = evaluate_prompt_predictor(trace, heldout=args.prompt_heldout, num_groups=groups,
                                       random_state=args.seed)
    except ValueError as exc:
        return None, f"not evaluated: {exc}"
    return ev.as_dict(), None


def _print_prompt(res: dict | None, note: str | None) -> None:
    if res is None:
        print(f"\nprompt predictor: {note}")
        return
    p = res["predictor"]
    print(f"\nprompt predictor (routing before prefill), fitted on {res['num_fit']} requests, "
          f"held-out {res['num_heldout']}: 2**{p['bits']} buckets ({p['weighting']}), rank "
          f"{p['rank']}, alpha {p['alpha']:g}; R^2 of the prefill profile {res['r2']:.3f}")
    print(f"{'routing input':<18} {'rho':>7} {'distinct/layer/step':>20} "
          f"{'vs round robin':>15}   ({res['num_groups']} decoders)")
    names = {"prompt": "prompt predictor", "prefill": "prefill signature",
             "tfidf": "token TF-IDF"}
    for key, name in names.items():
        print(f"{name:<18} {res['rho'][key]:7.4f} "
              f"{res['distinct_experts_per_step'][key]:20.2f} "
              f"{-100 * res['reduction_vs_round_robin'][key]:+14.1f}%")
    print(f"{'round robin':<18} {'':>7} {res['round_robin']:20.2f}")
