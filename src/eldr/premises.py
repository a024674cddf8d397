"""Measurements of the paper's premises on a trace.

These are the statistics that make expert-locality routing worth doing (design.md §1):
prefill expert counts predict decode expert counts, and same-domain batches activate fewer
distinct experts. They are used to check synthetic traces against published numbers and to
report what real traces show.
"""

from __future__ import annotations

import numpy as np

from eldr.trace import Trace

__all__ = ["prefill_decode_pearson"]


def prefill_decode_pearson(trace: Trace) -> np.ndarray:
    """(R,) float64: per-request Pearson correlation of prefill vs decode per-expert counts.

    The two count vectors are flattened over all layers and experts (L*E entries each).
    A request whose prefill or decode counts are constant (e.g. no decode tokens) has no
    defined correlation: its entry is NaN, and callers summarise with ``nan``-aware
    statistics.
    """
    R = trace.num_requests
    x = trace.prefill_counts.reshape(R, -1).astype(np.float64)
    y = trace.decode_counts.reshape(R, -1).astype(np.float64)
    x -= x.mean(axis=1, keepdims=True)
    y -= y.mean(axis=1, keepdims=True)
    num = (x * y).sum(axis=1)
    den = np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1))
    out = np.full(R, np.nan)
    ok = den > 0
    out[ok] = num[ok] / den[ok]
    return out
