"""Exact capacitated assignment (the transportation problem with few columns).

Problem: rows ``i < N`` each go to one column ``k < K`` at cost ``C[i, k]``; column ``k``
takes at most ``cap`` rows; minimise the total cost. K is small (decode workers), N is
large (calibration requests), so everything is organised around K-dimensional duals.

Duality. Add a dummy row carrying the ``S = K·cap − N`` unused slots at cost 0 everywhere,
so every column is filled exactly. An assignment is optimal iff there are column prices
``p`` (K,) with every row (and every dummy slot) in a column of minimum ``C[i, k] + p[k]``
(complementary slackness), i.e. iff its residual graph has no negative cycle.

Two phases, because exactness and speed want different tools:

1. :func:`entropic_prices` (speed). Damped Newton on the entropy-smoothed dual
   ``Σ_i −ε·log Σ_k exp(−(C[i,k] + p_k)/ε) − cap·Σ_k p_k`` (+ the dummy row) in K
   dimensions: gradient = softmin column sums − cap, Hessian = a K×K weighted graph
   Laplacian, solved exactly; Armijo backtracking inside a trust region of 8ε. ε starts
   at the 90th percentile of the rows' best-vs-second gaps and shrinks 4× per stage;
   the first stages run on evenly spaced subsamples (N/4^j rows, fractional capacity).
   Rows whose best column beats the second by ≥ 30ε are one-hot to within e^-30 and
   are counted, not exponentiated, so late stages touch only rows near a boundary.
   Stops once ``argmin(C + p)`` overfills the columns by at most max(4, N/1000) rows,
   when prices stop moving (what is left is exact ties), or at ε = 1e-5 of the largest
   gap (float32 resolution). Approximate; its output is only a starting point.
2. :func:`repair` (exactness). Successive shortest paths in the K-node column graph,
   starting from ``argmin(C + p)`` — optimal for its own column sizes, since ``p``
   certifies it — moving one row (or dummy slot) at a time from an over-full column to
   one with room along a shortest path (Bellman–Ford on K nodes; an edge a→b costs
   ``min_{i in a} C[i, b] − C[i, a]``). Each augmentation keeps the residual graph free
   of negative cycles, so the result is an exact optimum: only float64 comparisons of
   the given costs, no scaling, no rounding. Edge minima are kept over a pool of rows
   near the boundary; a row outside the pool provably costs at least a known bound, and
   the pool is widened whenever an edge's minimum crosses that bound. Exact ties (many
   identical rows) are cheap: the starting argmin deals tied rows round-robin over their
   minimal columns, and units whose rows tie on every edge of a shortest path move
   together in one augmentation.
"""

from __future__ import annotations

import numpy as np

_NEWTON_STEPS = 8  # Newton iterations per ε stage at most
_MAX_STAGES = 40  # ε stages at most on the full problem
_HARD_MARGIN = 30.0  # rows with gap ≥ 30ε are treated as one-hot (error ≤ e^-30)
_TRUST = 8.0  # a Newton step moves p by at most 8ε (≪ 30ε: hard rows stay one-hot)
_MIN_LEVEL = 200  # rows in the smallest coarse level
_EPS0_QUANTILE = 0.9  # first ε: this quantile of the rows' best-vs-second gaps
_SHRINK = 4.0  # ε shrinks this much per stage
_EPS_FLOOR = 1e-5  # smallest ε relative to the largest gap: float32 resolves ~1e-7
_EXP_FLOOR = 60.0  # exp(-60) ≈ 1e-26 stands for anything smaller
_DUMMY = -1  # marks an edge realised by moving a dummy (unused) slot
_BOUND = -2  # marks an edge holding a lower bound for rows outside the pool

# The price phase works on the transposed cost CT (K, N): numpy reduces over a short
# last axis an order of magnitude slower than over the first axis of a C-ordered array.


def _top2(RT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(best column (lowest on ties), gap to the second best) per row of RT (K, N)."""
    K = RT.shape[0]
    b1 = RT.min(0)
    is_min = RT == b1
    best = np.where(is_min, np.arange(K)[:, None], K).min(0)
    b2 = np.where(is_min, np.inf, RT).min(0)
    gap = b2 - b1
    gap[is_min.sum(0) > 1] = 0.0  # a tie for the best column
    return best, gap


def _excess(best: np.ndarray, K: int, cap: int) -> int:
    return int(np.maximum(np.bincount(best, minlength=K) - cap, 0).sum())


def _smoothed(CT: np.ndarray, fixed: np.ndarray, p: np.ndarray, S: float, cap: float,
              eps: float) -> tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Smoothed dual at p with soft rows CT (K, n) float32 and ``fixed`` one-hot counts.

    Returns (value, gradient (K,), unnormalised softmin weights E (K, n) with their
    per-row sums folded in as ``inv_s`` (n,) — P = E · inv_s —, column sums of P plus
    the dummy row's, the dummy row's probabilities (K,)). float32 arrays, float64 sums:
    the prices only need to be approximately right (the repair phase is exact).
    """
    E = CT + (p.astype(np.float32))[:, None]
    m = E.min(0)
    np.subtract(m, E, out=E)
    E *= np.float32(1.0 / eps)
    np.maximum(E, np.float32(-_EXP_FLOOR), out=E)  # exp of huge negatives is slow
    np.exp(E, out=E)
    s = E.sum(0)
    inv_s = 1.0 / s
    pm = p.min()
    ez = np.exp((pm - p) / eps)
    sz = ez.sum()
    f = float(m.sum(dtype=np.float64) - eps * np.log(s).sum(dtype=np.float64) + fixed @ p
              + S * (pm - eps * np.log(sz)) - cap * p.sum())
    pz = ez / sz
    cols = (E @ inv_s).astype(np.float64) + S * pz
    return f, cols + fixed - cap, (E, inv_s), cols, pz


def _stages(CT: np.ndarray, cap: float, p: np.ndarray, eps: float, *, max_stages: int,
            target_excess: int | None, eps_stop: float = 0.0) -> tuple[np.ndarray, float]:
    """Newton stages on the smoothed dual of rows CT (K, n), ε shrinking per stage.

    Stops when ε < ``eps_stop``, or (``target_excess`` given) when ``argmin(C + p)``
    overfills the columns by at most ``target_excess`` rows. Returns (p, ε reached).
    """
    K, n = CT.shape
    S = K * cap - n
    g_tol = max(0.5, n / 200.0)  # rows of imbalance accepted before ε shrinks
    done = 0
    for _split in range(4 * max_stages):  # a stale split redoes the stage at the same ε
        if done >= max_stages:
            break
        best, gap = _top2(CT + p.astype(np.float32)[:, None])
        if eps < eps_stop or (target_excess is not None
                              and _excess(best, K, int(cap)) <= target_excess):
            break
        soft = gap < _HARD_MARGIN * eps
        fixed = np.bincount(best[~soft], minlength=K).astype(np.float64)
        Cs = CT[:, soft]
        p_ref = p.copy()
        stale = False  # p drifted far enough that the hard/soft split must be redone
        f, g, P, cols, pz = _smoothed(Cs, fixed, p, S, cap, eps)
        for _ in range(_NEWTON_STEPS):
            if np.abs(g).sum() < g_tol:
                break
            E, inv_s = P
            Ps = E * inv_s
            L = np.diag(cols) - (Ps @ Ps.T).astype(np.float64) - S * np.outer(pz, pz)
            L[np.diag_indices(K)] += 1e-9 * (np.trace(L) / K + 1.0)
            d = np.linalg.solve(L, eps * g)
            slope = float(g @ d)
            # trust region: the hard rows' linear terms are only valid while p stays close
            t = min(1.0, _TRUST * eps / max(float(np.abs(d).max()), 1e-300))
            for _backtrack in range(6):
                fn, gn, Pn, coln, pzn = _smoothed(Cs, fixed, p + t * d, S, cap, eps)
                if fn >= f + 1e-4 * t * slope:
                    break
                t *= 0.25
            else:
                break  # no ascent along d (float32 resolution reached): next stage
            p = p + t * d
            f, g, P, cols, pz = fn, gn, Pn, coln, pzn
            if np.abs(p - p_ref).max() > _TRUST * eps:
                stale = True
                break
        if not stale:
            if target_excess is not None and np.abs(p - p_ref).max() < 1e-3 * eps:
                break  # prices stopped moving: what overfills now is exact ties (repair's)
            eps /= _SHRINK
            done += 1
    return p, eps


def entropic_prices(C: np.ndarray, cap: int, *, target_excess: int) -> np.ndarray:
    """Approximate optimal column prices (K,) for ``C`` (N, K) float64 under ``cap``.

    Coarse stages run on evenly spaced subsamples (N/4^j rows, capacity scaled to them:
    the smoothed dual accepts fractional capacities), one ε stage per level; the fine
    stages run on all rows, where by then only rows near a boundary are soft.
    """
    N, K = C.shape
    CT = np.ascontiguousarray(C.T, dtype=np.float32)
    p = np.zeros(K)
    _, gap = _top2(CT)
    span = float(gap.max())
    if span <= 0.0:
        return p  # every row is indifferent: any feasible split is optimal
    eps = float(np.quantile(gap, _EPS0_QUANTILE)) or span
    sizes = []  # coarse levels: N/4, N/16, ... rows, at least _MIN_LEVEL each
    while N // 4 ** (len(sizes) + 1) >= _MIN_LEVEL:
        sizes.append(N // 4 ** (len(sizes) + 1))
    for n in reversed(sizes):  # one ε stage per level, ε and sample shrinking together
        idx = np.linspace(0, N - 1, n).round().astype(np.int64)
        p, _ = _stages(CT[:, idx], cap * n / N, p, eps, max_stages=1, target_excess=None)
        eps /= _SHRINK
    p, _ = _stages(CT, cap, p, eps, max_stages=_MAX_STAGES, target_excess=target_excess,
                   eps_stop=span * _EPS_FLOOR)
    return p - p.min()


class _ColumnGraph:
    """The K-node residual graph: ``W[a, b]`` = cheapest move of one unit from a to b.

    Row moves are scanned over a pool per column: the rows nearest a boundary under the
    starting prices ``p``, plus every row that moved in. A row of column a outside the
    pool has a reduced gap ≥ ``margin[a]``, so its move to b costs ≥ ``margin[a] + p[a] −
    p[b]``; where that bound is below the pool's minimum, the edge holds the bound (a
    lower bound, marked ``_BOUND``). A shortest path that uses only exact edges is a true
    shortest path; one that uses a bound edge widens that pool and is searched again.
    """

    def __init__(self, C: np.ndarray, labels: np.ndarray, p: np.ndarray, gap: np.ndarray,
                 dummy: np.ndarray, pool_size: int) -> None:
        K = C.shape[1]
        self.C, self.labels, self.p, self.gap, self.K = C, labels, p, gap, K
        order = np.lexsort((gap, labels))  # by column, then nearest the boundary first
        bounds = np.searchsorted(labels[order], np.arange(K + 1))
        self.start = [order[bounds[k]:bounds[k + 1]] for k in range(K)]  # rows at start
        self.dummy = dummy  # (K,) dummy slots held by each column
        self.margin = np.full(K, np.inf)  # rows of a outside its pool have gap >= margin
        self.pools = [st[:pool_size] for st in self.start]
        self.requested = np.full(K, pool_size)  # prefix of `start` the pool was built from
        for a, st in enumerate(self.start):
            if st.size > pool_size:
                self.margin[a] = float(gap[st[pool_size]])
        self.W = np.full((K, K), np.inf)
        self.A = np.zeros((K, K), dtype=np.int64)  # row index, _DUMMY or _BOUND
        self._refresh_all()

    def _refresh_all(self) -> None:
        """``refresh`` of every column at once (pools padded to one length)."""
        K, C = self.K, self.C
        size = max(1, max(pool.size for pool in self.pools))
        idx = np.zeros((K, size), dtype=np.int64)
        valid = np.zeros((K, size), dtype=bool)
        for a, pool in enumerate(self.pools):
            idx[a, :pool.size] = pool
            valid[a, :pool.size] = True
        keys = C[idx] - C[idx, np.arange(K)[:, None]][:, :, None]  # (K, size, K)
        keys[~valid] = np.inf
        j = keys.argmin(1)  # (K, K)
        W = np.take_along_axis(keys, j[:, None, :], axis=1)[:, 0, :]
        A = np.take_along_axis(idx, j, axis=1)
        has_dummy = (self.dummy > 0)[:, None] & (W > 0.0)
        W[has_dummy] = 0.0
        A[has_dummy] = _DUMMY
        bound = self.margin[:, None] + self.p[:, None] - self.p[None, :]
        use = bound < W
        W[use] = bound[use]
        A[use] = _BOUND
        np.fill_diagonal(W, np.inf)
        self.W, self.A = W, A

    def widen(self, a: int) -> None:
        start = self.start[a]
        size = self.requested[a] = 4 * max(int(self.requested[a]), 16)
        if size >= start.size:
            self.margin[a] = np.inf
        else:
            self.margin[a] = float(self.gap[start[size]])
        pool = np.union1d(start[:size], self.pools[a])
        self.pools[a] = pool[self.labels[pool] == a]
        self.refresh(a)

    def refresh(self, a: int) -> None:
        pool = self.pools[a]
        W, A = self.W[a], self.A[a]
        if pool.size:
            keys = self.C[pool] - self.C[pool, a][:, None]
            j = keys.argmin(0)
            W[:] = keys[j, np.arange(self.K)]
            A[:] = pool[j]
        else:
            W[:] = np.inf
        if self.dummy[a] > 0:
            use = W > 0.0
            W[use] = 0.0
            A[use] = _DUMMY
        bound = self.margin[a] + self.p[a] - self.p
        use = bound < W
        W[use] = bound[use]
        A[use] = _BOUND
        W[a] = np.inf

    def capacity(self, a: int, b: int) -> int:
        """How many units can cross edge a→b at exactly its current cost W[a, b]."""
        r = int(self.A[a, b])
        if r == _DUMMY:
            return int(self.dummy[a])
        pool = self.pools[a]
        keys = self.C[pool, b] - self.C[pool, a]
        return int(np.count_nonzero(keys == self.W[a, b]))

    def move(self, a: int, b: int, amount: int) -> None:
        """Move ``amount`` units across a→b, each at cost W[a, b] (rows tied at it)."""
        r = int(self.A[a, b])
        if r == _DUMMY:
            self.dummy[a] -= amount
            self.dummy[b] += amount
            return
        pool = self.pools[a]
        keys = self.C[pool, b] - self.C[pool, a]
        rows = pool[keys == self.W[a, b]][:amount]
        self.labels[rows] = b
        self.pools[a] = pool[self.labels[pool] == a]
        self.pools[b] = np.concatenate([self.pools[b], rows])


def repair(C: np.ndarray, cap: int, p: np.ndarray) -> np.ndarray:
    """Exact optimum from prices ``p`` by successive shortest paths (module docstring)."""
    N, K = C.shape
    RT = (C + p).T.copy()
    best, gap = _top2(RT)
    labels = best.astype(np.int64)
    tied = np.flatnonzero(gap == 0.0)
    if tied.size:  # any minimiser is optimal for its own sizes: deal ties out round-robin
        is_min = RT[:, tied] == RT[best[tied], tied]
        rank = np.cumsum(is_min, axis=0)  # (K, n_tied) 1-based rank among a row's minima
        want = tied % is_min.sum(0) + 1
        labels[tied] = np.argmax(is_min & (rank == want), axis=0)
    counts = np.bincount(labels, minlength=K)
    slots = K * cap - N
    dummy = np.zeros(K, dtype=np.int64)
    for k in np.flatnonzero(p == p.min()):  # dummy slots only where the price is lowest
        take = min(slots, max(cap - int(counts[k]), 0))
        dummy[k] += take
        slots -= take
    if slots:
        dummy[int(np.argmin(p))] += slots
    excess = counts + dummy - cap
    if not (excess > 0).any():
        return labels
    graph = _ColumnGraph(C, labels, p, gap, dummy, pool_size=max(16, 2 * int(excess.max())))
    ar = np.arange(K)
    # Float rounding can make a zero-cost cycle of moves look slightly negative; improving
    # a distance only by more than `tol` keeps Bellman–Ford (and its paths) finite.
    tol = 1e-12 * max(1.0, float(np.abs(C).max()))
    while (excess > 0).any():
        # Bellman–Ford from every over-full column (no negative cycles: see docstring)
        dist = np.where(excess > 0, 0.0, np.inf)
        pred = np.full(K, -1)
        for _ in range(K + 1):
            cand = dist[:, None] + graph.W
            j = cand.argmin(0)
            v = cand[j, ar]
            upd = v < dist - tol
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
        loose = [a for a, b in path if graph.A[a, b] == _BOUND]
        if loose:
            for a in loose:
                graph.widen(a)
            continue
        # Units whose rows tie on every edge of the path all take it at the same cost, and
        # shortest-path costs never decrease in SSP, so they go in one augmentation.
        amount = min(int(excess[s]), -int(excess[t]),
                     *(graph.capacity(a, b) for a, b in path))
        for a, b in path:
            graph.move(a, b, amount)
        excess[s] -= amount
        excess[t] += amount
        for a in {t, *(a for a, _ in path)}:
            graph.refresh(a)
    return labels
