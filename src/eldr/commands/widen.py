"""``eldr widen --width W``: build (or find) the wide tiny MoE and print where it is."""

from __future__ import annotations

import argparse

HELP = ("Build the tiny MoE with zero-padded expert FFNs of width W (same function, more "
        "bytes per expert) in a cache folder; print the folder, its size, the engine memory.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--width", type=int, required=True,
                   help="expert FFN width: a multiple of 32 in [32, 8192] (the shipped "
                   "tiny MoE's is 32)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where the model folders are kept (default $ELDR_CACHE_DIR, else "
                   "~/.cache/eldr)")


def run(args: argparse.Namespace) -> int:
    from eldr.capture import wide_engine_bytes, wide_tiny_moe_dir

    folder = wide_tiny_moe_dir(args.width, args.cache_dir)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    print(folder)
    print(f"size on disk: {size / 2**20:,.1f} MiB; estimated memory of one vLLM-CPU engine "
          f"serving it in float32: {wide_engine_bytes(args.width) / 2**30:.2f} GiB")
    return 0
