"""The price phase of :mod:`eldr.fit.assign`: approximate column prices, fast.

Damped Newton on the entropy-smoothed dual of the capacitated assignment, in K
dimensions (see :mod:`eldr.fit.assign` for the method and why). Its output is only a
starting point: :func:`eldr.fit.assign.repair` makes the assignment exact.
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

# The price phase works on the transposed cost CT (K, N): numpy reduces over a short
# last axis much slower than over the first axis of a C-ordered array.


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
