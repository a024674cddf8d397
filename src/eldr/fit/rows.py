"""Rows scaled to unit length: the one normalisation the encoder, the clustering and the
locality analysis share (cosine similarity is then a dot product).

:func:`unit_rows` is float64 throughout: signatures are stored as float32 unit rows, but
the K-means iterations and the pair distances behind ρ add many products, and they do it
on the float64 rows this returns.
"""

from __future__ import annotations

import numpy as np

__all__ = ["unit_rows"]


def unit_rows(x: np.ndarray) -> np.ndarray:
    """(N, d) float64 copy of the rows of ``x`` (N, d) scaled to unit L2 norm; all-zero
    rows stay zero (cosine 0 with everything, by the callers' convention).

    The norms are one ``einsum`` pass (no (N, d) temporary of squares, as
    ``np.linalg.norm`` makes); they may differ from ``np.linalg.norm``'s in the last bits
    (another summation order; tests/test_fit_rows.py)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"unit_rows expects (N, d) rows, got shape {x.shape}")
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))
    out = np.zeros_like(x)
    # the same quotients as out[ok] = x[ok] / norms[ok, None], without copying the rows
    np.divide(x, norms[:, None], out=out, where=(norms > 0)[:, None])
    return out
