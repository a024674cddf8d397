"""Balanced clustering of signatures (docs/method.md#offline-fit): one centroid per decode worker.

- :func:`balanced_assign` — the exact capacitated assignment step: every row to one
  column, at most ``capacity`` rows per column, minimum total cost. Method and proof
  sketch in :mod:`eldr.fit.assign`.
- :class:`BalancedKMeans` — spherical (cosine) K-means whose every assignment step is
  ``balanced_assign`` on cost ``1 − cos``, so cluster sizes stay ≤ ⌈N/K⌉. With
  ``balanced=False`` it is vanilla spherical K-means (the paper's ablation: better median
  locality, worse tail because clusters, and so decoder loads, come out unequal).
"""

from __future__ import annotations

import numpy as np

from eldr.fit.assign import solve
from eldr.fit.rows import unit_rows

__all__ = ["BalancedKMeans", "balanced_assign"]


def balanced_assign(cost: np.ndarray, capacity: int | np.ndarray | None = None, *,
                    prices: np.ndarray | None = None, return_prices: bool = False):
    """Exact minimum-cost assignment of rows to columns with at most ``capacity`` each.

    ``cost`` (N, K) float (converted to float64); ``capacity`` an int for every column
    or (K,) ints per column, default ⌈N/K⌉. Returns labels (N,) int64 minimising
    ``cost[arange(N), labels].sum()`` subject to ``bincount(labels) <= capacity``; with
    ``return_prices=True``, ``(labels, prices)``: the column prices (K,) float64 (min 0)
    that certify the optimum — every row sits in a column of minimum ``cost + prices``,
    and a column left with room has price 0. Pass them back as ``prices`` to warm-start
    the next call on similar costs (the next K-means iteration); the result is just as
    exact, only faster. Exact (float64 arithmetic on the given costs, no scaling or
    rounding) and deterministic; without ``prices``, the plain ``argmin`` (lowest column
    on ties) whenever that already fits. Raises ``ValueError`` for NaN/Inf costs or
    prices, bad shapes, or when N > Σ capacity.
    """
    C = np.asarray(cost, dtype=np.float64)
    if C.ndim != 2 or C.shape[1] == 0:
        raise ValueError(f"balanced_assign: cost must be (N, K) with K >= 1, got shape {C.shape}")
    N, K = C.shape
    if not np.isfinite(C).all():
        raise ValueError("balanced_assign: cost contains NaN or Inf")
    caps = _capacities(capacity, N, K)
    if prices is not None:
        prices = np.asarray(prices, dtype=np.float64)
        if prices.shape != (K,) or not np.isfinite(prices).all():
            raise ValueError(f"balanced_assign: prices must be ({K},) finite floats, "
                             f"got shape {prices.shape}")
    if N == 0:
        labels, duals = np.zeros(0, dtype=np.int64), np.zeros(K)
    else:
        labels, duals = solve(np.ascontiguousarray(C), caps, prices)
    return (labels, duals) if return_prices else labels


def _capacities(capacity: int | np.ndarray | None, N: int, K: int) -> np.ndarray:
    """Per-column capacities (K,) int64 from an int, (K,) ints or None (⌈N/K⌉)."""
    if capacity is None or np.ndim(capacity) == 0:
        return np.full(K, _capacity(capacity, N, K, "balanced_assign"), dtype=np.int64)
    caps = np.asarray(capacity)
    if caps.shape != (K,) or caps.dtype == bool or not np.issubdtype(caps.dtype, np.integer):
        raise ValueError(f"balanced_assign: capacity must be an integer or ({K},) integers, "
                         f"got {capacity!r}")
    caps = caps.astype(np.int64)
    if (caps < 0).any() or N > int(caps.sum()):
        raise ValueError(f"balanced_assign: {N} rows do not fit capacities {caps.tolist()}")
    return caps


def _capacity(capacity: int | None, N: int, K: int, who: str) -> int:
    if capacity is None:
        return -(-N // K)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        raise ValueError(f"{who}: capacity must be an integer or None, got {capacity!r}")
    cap = int(capacity)
    if cap < 0 or N > K * cap:
        raise ValueError(f"{who}: {N} rows do not fit {K} clusters of capacity {cap}")
    return cap


class BalancedKMeans:
    """Spherical K-means with exactly balanced assignment steps.

    Rows of ``X`` are L2-normalised (all-zero rows stay zero: cosine 0 to every centroid,
    they fill whatever room is left). Centroids are re-normalised cluster means;
    initialisation is k-means++ on the cosine distance ``1 − cos`` (∝ squared Euclidean
    distance between unit vectors). An empty cluster is re-seeded with the row farthest
    from its centroid. The best of ``n_init`` runs (lowest inertia) is kept.

    Fitted attributes: ``cluster_centers_`` (K, d) float64 unit rows, ``labels_`` (N,)
    int64, ``inertia_`` = Σ (1 − cos(x_i, c_{label_i})), ``n_iter_`` (iterations of the
    kept run), ``capacity_`` (cluster size limit used; N when not balanced).
    """

    def __init__(self, n_clusters: int, *, balanced: bool = True, capacity: int | None = None,
                 n_init: int = 4, max_iter: int = 100, tol: float = 1e-7,
                 random_state: int | np.random.Generator | None = None) -> None:
        self.n_clusters = n_clusters
        self.balanced = balanced
        self.capacity = capacity
        self.n_init = n_init
        self.max_iter = max_iter
        self.tol = tol
        self.random_state = random_state

    # -- validation ------------------------------------------------------------------------
    def _check_params(self, N: int) -> int:
        K = self.n_clusters
        if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1:
            raise ValueError(f"BalancedKMeans: n_clusters must be a positive integer, got {K!r}")
        if K > N:
            raise ValueError(f"BalancedKMeans: n_clusters={K} exceeds the {N} rows to cluster")
        for name in ("n_init", "max_iter"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"BalancedKMeans: {name} must be a positive integer, got {v!r}")
        if not (np.isfinite(self.tol) and self.tol >= 0):
            raise ValueError(f"BalancedKMeans: tol must be finite and >= 0, got {self.tol!r}")
        if not self.balanced:
            if self.capacity is not None:
                raise ValueError("BalancedKMeans: capacity needs balanced=True")
            return N
        return _capacity(self.capacity, N, int(K), "BalancedKMeans")

    @staticmethod
    def _check_X(X, who: str) -> np.ndarray:
        X = np.asarray(X)
        if X.ndim != 2 or X.shape[1] == 0:
            raise ValueError(f"{who}: X must be (N, d) with d >= 1, got shape {X.shape}")
        if not np.issubdtype(X.dtype, np.floating) and not np.issubdtype(X.dtype, np.integer):
            raise ValueError(f"{who}: X must be numeric, got dtype {X.dtype}")
        X = X.astype(np.float64, copy=False)
        if not np.isfinite(X).all():
            raise ValueError(f"{who}: X contains NaN or Inf")
        return X

    # -- fitting ---------------------------------------------------------------------------
    def fit(self, X: np.ndarray, y: None = None) -> BalancedKMeans:
        """Cluster the rows of ``X`` (N, d) float. Returns ``self``."""
        X = self._check_X(X, "BalancedKMeans.fit")
        cap = self._check_params(X.shape[0])
        X = unit_rows(X)
        rng = np.random.default_rng(self.random_state)
        best = None
        for _ in range(int(self.n_init)):
            run = self._run(X, cap, rng)
            if best is None or run[2] < best[2]:
                best = run
        self.cluster_centers_, self.labels_, self.inertia_, self.n_iter_ = best
        self.capacity_ = cap
        return self

    def _assign(self, X: np.ndarray, centers: np.ndarray, cap: int,
                prices: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(labels, the assignment's column prices to warm-start the next iteration)."""
        cost = 1.0 - X @ centers.T
        if self.balanced:
            return balanced_assign(cost, cap, prices=prices, return_prices=True)
        return cost.argmin(1).astype(np.int64), None

    def _run(self, X: np.ndarray, cap: int, rng: np.random.Generator):
        K = int(self.n_clusters)
        centers = _kmeans_pp(X, K, rng)
        labels, prices = self._assign(X, centers, cap, None)
        n_iter = 0
        while n_iter < self.max_iter:
            n_iter += 1
            new = _update_centers(X, labels, centers)
            shift = float(np.max(1.0 - np.sum(new * centers, axis=1)))
            centers = new
            new_labels, prices = self._assign(X, centers, cap, prices)
            done = np.array_equal(new_labels, labels) or shift <= self.tol
            labels = new_labels
            if done:
                break
        inertia = float(np.sum(1.0 - np.einsum("ij,ij->i", X, centers[labels])))
        return centers, labels, inertia, n_iter

    def _check_fitted(self) -> None:
        if not hasattr(self, "cluster_centers_"):
            raise ValueError("BalancedKMeans: not fitted yet; call fit(X) first")

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Nearest centroid (highest cosine; lowest index on ties) per row: (N,) int64.

        Unconstrained on purpose: online, balance comes from the router's load band, not
        from capacities over a batch.
        """
        self._check_fitted()
        X = self._check_X(X, "BalancedKMeans.predict")
        if X.shape[1] != self.cluster_centers_.shape[1]:
            raise ValueError(f"BalancedKMeans.predict: X has {X.shape[1]} features, "
                             f"the model {self.cluster_centers_.shape[1]}")
        return (1.0 - unit_rows(X) @ self.cluster_centers_.T).argmin(1).astype(np.int64)

    def fit_predict(self, X: np.ndarray, y: None = None) -> np.ndarray:
        return self.fit(X).labels_


def _kmeans_pp(X: np.ndarray, K: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding on the cosine distance: (K, d) unit centroids."""
    N = X.shape[0]
    idx = [int(rng.integers(N))]
    dist = 1.0 - X @ X[idx[0]]
    for _ in range(1, K):
        w = np.maximum(dist, 0.0)
        w[idx] = 0.0
        total = w.sum()
        if total > 0:
            i = int(np.searchsorted(np.cumsum(w), rng.random() * total, side="right"))
            i = min(i, N - 1)
        else:  # every remaining row duplicates a chosen one: pick any unchosen row
            rest = np.setdiff1d(np.arange(N), idx)
            i = int(rest[rng.integers(rest.size)])
        idx.append(i)
        np.minimum(dist, 1.0 - X @ X[i], out=dist)
    centers = X[idx].copy()
    zero = np.linalg.norm(centers, axis=1) == 0
    if zero.any():  # a zero row seeded a centroid: give it a unit vector along axis 0
        centers[zero, 0] = 1.0
    return centers


def _update_centers(X: np.ndarray, labels: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Re-normalised cluster sums; empty (or all-zero) clusters are re-seeded."""
    K = old.shape[0]
    sums = np.zeros_like(old)
    _add_rows(sums, labels, X)
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    centers = np.divide(sums, norms, out=old.copy(), where=norms > 0)
    empty = np.flatnonzero(np.bincount(labels, minlength=K) == 0)
    if empty.size:
        far = np.argsort(np.einsum("ij,ij->i", X, centers[labels]), kind="stable")
        for k, i in zip(empty, far, strict=False):
            if np.linalg.norm(X[i]) > 0:
                centers[k] = X[i]
    return centers


def _add_rows(sums: np.ndarray, labels: np.ndarray, X: np.ndarray) -> None:
    """sums[k] = Σ X[labels == k], as one (K, N) × (N, d) product (no copy of X)."""
    onehot = np.zeros((sums.shape[0], X.shape[0]), dtype=X.dtype)
    onehot[labels, np.arange(X.shape[0])] = 1.0
    sums[:] = onehot @ X
