"""Rebuild the real-routing traces shipped in src/eldr/data/real_routing/ from the two
recording folders (sources in that folder's README.md): `eldr import` on each, default
options (ESFT: the first half of each sequence as its prompt).

    python scripts/make_real_traces.py --recordings DIR   # DIR/gpt-oss-20b, DIR/esft-vanilla-lite
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eldr.traces.importers import import_trace
from eldr.traces.trace import save

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recordings", required=True, metavar="DIR",
                   help="folder holding gpt-oss-20b/ and esft-vanilla-lite/")
    args = p.parse_args()
    out = ROOT / "src" / "eldr" / "data" / "real_routing"
    out.mkdir(parents=True, exist_ok=True)
    for name, layout in (("gpt-oss-20b", "gpt-oss"), ("esft-vanilla-lite", "esft")):
        trace = import_trace(Path(args.recordings) / name, layout=layout)
        path = save(trace, out / f"{name}.npz")
        print(f"{path}: {trace.describe()} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
