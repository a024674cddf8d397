import numpy as np
import pytest

from eldr.intervals import PairedInterval, t_quantile_975
from eldr.reproduce.grid import (
    BETTER,
    UNSURE,
    WORSE,
    balancer_check,
    cells_needing_seeds,
    class_counts,
    classify,
    comparisons,
    false_worse_probability,
    grid_rows,
    grid_table,
)
from eldr.reproduce.plots import plot_grid

EV = "eldr[tau=0.1,balanced]"
VARIANTS = {"eldr": EV}


def _row(wl, K, q, policy, p50, p99, seed=0, variant=None):
    return {"experiment": "grid", "workload": wl, "num_decode": K, "qps": q,
            "policy": policy, "variant": variant or policy, "replicate": seed,
            "tpot_median_ms": p50, "tpot_p99_ms": p99}


def _cell(wl, K, q, deltas, seeds=4, noise=None):
    """Grid rows of one cell: balancers at 4 / 5 ms (jsq, p2c, round_robin slower by
    0 / 0.5 / 3 %), eldr and eldr_cost at balancer jsq times (1 + deltas[name] %) plus a
    per-seed relative wobble ``noise[name][j]`` (%)."""
    noise = noise or {}
    rows = []
    for j in range(seeds):
        base = 1.0 + 0.01 * j  # seed-to-seed level: paired away
        for lb, slow in (("jsq", 0.0), ("p2c", 0.5), ("round_robin", 3.0)):
            rows.append(_row(wl, K, q, lb, 4 * base * (1 + slow / 100),
                             5 * base * (1 + slow / 100), j))
        for name, d in deltas.items():
            wobble = noise.get(name, (0.0,) * seeds)
            f = 1 + (d + wobble[j]) / 100
            rows.append(_row(wl, K, q, name, 4 * base * f, 5 * base * f, j,
                             VARIANTS.get(name)))
    return rows


def test_classes_of_constructed_intervals():
    assert classify(PairedInterval(2.0, 0.5, 5)) == WORSE  # [1.5, 2.5] above +1 %
    assert classify(PairedInterval(1.2, 0.5, 5)) == UNSURE  # [0.7, 1.7] straddles
    assert classify(PairedInterval(0.2, 0.5, 5)) == BETTER  # [-0.3, 0.7] below
    assert classify(PairedInterval(-9.0, 0.1, 5)) == BETTER
    assert classify(PairedInterval(5.0, float("nan"), 1)) == UNSURE  # no interval


def test_each_balancer_is_compared_on_paired_seeds():
    # eldr +5 % over jsq with ±0.3 % per-seed wobble: worse than jsq and p2c (+4.5 %),
    # round_robin (+1.9 %): worse too; eldr_cost exactly jsq: better or equal everywhere
    rows = _cell("task", 8, 20, {"eldr": 5.0, "eldr_cost": 0.0},
                 noise={"eldr": (0.3, -0.3, 0.2, -0.2)})
    comps = comparisons(rows, VARIANTS)
    assert len(comps) == 2 * 3 * 2  # policies × balancers × metrics
    by = {(c["policy"], c["balancer"], c["metric"]): c for c in comps}
    e = by[("eldr", "jsq", "p50")]
    assert e["n"] == 4 and np.isclose(e["mean"], 5.0, atol=0.01) and e["cls"] == WORSE
    assert np.isclose(e["half"], t_quantile_975(3) * e["sd"] / 2)  # t · sd / √4
    assert np.isclose(by[("eldr", "round_robin", "p99")]["mean"], 100 * (1.05 / 1.03 - 1),
                      atol=0.01)
    assert all(c["cls"] == BETTER for c in comps if c["policy"] == "eldr_cost")
    assert by[("eldr_cost", "jsq", "p50")]["half"] == 0.0  # identical on every seed
    rows_ = {r["policy"]: r for r in grid_rows(rows, VARIANTS)}
    assert rows_["eldr"]["cls"] == WORSE and not rows_["eldr"]["ok"]
    assert rows_["eldr"]["lb_p50"] == "jsq"  # decisive: worst class, then largest Δ
    assert rows_["eldr_cost"]["ok"] and rows_["eldr_cost"]["n"] == 4


def test_a_wide_interval_across_the_tolerance_is_not_distinguishable():
    rows = _cell("task", 8, 20, {"eldr": 1.0, "eldr_cost": -5.0},
                 noise={n: (3.0, -3.0, 2.0, -2.0) for n in ("eldr", "eldr_cost")})
    by = {(c["policy"], c["balancer"], c["metric"]): c["cls"]
          for c in comparisons(rows, VARIANTS)}
    assert by[("eldr", "jsq", "p50")] == UNSURE
    assert by[("eldr_cost", "jsq", "p50")] == BETTER  # -5 ± 4.8 lies below +1


def test_false_worse_probability_is_the_noncentral_t_tail():
    stats = pytest.importorskip("scipy.stats")
    for n, sd in ((2, 1.0), (3, 3.0), (5, 0.8), (10, 2.0), (30, 5.0)):
        want = stats.nct.sf(t_quantile_975(n - 1), n - 1, -np.sqrt(n) * 1.0 / sd)
        assert np.isclose(false_worse_probability(sd, n), want, rtol=0.01, atol=1e-9)
    assert false_worse_probability(0.0, 5) == 0.0 and false_worse_probability(3.0, 1) == 0.0
    assert false_worse_probability(3.0, 3) > false_worse_probability(1.0, 3)


def test_identical_policies_get_about_the_expected_false_worse_count():
    # the null: true difference 0, per-seed spread 3 %, 3 seeds, 400 cells × 3 × 2
    rng = np.random.default_rng(0)
    rows = []
    for c in range(400):
        rows += _cell("task", 8, float(c + 1), {"eldr_cost": 0.0}, seeds=3,
                      noise={"eldr_cost": tuple(rng.normal(0.0, 3.0, 3))})
    comps = comparisons(rows, VARIANTS)
    worse = class_counts(comps)[WORSE]
    expected = sum(c["p_false"] for c in comps)
    # P ≈ 0.009 per comparison at the true spread: ≈ 22 of 2,400 (the sum plugs in each
    # cell's observed spread, so it scatters around that)
    assert 10 < expected < 45
    assert abs(worse - expected) < 4 * np.sqrt(expected) + 2


def test_seeds_are_asked_for_until_the_target_or_the_maximum():
    wide = _cell("task", 8, 20, {"eldr": 1.0, "eldr_cost": 0.0}, seeds=3,
                 noise={"eldr": (2.0, -2.0, 1.0)})
    tight = _cell("task", 16, 20, {"eldr": 1.0, "eldr_cost": 0.0}, seeds=3,
                  noise={"eldr": (0.01, -0.01, 0.0)})
    assert cells_needing_seeds(wide + tight, 0.5, 10) == [(("task", 8, 20.0), 3)]
    assert cells_needing_seeds(wide + tight, 0.5, 3) == []  # at the maximum
    assert cells_needing_seeds(wide + tight, 100.0, 10) == []  # every cell within target


def test_table_shows_intervals_classes_and_false_positive_expectation(tmp_path):
    rows = (_cell("task", 8, 20, {"eldr": 5.0, "eldr_cost": 0.0},
                  noise={"eldr": (0.3, -0.3, 0.2, -0.2)})
            + _cell("task", 8, 60, {"eldr": 1.0, "eldr_cost": -3.0},
                    noise={n: (3.0, -3.0, 2.0, -2.0) for n in ("eldr", "eldr_cost")}))
    comps = comparisons(rows, VARIANTS)
    grid = grid_rows(rows, VARIANTS)
    md = grid_table(grid, comps, balancer_check(rows))
    assert "| `eldr` | jsq | 1 / 1 / 0 | 1 / 1 / 0 | 1 of 2 |" in md
    # -3 ± 4.7 straddles +1 against jsq and p2c, lies below it against round_robin
    assert "| `eldr_cost` | any balancer | 0 / 2 / 4 | 0 / 2 / 4 | 0 of 2 |" in md
    assert "expected false \"worse\"" in md and "`jsq` vs `p2c`: 0 worse" in md
    assert "**+5.0±0.5**" in md  # worse: bold, with the half-width
    assert "_+1.0±" in md and "[4]" in md  # not distinguishable: italic; seeds
    plot_grid(grid, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 1000
