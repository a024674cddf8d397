"""The linear models of the prompt predictor (``tfidf``, ``tf``; :mod:`eldr.fit.prompt`):
ridge regression from hashed n-gram features onto the profiles' coordinates in a reduced
target basis, solved in the dual.

The R × R kernel of the requests' feature rows (:class:`Design`: sparse rows, a dense
block for frequent buckets and pairs for rare ones) is computed once per feature set;
:func:`ridge_fold_predictions` serves every fold and α from one eigendecomposition of a
fold's centred kernel, and :func:`ridge` fits the chosen candidate on every request and
stores it in the primal (``(2**bits, rank)`` weights, one row gathered per n-gram).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Design", "ridge", "ridge_fold_predictions"]


class Design:
    """Sparse rows (R requests × 2**bits buckets) as column-sorted COO, for the kernel
    X X^T and for X^T A.

    A column (bucket) shared by many requests (a frequent token) is cheapest as part of a
    dense block multiplied by BLAS (R² flops each); a rare one as the pairs of its own
    requests (n² scattered products). Columns holding more than R / 16 requests go dense,
    the rest are expanded into pairs a chunk at a time, so the kernel costs about
    R² · (dense columns) + Σ n² over the rest, never R² · (all buckets used).
    """

    _PAIRS_PER_CHUNK = 1 << 22  # bounded memory of the pair expansion
    _ENTRIES_PER_CHUNK = 1 << 20  # bounded memory of X^T A

    def __init__(self, rows: list[tuple[np.ndarray, np.ndarray]], num_buckets: int) -> None:
        self.num_rows = R = len(rows)
        self.num_buckets = num_buckets
        r = np.concatenate([np.full(b.size, i, dtype=np.intp) for i, (b, _) in enumerate(rows)])
        c = np.concatenate([b for b, _ in rows])
        v = np.concatenate([w for _, w in rows]).astype(np.float64)
        used, col = np.unique(c, return_inverse=True)
        order = np.argsort(col, kind="stable")
        self.used = used  # (U,) bucket of each compact column
        self.rows, self.cols, self.vals = r[order], col[order], v[order]
        self.bounds = np.searchsorted(self.cols, np.arange(used.size + 1))
        sizes = np.diff(self.bounds)
        self.dense = np.flatnonzero(sizes > max(1, R // 16))  # compact columns, dense part
        self.sparse = np.flatnonzero(sizes <= max(1, R // 16))

    def _dense_block(self) -> np.ndarray:
        """(R, number of dense columns) float64."""
        d = np.zeros((self.num_rows, self.dense.size))
        for j, c in enumerate(self.dense):
            s0, s1 = self.bounds[c], self.bounds[c + 1]
            d[self.rows[s0:s1], j] = self.vals[s0:s1]
        return d

    def gram(self) -> np.ndarray:
        """(R, R) float64 X X^T."""
        R = self.num_rows
        d = self._dense_block()
        k = d @ d.T
        sizes = np.diff(self.bounds)[self.sparse]
        cost = np.cumsum(sizes.astype(np.int64) ** 2)
        start = 0
        while start < self.sparse.size:  # columns [start, stop) expanded into pairs
            stop = int(np.searchsorted(cost, (cost[start - 1] if start else 0)
                                       + self._PAIRS_PER_CHUNK, side="right"))
            stop = max(stop, start + 1)
            cols = self.sparse[start:stop]
            n = np.diff(self.bounds)[cols]
            first = self.bounds[cols]
            # entry e of column c pairs with each of the n_c entries of c
            entry = _ranges(first, n)
            reps = np.repeat(n, n)  # each entry repeated n_c times
            left = np.repeat(entry, reps)
            col_first = np.repeat(np.repeat(first, n), reps)
            within = np.arange(left.size) - np.repeat(np.cumsum(reps) - reps, reps)
            right = col_first + within
            flat = self.rows[left] * R + self.rows[right]
            k += np.bincount(flat, weights=self.vals[left] * self.vals[right],
                             minlength=R * R).reshape(R, R)
            start = stop
        return k

    def transpose_times(self, a: np.ndarray) -> np.ndarray:
        """(2**bits, r) float64 X^T a for a (R, r)."""
        out = np.zeros((self.num_buckets, a.shape[1]))
        U = self.used.size
        c0 = 0
        while c0 < U:  # columns [c0, c1) hold at most _ENTRIES_PER_CHUNK entries (or one)
            c1 = int(np.searchsorted(self.bounds, self.bounds[c0] + self._ENTRIES_PER_CHUNK,
                                     side="right")) - 1
            c1 = min(max(c1, c0 + 1), U)
            s0, s1 = self.bounds[c0], self.bounds[c1]
            prod = self.vals[s0:s1, None] * a[self.rows[s0:s1]]
            out[self.used[c0:c1]] = np.add.reduceat(prod, self.bounds[c0:c1] - s0, axis=0)
            c0 = c1
        return out

    def mean_row(self) -> np.ndarray:
        """(2**bits,) float64 mean feature row x̄."""
        out = np.bincount(self.used[self.cols], weights=self.vals, minlength=self.num_buckets)
        return out / max(self.num_rows, 1)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), vectorised."""
    total = int(lengths.sum())
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + (np.arange(total) - offsets)


def _center(k: np.ndarray, train: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Kernel rows ``rows`` × columns ``train`` of the features centred on ``train``."""
    ktt = k[np.ix_(train, train)]
    col_mean = ktt.mean(axis=0)
    krt = k[np.ix_(rows, train)]
    return krt - krt.mean(axis=1, keepdims=True) - col_mean[None, :] + col_mean.mean()


def ridge_fold_predictions(k: np.ndarray, target: np.ndarray, alphas: Sequence[float],
                            train: np.ndarray, held_out: np.ndarray, mean: np.ndarray,
                            basis: np.ndarray):
    """Yield (alpha, (R_v, rank_max) float64 predicted basis coordinates of the requests
    ``held_out``) of the kernel ridge fitted on ``train``, per alpha: one eigendecomposition
    of the centred training kernel serves every alpha. ``k`` (R, R) kernel of all requests,
    ``target`` (R, L·E), ``mean`` and ``basis`` the fold's."""
    yc = target[train] - mean
    kc = _center(k, train, train)
    scale = max(float(np.trace(kc)) / train.size, 1e-12)
    lam, q = np.linalg.eigh(kc)
    lam = np.maximum(lam, 0.0) / scale
    g = q.T @ (yc @ basis.T)  # (R_t, rank_max)
    kq = _center(k, train, held_out) @ q / scale
    for a in alphas:
        yield a, (kq / (lam + a)) @ g


def ridge(features, bits: int, yc: np.ndarray, basis: np.ndarray, mean: np.ndarray,
           alpha: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights (2**bits, rank), intercept (L·E,), idf) of the ridge on every request."""
    idf, rows = features
    design = Design(rows, 1 << bits)
    k = design.gram()
    R = yc.shape[0]
    everyone = np.arange(R)
    kc = _center(k, everyone, everyone)
    scale = max(float(np.trace(kc)) / R, 1e-12)
    lam, q = np.linalg.eigh(kc)
    # ridge with penalty alpha · scale (alpha relative to the mean self-similarity)
    a_dual = (q / (np.maximum(lam, 0.0) + alpha * scale)) @ (q.T @ (yc @ basis.T))
    weights = design.transpose_times(a_dual) - np.outer(design.mean_row(), a_dual.sum(0))
    # prediction = mean + (x - x̄) W B = (mean - x̄ W B) + x W B: fold x̄ W B into mean_
    intercept = mean - (design.mean_row() @ weights) @ basis
    return weights, intercept, idf
