"""``eldr learn``: what ``eldr serve --learn DIR`` collected (docs/learn.md).

``eldr learn export DIR -o trace.npz`` writes the buffered requests as a trace (the
project's format: ``eldr fit``, ``eldr score`` and the simulator read it);
``eldr learn status DIR`` prints the buffer and the learner's counters.
"""

from __future__ import annotations

import argparse
import json

HELP = "Export or inspect the calibration trace eldr serve --learn collected in DIR."


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ex = sub.add_parser("export", help="write the buffered requests as a trace (.npz)")
    ex.add_argument("directory", metavar="DIR", help="the --learn directory")
    ex.add_argument("--output", "-o", required=True, metavar="TRACE",
                    help="trace file to write (atomically)")
    ex.add_argument("--decode-only", action="store_true",
                    help="only requests whose decode counts the engines reported")
    st = sub.add_parser("status", help="print the buffer and the learner's counters")
    st.add_argument("directory", metavar="DIR", help="the --learn directory")
    st.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import numpy as np

    from eldr.learn import buffer as buffer_io
    from eldr.traces import trace as trace_io

    records, doc = buffer_io.load(Path(args.directory) / "buffer")
    if args.action == "status":
        state = doc.get("state") or {} if doc else {}
        info = {"requests": len(records),
                "with_decode": sum(r.decode_counts is not None for r in records),
                "seen": doc.get("num_seen", 0) if doc else 0,
                "dropped": doc.get("num_dropped", 0) if doc else 0,
                "model": doc.get("model") if doc else None, **state}
        print(json.dumps(info, indent=None if args.json else 2))
        return 0
    if args.decode_only:
        records = [r for r in records if r.decode_counts is not None]
    if not records:
        raise ValueError(f"{args.directory}: no buffered requests"
                         + (" with decode counts" if args.decode_only else ""))
    trace, known = buffer_io.records_to_trace(records, model=doc["model"],
                                              top_k=int(doc["top_k"]))
    trace_io.save(trace, args.output)
    print(f"{trace.describe()}; {int(np.sum(known))} with decode counts")
    print(f"wrote {args.output}")
    return 0
