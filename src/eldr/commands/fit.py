"""``eldr fit TRACE``: fit the routing artifact (encoder + one centroid per decode worker)."""

from __future__ import annotations

import argparse
import sys

HELP = "Fit a routing artifact from a calibration trace (IDF, layer mask by rho, K-means)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eldr.fit.signature import REPRESENTATIONS

    p.add_argument("trace", help="calibration trace (.npz) written by eldr synth / capture")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--decoders", "-K", type=int, metavar="K",
                     help="number of decode workers (ids decode-0 .. decode-K-1)")
    who.add_argument("--workers", nargs="+", metavar="ID",
                     help="decode worker ids, one centroid each (as given to eldr serve)")
    p.add_argument("--tau", type=float, default=0.1,
                   help="locality band width stored for the eldr policy (default 0.1)")
    p.add_argument("--representation", "-r", default="count_idf", choices=REPRESENTATIONS,
                   metavar="R", help=f"signature representation (default count_idf). One of: "
                   f"{', '.join(REPRESENTATIONS)}")
    p.add_argument("--layers", type=int, nargs="+", metavar="L",
                   help="fixed layer mask (default: greedy forward selection by rho)")
    p.add_argument("--vanilla", action="store_true",
                   help="vanilla spherical K-means (no balance): the ablation")
    p.add_argument("--n-init", type=int, default=4, help="K-means restarts (default 4)")
    p.add_argument("--selection-max-pairs", type=int, default=20_000, metavar="P",
                   help="request pairs ranked per candidate in the greedy layer search "
                   "(default 20000; 0 = all pairs)")
    p.add_argument("--seed", type=int, default=0, help="seed for pair sampling and K-means")
    g = p.add_argument_group("prompt predictor (routing before prefill; fitted when the trace "
                             "has prompt_token_ids)")
    onoff = g.add_mutually_exclusive_group()
    onoff.add_argument("--no-prompt-predictor", action="store_true",
                       help="do not fit the prompt predictor")
    onoff.add_argument("--prompt-predictor", action="store_true",
                       help="fit it even on a synthetic trace (whose uniform token ids carry "
                       "nothing; by default it is fitted on captured traces only)")
    g.add_argument("--tokenizer", metavar="PATH",
                   help="the tokenizer.json (or model folder; 'tiny' for the shipped tiny "
                   "MoE) that made the trace's token ids: its fingerprint and vocabulary "
                   "size go into the artifact, and ids outside that vocabulary are refused "
                   "(default: unknown fingerprint, any id hashed)")
    g.add_argument("--model-config", metavar="PATH",
                   help="without --tokenizer: the model's config.json (or model folder; "
                   "'tiny' for the shipped tiny MoE), whose vocab_size is the predictor's "
                   "vocabulary (ids outside it refused)")
    g.add_argument("--prompt-bits", type=int, nargs="+", metavar="B",
                   help="candidate hash sizes 2**B (default 15 16 17 18)")
    g.add_argument("--prompt-ranks", type=int, nargs="+", metavar="R",
                   help="candidate ranks of the target basis (default 8 16 32 64)")
    g.add_argument("--prompt-alphas", type=float, nargs="+", metavar="A",
                   help="candidate ridge penalties, relative, or the token model's shrinkage "
                   "(default 0.001 ... 1)")
    g.add_argument("--prompt-weightings", nargs="+", metavar="W",
                   choices=("tfidf", "tf", "token"),
                   help="candidate models: tfidf, tf (ridge on hashed n-grams), token (per-token "
                   "experts, needs prefill_topk) (default all)")
    p.add_argument("--output", "-o", required=True, metavar="DIR",
                   help="artifact directory to write (replaced atomically if it exists)")


def run(args: argparse.Namespace) -> int:
    import time

    from eldr.fit import artifact
    from eldr.traces.trace import load

    if args.decoders is not None:
        if args.decoders < 1:
            raise ValueError(f"--decoders must be >= 1, got {args.decoders}")
        ids = [f"decode-{k}" for k in range(args.decoders)]
    else:
        ids = args.workers
    options = {name: tuple(value) for name, value in (
        ("bits", args.prompt_bits), ("ranks", args.prompt_ranks),
        ("alphas", args.prompt_alphas), ("weightings", args.prompt_weightings))
        if value is not None}
    tokenizer, config = args.tokenizer, args.model_config
    if "tiny" in (tokenizer, config):
        from eldr.capture import tiny_moe_dir

        tokenizer = tiny_moe_dir() if tokenizer == "tiny" else tokenizer
        config = tiny_moe_dir() if config == "tiny" else config
    t0 = time.perf_counter()
    trace = load(args.trace)
    print(trace.describe())
    if not trace.has_prefill:
        raise ValueError(
            "a routing artifact needs prefill counts (the router's signature is the prefill "
            "signature) and this trace is decode-only, so nothing is fitted. What the trace "
            "still tells: eldr score TRACE (rho and the distinct-expert cut of the "
            "whole-decode oracle, the first decode tokens as a labelled stand-in, domain "
            "labels and, with prompt token ids, the prompt predictor on decode profiles); "
            "docs/trace-format.md, 'Decode-only traces'")

    choice = False if args.no_prompt_predictor else (True if args.prompt_predictor else None)

    def stage(name: str) -> None:
        print(f"[{time.perf_counter() - t0:6.2f}s] {name} ...", file=sys.stderr, flush=True)

    art = artifact.fit_artifact(
        trace, worker_ids=ids, tau=args.tau, representation=args.representation,
        layers=args.layers, balanced=not args.vanilla, n_init=args.n_init,
        selection_max_pairs=args.selection_max_pairs or None, random_state=args.seed,
        prompt_predictor=choice, tokenizer=tokenizer,
        model_config=config, prompt_options=options, on_stage=stage,
    )
    out = artifact.save(art, args.output)
    for line in artifact.fit_report(art, trace, prompt_predictor=choice):
        print(line)
    print(f"wrote {out}")
    return 0
