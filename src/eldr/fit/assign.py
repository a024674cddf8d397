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

_NEWTON_STEPS = 12  # line-searched Newton steps per ε stage at most
_MAX_EVALS = 400  # smoothed-dual evaluations at most (a safety net, never reached in tests)
_HARD_MARGIN = 30.0  # rows with gap ≥ 30ε (+ 2·trust) are treated as one-hot (error ≤ e^-30)
_TRUST = 8.0  # with one-hot rows, p moves at most 8ε before the split is redone
_DENSE_ROWS = 8192  # up to this many rows every stage exponentiates all of them
_MIN_LEVEL = 1024  # rows in the smallest coarse level
_DTOL = 0.5  # a stage has converged once the Newton step is below 0.5ε
_SHRINK = 4.0  # ε shrinks this much per stage
_TR0 = 4.0  # a stage's first trust radius, in units of ε
_STALLS = 3  # stages in a row without progress before the overfill is left to the repair
_EPS_FLOOR = 1e-6  # smallest ε relative to the cost spread: float32 resolves ~1e-7
_EXP_FLOOR = 60.0  # exp(-60) ≈ 1e-26 stands for anything smaller
_POOL = 32  # boundary rows per column the repair scans first

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


class _Point:
    """The smoothed dual of soft rows CT (K, n) float32 plus one-hot ``fixed`` counts, at
    (p, ε): value ``f``, gradient ``g`` (softmin column sums − caps), the Hessian's
    Laplacian ``L`` (Hessian = −L/ε) and ``over``, how many rows ``argmin(C + p)``
    puts above the capacities (ties counted in every tied column). float32 arrays,
    float64 sums: the prices only need to be roughly right (the repair is exact).
    """

    __slots__ = ("L", "f", "g", "over", "p")

    def __init__(self, CT: np.ndarray, fixed: np.ndarray, caps: np.ndarray, S: float,
                 p: np.ndarray, eps: float) -> None:
        E = CT + p.astype(np.float32)[:, None]
        m = E.min(0)
        E -= m
        hard = np.count_nonzero(E == 0.0, axis=1) + fixed
        self.over = float(np.maximum(hard - caps, 0.0).sum())
        E *= np.float32(-1.0 / eps)
        np.maximum(E, np.float32(-_EXP_FLOOR), out=E)  # exp of huge negatives is slow
        np.exp(E, out=E)
        s = E.sum(0)
        E /= s  # softmin probabilities P (K, n)
        pm = p.min()
        ez = np.exp((pm - p) / eps)
        pz = ez / ez.sum()  # the dummy row's probabilities
        cols = E.sum(1, dtype=np.float64) + S * pz
        self.p = p
        self.f = float(m.sum(dtype=np.float64) - eps * np.log(s).sum(dtype=np.float64)
                       + fixed @ p + S * (pm - eps * np.log(ez.sum())) - caps @ p)
        self.g = cols + fixed - caps
        L = np.diag(cols) - (E @ E.T).astype(np.float64) - S * np.outer(pz, pz)
        L.flat[::L.shape[0] + 1] += 1e-9 * float(cols.mean()) + 1e-12
        self.L = L


class _Level:
    """The rows one stage works on: all of them, or the soft ones plus one-hot counts."""

    def __init__(self, CT: np.ndarray, caps: np.ndarray, S: float) -> None:
        self.CT, self.caps, self.S = CT, caps, S
        self.soft, self.fixed = CT, np.zeros(caps.size)
        self.p_ref, self.radius = None, np.inf

    def split(self, p: np.ndarray, eps: float) -> None:
        """Treat rows with gap ≥ 30ε + 2·radius under p as one-hot (large levels only)."""
        if self.CT.shape[1] <= _DENSE_ROWS:
            return
        best, gap = _top2(self.CT + p.astype(np.float32)[:, None])
        self.radius = _TRUST * eps
        soft = gap < _HARD_MARGIN * eps + 2.0 * self.radius
        self.fixed = np.bincount(best[~soft], minlength=self.caps.size).astype(np.float64)
        self.soft, self.p_ref = self.CT[:, soft], p

    def at(self, p: np.ndarray, eps: float) -> _Point:
        return _Point(self.soft, self.fixed, self.caps, self.S, p, eps)

    def room(self, p: np.ndarray) -> float:
        """How far p may still move before the one-hot split must be redone."""
        return np.inf if self.p_ref is None else self.radius - float(np.abs(p - self.p_ref).max())


def _stages(level: _Level, p: np.ndarray, eps: float, *, eps_stop: float,
            target: float | None) -> tuple[np.ndarray, float, int]:
    """Trust-region Newton on the smoothed dual, ε shrinking 4× whenever a stage converges.

    With ``target`` None: one stage (a coarse level). Otherwise stages until at most
    ``target`` rows overfill, ε < ``eps_stop``, or the overfill has not reached a new low
    for 3 stages (exact ties, duplicated rows: then the prices of the lowest). Returns
    (p, ε for the next stage, evaluations).
    """
    level.split(p, eps)
    pt, evals = level.at(p, eps), 1
    steps, last, radius, stalls, stuck = 0, None, _TR0 * eps, 0, False
    while evals < _MAX_EVALS:
        if target is not None and pt.over <= target:
            break
        # Levenberg–Marquardt: a column with no soft rows has (almost) no curvature, and a
        # plain Newton step would fling its price; μ caps such a step near the radius.
        mu = eps * float(np.abs(pt.g).max()) / min(radius, 1e300)
        d = np.linalg.solve(pt.L + mu * np.eye(pt.L.shape[0]), eps * pt.g)
        dm = max(float(np.abs(d).max()), 1e-300)
        stuck = stuck if steps else False
        converged = dm <= _DTOL * eps or float(np.abs(pt.g).sum()) < 0.5
        if converged or steps >= _NEWTON_STEPS:
            p = pt.p + min(1.0, level.room(pt.p) / dm) * d if converged else pt.p
            if converged or stuck:
                eps /= _SHRINK  # else the same ε again: a smaller one would only slow it
            if target is None:
                return p, eps, evals
            if last is None or pt.over < last[0]:
                last, stalls = (pt.over, p), 0
            else:
                stalls += 1
            if stalls >= _STALLS:  # the overfill stopped falling: exact ties or duplicated
                return last[1], eps, evals  # rows, which the repair moves in bulk
            if eps < eps_stop:
                return p, eps, evals
            steps, radius = 0, _TR0 * eps
            level.split(p, eps)
            pt, evals = level.at(p, eps), evals + 1
            continue
        slope, g1 = float(pt.g @ d), float(np.abs(pt.g).sum())
        for _retry in range(8):
            t = min(1.0, radius / dm, level.room(pt.p) / dm)
            trial, evals = level.at(pt.p + t * d, eps), evals + 1
            if trial.f >= pt.f + 1e-4 * t * slope or float(np.abs(trial.g).sum()) <= 0.5 * g1:
                if t < 1.0:
                    radius *= 4.0  # the model held up to the radius: trust it further
                break
            radius = t * dm / 4.0
        else:
            steps, stuck = _NEWTON_STEPS, True  # no progress along d (float32 resolution)
            continue
        pt, steps = trial, steps + 1
        if level.room(pt.p) <= 1e-9 * eps:  # the one-hot split is stale: redo it, same ε
            level.split(pt.p, eps)
            pt, evals = level.at(pt.p, eps), evals + 1
    return pt.p, eps, evals


def entropic_prices(C: np.ndarray, caps: np.ndarray, *, target_excess: int,
                    prices: np.ndarray | None = None) -> np.ndarray:
    """Approximate optimal column prices (K,) for ``C`` (N, K) float64 under ``caps`` (K,).

    ``prices`` warm-starts from a previous solution (e.g. the last K-means iteration's):
    the first stage then starts at the ε of the rows it leaves on the wrong side.
    """
    N, K = C.shape
    CT = np.ascontiguousarray((C - C.min(1, keepdims=True)).T, dtype=np.float32)
    span = float(CT.max())
    if span <= 0.0 or K == 1:
        return np.zeros(K)  # every row is indifferent: any feasible split is optimal
    capf = caps.astype(np.float64)
    S = float(capf.sum() - N)
    best, gap = _top2(CT if prices is None else CT + np.asarray(prices, np.float32)[:, None])
    eps_stop = span * _EPS_FLOOR
    if prices is None:
        p = np.zeros(K)
        # The 90th percentile of the best-vs-second gaps, or more when a column is nobody's
        # first choice: its price must come down by that much before any row moves there.
        eps = max(float(np.quantile(gap, 0.9)), float(CT.min(1).max())) or span
        sizes = []  # coarse levels: N/4, N/16, ... rows, at least _MIN_LEVEL each
        while N // 4 ** (len(sizes) + 1) >= _MIN_LEVEL:
            sizes.append(N // 4 ** (len(sizes) + 1))
        for n in reversed(sizes):  # one ε stage per level, ε and sample shrinking together
            idx = np.linspace(0, N - 1, n).round().astype(np.int64)
            level = _Level(np.ascontiguousarray(CT[:, idx]), capf * n / N, S * n / N)
            p, eps, _ = _stages(level, p, eps, eps_stop=eps_stop, target=None)
    else:
        p = np.asarray(prices, dtype=np.float64) - float(np.min(prices))
        wrong = int(np.maximum(np.bincount(best, minlength=K) - caps, 0).sum())
        if wrong <= target_excess:
            return p
        cold = int(np.maximum(np.bincount(CT.argmin(0), minlength=K) - caps, 0).sum())
        if 2 * wrong >= cold:  # the costs moved too far for these prices: start cold
            return entropic_prices(C, caps, target_excess=target_excess)
        eps = max(float(np.quantile(gap, min(1.0, 64.0 * wrong / N))), eps_stop)
    p, _, _ = _stages(_Level(CT, capf, S), p, eps, eps_stop=eps_stop,
                      target=float(target_excess))
    return p - p.min()


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
