"""Rebuild the real-routing traces shipped in src/eldr/data/real_routing/ from the
recordings in ../shared/data/real-routing/ (README there): `eldr import` on each, default
options (ESFT: the first half of each sequence as its prompt).

    python scripts/make_real_traces.py [--shared ../shared/data/real-routing]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eldr.traces.importers import import_trace
from eldr.traces.trace import save

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", default=str(ROOT.parent / "shared" / "data" / "real-routing"))
    args = p.parse_args()
    out = ROOT / "src" / "eldr" / "data" / "real_routing"
    out.mkdir(parents=True, exist_ok=True)
    for name, layout in (("gpt-oss-20b", "gpt-oss"), ("esft-vanilla-lite", "esft")):
        trace = import_trace(Path(args.shared) / name, layout=layout)
        path = save(trace, out / f"{name}.npz")
        print(f"{path}: {trace.describe()} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
