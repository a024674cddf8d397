"""eldr.intervals: Student-t quantiles and paired 95 % intervals."""

import math

import numpy as np
import pytest

from eldr.intervals import PairedInterval, paired_interval, t_quantile_975

stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", [1, 2, 3, 5, 10, 29, 30, 31, 40, 60, 120, 1000])
def test_t_quantile_matches_scipy(df):
    assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)


def test_t_quantile_refuses_bad_df():
    for bad in (0, -1, 2.5, None):
        with pytest.raises(ValueError, match="degrees of freedom"):
            t_quantile_975(bad)


def test_paired_interval_matches_scipy_and_covers():
    rng = np.random.default_rng(0)
    d = rng.normal(0.3, 1.0, 12)
    got = paired_interval(d)
    low, high = stats.t.interval(0.95, 11, loc=d.mean(), scale=stats.sem(d))
    assert got.low == pytest.approx(low, rel=1e-3) and got.high == pytest.approx(high, rel=1e-3)
    assert got.n == 12 and "n=12" in str(got)
    # coverage: about 95 % of intervals of a true mean-0 difference contain 0
    hits = sum(not paired_interval(rng.normal(0, 1, 5)).excludes(0.0) for _ in range(4000))
    assert 0.93 < hits / 4000 < 0.97


def test_paired_interval_edges():
    one = paired_interval([2.0])
    assert one.mean == 2.0 and math.isnan(one.half_width) and not one.excludes(0.0)
    assert paired_interval([1.0, 1.0, 1.0]) == PairedInterval(1.0, 0.0, 3)
    assert paired_interval([1.0, 1.2, 0.9]).excludes(0.0)
    with pytest.raises(ValueError, match="no paired"):
        paired_interval([])
    with pytest.raises(ValueError, match="finite"):
        paired_interval([1.0, float("nan")])


def test_percent_change_and_its_undefined_baselines():
    from eldr.intervals import percent_change

    assert percent_change(90.0, 100.0) == -10.0
    assert percent_change(3.0, 2.0) == 50.0
    for base in (0.0, float("nan"), float("inf")):
        assert math.isnan(percent_change(1.0, base))
