"""Confidence intervals of paired differences (numpy only).

Measurements here are paired by design: the simulator replays identical arrivals for every
policy of a (seed, cell), and the engine benchmark sends the same wave of prompts through
every policy of a round. So a policy's difference against a baseline is a mean of per-pair
differences ``d_i`` and its 95 % interval is ``mean ± t(0.975, n−1) · sd / √n`` (Student's
t: with a handful of pairs the normal quantile 1.96 would be too narrow, e.g. 4.30 at
n = 3).

The t quantile comes from a table for 1–30 degrees of freedom (rounded to 3 decimals from
the exact values) and the Cornish–Fisher expansion beyond (error < 1e-4 from 30 on), so
the module needs no scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["PairedInterval", "paired_interval", "percent_change", "t_quantile_975"]

# t(0.975, df) for df = 1 … 30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` >= 1 degrees of freedom."""
    if not isinstance(df, (int, np.integer)) or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    z, n = _Z975, float(df)  # Cornish-Fisher expansion of t in 1/df
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / n + g2 / n**2 + g3 / n**3


@dataclass(frozen=True, slots=True)
class PairedInterval:
    """Mean of paired differences with its 95 % interval."""

    mean: float
    half_width: float  # the interval is mean ± half_width (nan with fewer than 2 pairs)
    n: int  # pairs

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def excludes(self, value: float = 0.0) -> bool:
        """True when the whole interval lies on one side of ``value``."""
        return bool(self.n >= 2 and (self.low > value or self.high < value))

    def __str__(self) -> str:
        return f"{self.mean:+.2f} ± {self.half_width:.2f} (n={self.n})"


def paired_interval(diffs) -> PairedInterval:
    """Mean and 95 % interval of ``diffs`` (n,) per-pair differences (finite; n >= 1)."""
    d = np.asarray(diffs, dtype=np.float64).ravel()
    if d.size == 0:
        raise ValueError("no paired differences")
    if not np.isfinite(d).all():
        raise ValueError("paired differences must be finite")
    n = int(d.size)
    if n == 1:
        return PairedInterval(float(d[0]), math.nan, 1)
    half = t_quantile_975(n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
    return PairedInterval(float(d.mean()), half, n)


def percent_change(new: float, base: float) -> float:
    """``100 · (new − base) / base``: a policy's figure against its baseline's, in percent
    (nan when the baseline is 0 or not finite: no comparison, never a division error)."""
    return 100.0 * (new - base) / base if base and np.isfinite(base) else float("nan")
