"""Drift detection: has live traffic moved away from the artifact's calibration?

Three signals, each tested per window of ``window`` completed requests (or decoder steps)
against a null distribution calibrated on the calibration data itself, so a threshold
means the same false-alarm level whatever the model or the traffic:

- **shift** (always): a kernel two-sample test between the window's signatures and the
  calibration's. The statistic is the (biased) squared maximum mean discrepancy with a
  Gaussian kernel on the unit signature rows, bandwidth the median pairwise distance of the
  calibration. Its null is a permutation null on the calibration alone: ``num_null`` random
  splits of the N calibration rows into (N − W, W), the statistic of each split, the
  ``1 − alpha`` quantile as the threshold. A live window is compared with all N rows, a
  less noisy comparison than the (N − W)-row splits, so the threshold is conservative.
  Signatures longer than ``max_dim`` are first projected onto a fixed seeded Gaussian
  basis (a kernel on the projection is still a kernel: the test stays valid, and it costs
  O(N · W · max_dim) per window).
- **rho** (only where decode counts exist): ρ of the window (signature distances vs decode
  distances, Eq. 1) against the ρ of 100 random W-subsets of the n calibration rows; the
  ``alpha`` quantile is the threshold, its distance below the median widened by
  ``1 / sqrt(1 − W/n)`` (subsets of a finite calibration vary less than fresh windows:
  without it 3.3% of unshifted windows fell past a 1% threshold). ρ falling means the
  signature no longer predicts the decode pattern it was fitted for.
- **distinct** (only where the engines report it): the mean distinct experts per layer per
  decoder step over a window of steps against the first window after calibration; past
  ``1 + rise`` times it. Load changes it too (bigger batches select more experts): it is a
  coarse alarm and is reported, but only a shift or a ρ drop alone can fire a refit
  unless ``distinct_fires`` is set.

Every report has ``score = statistic / threshold`` (for ρ: how far below its null median,
relative to the threshold's distance), so ``score >= 1`` means past the threshold. Drift
is declared when one signal is past its threshold in ``patience`` consecutive windows.

Pure numpy (ρ from :mod:`eldr.fit.signature`). ``push`` only collects (the event loop
calls it); ``check`` does the arithmetic on a window (a thread may call it) and
``conclude`` updates the consecutive counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eldr.fit.signature import rho as rho_of

__all__ = ["DriftDetector", "DriftReport", "Window"]


@dataclass(frozen=True, slots=True)
class DriftReport:
    """One signal's test on one window."""

    signal: str  # "shift", "rho" or "distinct"
    statistic: float  # MMD², ρ, or the distinct-experts ratio to the reference
    threshold: float  # the statistic's threshold (from the calibrated null)
    score: float  # >= 1: past the threshold

    @property
    def exceeded(self) -> bool:
        return self.score >= 1.0


@dataclass(frozen=True, slots=True)
class Window:
    """A full window of live requests, handed from ``push`` to ``check``."""

    signatures: np.ndarray  # (W, d) float unit rows
    decode: np.ndarray | None  # (W', L*E) decode counts of the rows that have them, or None
    decode_rows: np.ndarray | None  # (W',) int64 rows of ``signatures`` they belong to


def _sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
    return np.maximum(d, 0.0)


class DriftDetector:
    """Windowed drift tests against a calibration (module docstring)."""

    def __init__(self, *, window: int = 100, alpha: float = 0.01, patience: int = 2,
                 num_null: int = 200, max_dim: int = 128, rise: float = 0.15,
                 distinct_fires: bool = False, random_state: int | None = 0) -> None:
        if window < 10:
            raise ValueError(f"drift window must be >= 10, got {window}")
        if not 0.0 < alpha < 0.5:
            raise ValueError(f"drift alpha must be in (0, 0.5), got {alpha}")
        if patience < 1 or num_null < 20 or max_dim < 2 or not rise > 0:
            raise ValueError("drift: patience >= 1, num_null >= 20, max_dim >= 2, rise > 0")
        self.window = window
        self.alpha = alpha
        self.patience = patience
        self.num_null = num_null
        self.max_dim = max_dim
        self.rise = rise
        self.distinct_fires = distinct_fires
        self.random_state = random_state
        self._pending: list[tuple[np.ndarray, np.ndarray | None]] = []
        self._steps: dict[str, list[float]] = {}
        self.distinct_ref_: dict[str, float] = {}
        self.consecutive_: dict[str, int] = {}
        self.last_: dict[str, DriftReport] = {}

    # -- calibration ----------------------------------------------------------------------
    def calibrate(self, signatures: np.ndarray, decode_counts: np.ndarray | None = None,
                  decode_known: np.ndarray | None = None) -> DriftDetector:
        """Calibrate on N reference signatures (N, d) and, optionally, their decode counts
        (N, L, E) with ``decode_known`` (N,) bool saying which rows have them.

        Needs N >= window + 10 (the null splits leave at least 10 reference rows).
        """
        x = np.asarray(signatures, dtype=np.float64)
        if x.ndim != 2 or not np.isfinite(x).all():
            raise ValueError(f"drift: signatures must be finite (N, d), got {x.shape}")
        N, d = x.shape
        if N < self.window + 10:
            raise ValueError(f"drift: {N} calibration requests, need at least "
                             f"{self.window + 10} (window {self.window} + 10)")
        rng = np.random.default_rng(self.random_state)
        self.dim_ = d  # signature length the detector takes
        self.projection_ = None
        if d > self.max_dim:
            self.projection_ = rng.standard_normal((d, self.max_dim)) / np.sqrt(self.max_dim)
        ref = self._project(x)
        sq = _sq_dists(ref, ref)
        off = sq[np.triu_indices(N, k=1)]
        med = float(np.median(off)) if off.size else 0.0
        self.gamma_ = 1.0 / med if med > 0 else 1.0  # k(x, y) = exp(-gamma |x - y|²)
        gram = np.exp(-self.gamma_ * sq)
        self.reference_ = ref
        self.ref_mean_ = float(gram.mean())
        # permutation null: indicator matrix of the W-row side of each split
        W = self.window
        ind = np.zeros((N, self.num_null))
        for j in range(self.num_null):
            ind[rng.choice(N, size=W, replace=False), j] = 1.0
        rest = 1.0 - ind
        kb = gram @ ind
        kr = gram @ rest
        n_rest = N - W
        null = ((ind * kb).sum(0) / W**2 + (rest * kr).sum(0) / n_rest**2
                - 2.0 * (rest * kb).sum(0) / (W * n_rest))
        self.null_ = np.sort(null)
        self.threshold_ = float(np.quantile(null, 1.0 - self.alpha))
        self.rho_null_ = None
        if decode_counts is not None:
            self._calibrate_rho(x, np.asarray(decode_counts), decode_known, rng)
        self.reset()
        return self

    def _calibrate_rho(self, x, decode, known, rng) -> None:
        known = np.ones(x.shape[0], bool) if known is None else np.asarray(known, bool)
        rows = np.flatnonzero(known)
        if rows.size < self.window + 10:
            return  # too few decode counts: the ρ signal stays off
        dec = decode.reshape(decode.shape[0], -1)[rows].astype(np.float64)
        sig = x[rows]
        vals = []
        for _ in range(min(self.num_null, 100)):
            pick = rng.choice(rows.size, size=self.window, replace=False)
            v = rho_of(sig[pick], dec[pick])
            if np.isfinite(v):
                vals.append(v)
        if len(vals) < 20:
            return
        self.rho_null_ = np.sort(np.array(vals))
        self.rho_center_ = float(np.median(vals))
        # W-subsets of n rows vary less than fresh windows by the finite-population factor
        # (1 - W/n): widen the null's spread back by its square root
        widen = 1.0 / np.sqrt(max(1.0 - self.window / rows.size, 0.05))
        self.rho_threshold_ = float(self.rho_center_ - widen * (
            self.rho_center_ - np.quantile(vals, self.alpha)))

    def _project(self, x: np.ndarray) -> np.ndarray:
        return x if self.projection_ is None else x @ self.projection_

    @property
    def is_calibrated(self) -> bool:
        return hasattr(self, "threshold_")

    def reset(self) -> None:
        """Forget live windows and consecutive counts (after a refit attempt)."""
        self._pending = []
        self.consecutive_ = {}
        self._steps = {}
        self.distinct_ref_ = {}

    # -- live requests --------------------------------------------------------------------
    def push(self, signature: np.ndarray, decode_counts: np.ndarray | None = None
             ) -> Window | None:
        """Collect one request; returns the window when it is full (then starts anew)."""
        self._pending.append((np.asarray(signature, dtype=np.float64), decode_counts))
        if len(self._pending) < self.window:
            return None
        items, self._pending = self._pending, []
        sigs = np.stack([s for s, _ in items])
        rows = np.array([i for i, (_, dc) in enumerate(items) if dc is not None], np.int64)
        dec = (np.stack([items[i][1].reshape(-1) for i in rows]).astype(np.float64)
               if rows.size else None)
        return Window(sigs, dec, rows if rows.size else None)

    def check(self, window: Window) -> list[DriftReport]:
        """The shift (and, with decode counts, ρ) tests of one window. Pure arithmetic."""
        if not self.is_calibrated:
            raise ValueError("drift detector is not calibrated")
        y = self._project(np.asarray(window.signatures, dtype=np.float64))
        W = y.shape[0]
        kyy = np.exp(-self.gamma_ * _sq_dists(y, y)).mean()
        kxy = np.exp(-self.gamma_ * _sq_dists(self.reference_, y)).mean()
        mmd = float(self.ref_mean_ + kyy - 2.0 * kxy)
        thr = self.threshold_ if self.threshold_ > 0 else 1e-12
        out = [DriftReport("shift", mmd, self.threshold_, mmd / thr)]
        if self.rho_null_ is not None and window.decode is not None and \
                window.decode.shape[0] >= max(10, W // 2):
            r = rho_of(np.asarray(window.signatures)[window.decode_rows], window.decode)
            gap = self.rho_center_ - self.rho_threshold_
            if np.isfinite(r) and gap > 0:
                out.append(DriftReport("rho", float(r), self.rho_threshold_,
                                       (self.rho_center_ - r) / gap))
        return out

    def conclude(self, reports: list[DriftReport]) -> bool:
        """Record a window's reports; True once a signal exceeded ``patience`` windows in a
        row (a distinct-experts alarm counts only with ``distinct_fires``)."""
        for rep in reports:
            self.last_[rep.signal] = rep
            self.consecutive_[rep.signal] = (self.consecutive_.get(rep.signal, 0) + 1
                                             if rep.exceeded else 0)
        return self.drifted

    @property
    def drifted(self) -> bool:
        return any(n >= self.patience for s, n in self.consecutive_.items()
                   if s != "distinct" or self.distinct_fires)

    def update(self, signatures: np.ndarray, decode_counts=None) -> list[DriftReport]:
        """Push many requests at once (tests, offline use); the reports of every window
        completed, in order."""
        reports: list[DriftReport] = []
        for i, s in enumerate(np.asarray(signatures)):
            win = self.push(s, None if decode_counts is None else decode_counts[i])
            if win is not None:
                got = self.check(win)
                self.conclude(got)
                reports += got
        return reports

    # -- measured distinct experts per decoder step (optional engine input) ----------------
    def push_steps(self, decoder: str, distinct: np.ndarray) -> DriftReport | None:
        """Collect per-step mean distinct experts per layer (S,) of one decoder; a report
        when ``window`` steps are in (the first window sets the reference)."""
        steps = self._steps.setdefault(decoder, [])
        steps.extend(float(v) for v in np.asarray(distinct, dtype=np.float64).ravel()
                     if np.isfinite(v))
        if len(steps) < self.window:
            return None
        mean = float(np.mean(steps))
        self._steps[decoder] = []
        ref = self.distinct_ref_.get(decoder)
        if ref is None or ref <= 0:
            self.distinct_ref_[decoder] = mean
            return None
        ratio = mean / ref
        rep = DriftReport("distinct", ratio, 1.0 + self.rise, (ratio - 1.0) / self.rise)
        self.conclude([rep])
        return rep
