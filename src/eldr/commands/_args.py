"""Argument types the sub-commands share (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse
import math


def positive_floats(text: str) -> tuple[float, ...]:
    """Comma-separated positive finite numbers ("20,60,100"): request rates and the like.

    A bad list is argparse's usage error (exit 2) naming the text; NaN and inf are refused
    with the rest, so a rate of ``nan`` cannot reach a simulation.
    """
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None
    if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals
