"""Exact capacitated assignment (the transportation problem with few columns).

Problem: rows ``i < N`` each go to one column ``k < K`` at cost ``C[i, k]``; column ``k``
takes at most ``caps[k]`` rows; minimise the total cost. K is small (decode workers), N is
large (calibration requests), so everything is organised around K-dimensional duals.

Duality. Add a dummy row carrying the ``S = Σ caps − N`` unused slots at cost 0 everywhere,
so every column is filled exactly. An assignment is optimal iff there are column prices
``p`` (K,) with every row in a column of minimum ``C[i, k] + p[k]`` and every unused slot
in a column of minimum ``p[k]`` (complementary slackness). :func:`solve` returns such
prices with its labels: they certify the optimum, and they warm-start the next call when
the costs change a little (the next K-means iteration).

Two phases, because exactness and speed want different tools:

1. :func:`entropic_prices` (speed). Damped Newton on the entropy-smoothed dual
   ``Σ_i −ε·log Σ_k exp(−(C[i,k] + p_k)/ε) − Σ_k caps_k·p_k`` (+ the dummy row) in K
   dimensions: gradient = softmin column sums − caps, Hessian = a K×K weighted graph
   Laplacian, solved exactly, inside a trust radius (4ε at a stage's start, widened
   whenever the model holds); a step is accepted when the smoothed dual rises or the
   imbalance halves. ε starts at the 90th percentile of the rows' best-vs-second gaps and
   shrinks 4× whenever a stage's Newton step falls below ε/2;
   on large N the first stages run on evenly spaced subsamples (N/4^j rows, fractional
   capacities), and rows whose best column beats the second by ≥ 30ε + 2·(trust radius)
   are one-hot to within e^-30 and are counted, not exponentiated. Stops once
   ``argmin(C + p)`` overfills the columns by at most ``target_excess`` rows, when the
   overfill stops falling (exact ties: the repair's job), or at float32 resolution.
   Approximate; its output is only a starting point.
2. :func:`repair` (exactness). Successive shortest paths on the K-node column graph,
   starting from ``argmin(C + p)`` — optimal for its own column sizes, since ``p``
   certifies it. Edge a→b carries the cheapest move of one row (or unused slot) from a to
   b at reduced cost ``C[i, b] − C[i, a] + p_b − p_a ≥ 0``; a shortest path from the
   over-full columns (Bellman–Ford on K nodes) to the nearest column with room gives the
   potential update ``p ← p − min(dist, dist_t)`` that keeps every reduced cost ≥ 0 and
   makes the path's edges tight, and one unit moves along it. Rows that tie exactly on
   every edge of the path (duplicated requests) move together. Edge minima are kept over
   a pool of boundary rows per column, with a proven lower bound for the rest; a path that
   leans on a bound widens that pool and is searched again. The final ``p`` certifies the
   result (float64 arithmetic on the given costs; no scaling to integers, no rounding).
"""

from __future__ import annotations

import numpy as np

from eldr.fit._prices import entropic_prices  # the price phase (phase 1), re-exported

__all__ = ["entropic_prices", "repair", "solve"]

_POOL = 32  # boundary rows per column the repair scans first


class _ColumnGraph:
    """The K-node residual graph: ``W[a, b]`` = cheapest move of one unit from a to b.

    ``W`` holds raw costs ``C[i, b] − C[i, a]`` (potentials are added per search). Row
    moves are scanned over a pool per column: the rows nearest a boundary under the
    starting prices ``p0``, plus every row that moved in. A row of column a outside the
    pool has a reduced gap ≥ ``margin[a]`` under ``p0``, so its move to b costs at least
    ``margin[a] + Δp_b − Δp_a`` under the current prices (Δp = p − p0).
    """

    def __init__(self, C: np.ndarray, labels: np.ndarray, gap: np.ndarray,
                 pool_size: int) -> None:
        K = C.shape[1]
        self.C, self.labels, self.gap, self.K = C, labels, gap, K
        order = np.lexsort((gap, labels))  # by column, then nearest the boundary first
        bounds = np.searchsorted(labels[order], np.arange(K + 1))
        self.start = [order[bounds[k]:bounds[k + 1]] for k in range(K)]  # rows at start
        self.margin = np.full(K, np.inf)  # rows of a outside its pool have gap >= margin
        self.pools = [st[:pool_size] for st in self.start]
        self.requested = np.full(K, pool_size)  # prefix of `start` the pool was built from
        for a, st in enumerate(self.start):
            if st.size > pool_size:
                self.margin[a] = float(gap[st[pool_size]])
        size = max(1, max(pool.size for pool in self.pools))
        idx = np.zeros((K, size), dtype=np.int64)
        valid = np.zeros((K, size), dtype=bool)
        for a, pool in enumerate(self.pools):
            idx[a, :pool.size] = pool
            valid[a, :pool.size] = True
        keys = C[idx] - C[idx, np.arange(K)[:, None]][:, :, None]  # (K, size, K)
        keys[~valid] = np.inf
        j = keys.argmin(1)
        self.W = np.take_along_axis(keys, j[:, None, :], axis=1)[:, 0, :]
        np.fill_diagonal(self.W, np.inf)

    def widen(self, a: int) -> None:
        start = self.start[a]
        size = self.requested[a] = 4 * int(self.requested[a])
        self.margin[a] = np.inf if size >= start.size else float(self.gap[start[size]])
        pool = np.union1d(start[:size], self.pools[a])
        self.pools[a] = pool[self.labels[pool] == a]
        self.refresh(a)

    def refresh(self, a: int) -> None:
        pool = self.pools[a]
        if pool.size:
            self.W[a] = (self.C[pool] - self.C[pool, a][:, None]).min(0)
        else:
            self.W[a] = np.inf
        self.W[a, a] = np.inf

    def take(self, a: int, b: int, amount: int) -> np.ndarray:
        """Up to ``amount`` pool rows of a whose move to b costs exactly W[a, b]."""
        pool = self.pools[a]
        keys = self.C[pool, b] - self.C[pool, a]
        return pool[keys == self.W[a, b]][:amount]

    def move(self, rows: np.ndarray, a: int, b: int) -> None:
        self.labels[rows] = b
        pool = self.pools[a]
        self.pools[a] = pool[self.labels[pool] == a]
        self.pools[b] = np.concatenate([self.pools[b], rows])


def _start(C: np.ndarray, caps: np.ndarray, p: np.ndarray):
    """argmin(C + p) with ties dealt round-robin, unused slots, gaps: the SSP start."""
    N, K = C.shape
    R = C + p
    labels = R.argmin(1)
    ar = np.arange(N)
    b1 = R[ar, labels]
    is_min = R == b1[:, None]
    n_min = is_min.sum(1)
    R[is_min] = np.inf
    gap = R.min(1) - b1
    tied = np.flatnonzero(n_min > 1)
    if tied.size:  # any minimiser is optimal for its own sizes: deal ties out round-robin
        gap[tied] = 0.0
        im = is_min[tied]
        rank = np.cumsum(im, axis=1)  # (n_tied, K) 1-based rank among a row's minima
        want = tied % n_min[tied] + 1
        labels[tied] = np.argmax(im & (rank == want[:, None]), axis=1)
    counts = np.bincount(labels, minlength=K)
    slots = int(caps.sum()) - N
    dummy = np.zeros(K, dtype=np.int64)
    for k in np.flatnonzero(p == p.min()):  # unused slots only where the price is lowest
        take = min(slots, max(int(caps[k] - counts[k]), 0))
        dummy[k] += take
        slots -= take
    if slots:
        dummy[int(np.argmin(p))] += slots
    return labels.astype(np.int64), gap, counts + dummy - caps, dummy


def repair(C: np.ndarray, caps: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact optimum from prices ``p`` by successive shortest paths (module docstring).

    Returns (labels (N,) int64, prices (K,) float64 that certify them, min price 0).
    """
    K = C.shape[1]
    p = np.asarray(p, dtype=np.float64) - float(np.min(p))
    labels, gap, excess, dummy = _start(C, caps, p)
    if not (excess > 0).any():
        return labels, p
    graph = _ColumnGraph(C, labels, gap, pool_size=max(_POOL, 2 * int(excess.max())))
    p0 = p.copy()
    ar = np.arange(K)
    while (excess > 0).any():
        dp = p - p0
        W = graph.W + (p[None, :] - p[:, None])  # reduced costs of the pool minima
        B = graph.margin[:, None] + (dp[None, :] - dp[:, None])  # rows outside the pools
        loose = B < W
        W = np.where(loose, B, W)
        Wd = p[None, :] - p[:, None]  # moving an unused slot
        slot = (dummy > 0)[:, None] & (Wd <= W)
        W = np.where(slot, Wd, W)
        loose &= ~slot
        np.maximum(W, 0.0, out=W)  # reduced costs are >= 0 up to float rounding
        np.fill_diagonal(W, np.inf)
        dist = np.where(excess > 0, 0.0, np.inf)
        pred = np.full(K, -1)
        for _ in range(K):  # Bellman–Ford: nonnegative weights, so at most K rounds
            cand = dist[:, None] + W
            j = cand.argmin(0)
            v = cand[j, ar]
            upd = v < dist
            if not upd.any():
                break
            dist = np.where(upd, v, dist)
            pred = np.where(upd, j, pred)
        t = int(np.argmin(np.where(excess < 0, dist, np.inf)))
        if not np.isfinite(dist[t]):
            raise RuntimeError("balanced_assign: no augmenting path (internal error)")
        path = []  # edges (a, b) from t back to the over-full column it starts at
        s = t
        while pred[s] >= 0:
            if len(path) >= K:
                raise RuntimeError("balanced_assign: cyclic path (internal error)")
            path.append((int(pred[s]), s))
            s = int(pred[s])
        widen = [a for a, b in path if loose[a, b]]
        if widen:
            for a in widen:
                graph.widen(a)
            continue
        p -= np.minimum(dist, dist[t])  # every reduced cost stays >= 0; the path is tight
        # Units whose rows tie on every edge of the path all take it at the same cost.
        amount = min(int(excess[s]), -int(excess[t]))
        moves = []
        for a, b in path:
            if slot[a, b]:
                amount = min(amount, int(dummy[a]))
                moves.append((a, b, None))
            else:
                rows = graph.take(a, b, amount)
                amount = min(amount, rows.size)
                moves.append((a, b, rows))
        for a, b, rows in moves:
            if rows is None:
                dummy[a] -= amount
                dummy[b] += amount
            else:
                graph.move(rows[:amount], a, b)
        excess[s] -= amount
        excess[t] += amount
        for col in {x for a, b, _ in moves for x in (a, b)}:
            graph.refresh(col)
    return labels, p - p.min()


def solve(C: np.ndarray, caps: np.ndarray, prices: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Exact assignment of ``C`` (N, K) float64 under ``caps`` (K,) int64 (Σ caps ≥ N).

    ``prices`` (K,): optional warm start (a previous call's duals). Returns (labels (N,)
    int64, prices (K,) float64 certifying optimality, min price 0). Without a warm start,
    the plain argmin (lowest column on ties) when it already fits, with zero prices.
    """
    N, K = C.shape
    if prices is None:
        labels = C.argmin(1).astype(np.int64)
        if (np.bincount(labels, minlength=K) <= caps).all():
            return labels, np.zeros(K)
    p = entropic_prices(C, caps, target_excess=max(4, N // 1000), prices=prices)
    return repair(C, caps, p)
