"""``eldr import SOURCE -o TRACE``: recorded expert routing converted into an eldr trace
(layouts in :mod:`eldr.traces.importers`; docs/trace-format.md, "Importing recorded
routing"). The module is ``importing`` because ``import`` is a Python keyword."""

from __future__ import annotations

import argparse

HELP = ("Convert recorded routing (the shared GPT-OSS / ESFT recordings, or the generic "
        "JSONL / NPZ layout) into an eldr trace.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eldr.traces.importers import ESFT_DEFAULT_SPLIT, LAYOUTS

    p.add_argument("source", help="a recording folder (gpt-oss-20b/, esft-vanilla-lite/) or "
                   "a generic .jsonl / .npz file")
    p.add_argument("--output", "-o", required=True, metavar="TRACE",
                   help="trace file (.npz) to write")
    p.add_argument("--layout", default="auto", choices=LAYOUTS,
                   help="input layout (default: detected from the folder's files or the "
                   "file's extension)")
    p.add_argument("--split", type=float, default=ESFT_DEFAULT_SPLIT, metavar="F",
                   help="esft: share of each teacher-forced sequence taken as its prompt "
                   f"(default {ESFT_DEFAULT_SPLIT:g}: the first half)")
    g = p.add_argument_group("generic layouts (a header line of the JSONL file overrides them)")
    g.add_argument("--model", default="unknown", help="model name stored in the trace")
    g.add_argument("--num-experts", type=int, metavar="E",
                   help="routed experts per layer (default: 1 + the largest id seen)")
    g.add_argument("--licence", default="", help="licence of the routing data")
    g.add_argument("--source-url", default="", metavar="URL",
                   help="where the routing came from (stored as provenance)")
    g.add_argument("--block-size", type=int, default=16,
                   help="KV-cache block size in tokens (default 16)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eldr.traces.importers import GenericOptions, import_trace
    from eldr.traces.trace import save

    opts = GenericOptions(model=args.model, num_experts=args.num_experts,
                          licence=args.licence, source=args.source_url,
                          block_size=args.block_size)
    trace = import_trace(args.source, layout=args.layout, split=args.split, options=opts)
    out = save(trace, args.output)
    print(trace.describe())
    prov = trace.meta.provenance
    if "split" in prov:
        print(f"split: the first {prov['split']:g} of each sequence is its prompt")
    if not trace.has_prefill:
        print("decode-only: no prefill routing was recorded (prompt lengths"
              + (" and token ids" if trace.prompt_token_ids is not None else "")
              + " kept); see docs/trace-format.md for what each command does with it")
    print(f"licence: {trace.meta.licence or 'not stated'}")
    print(f"wrote {out} ({Path(out).stat().st_size / 1e6:.1f} MB)")
    return 0
