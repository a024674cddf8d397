import numpy as np

from eldr.reproduce.grid import grid_rows, grid_table, plot_grid


def _row(wl, K, q, policy, p50, p99, variant=None):
    return {"experiment": "grid", "workload": wl, "num_decode": K, "qps": q,
            "policy": policy, "variant": variant or policy,
            "tpot_median_ms": p50, "tpot_p99_ms": p99}


ROWS = [
    _row("task", 8, 20, "jsq", 4.0, 5.0), _row("task", 8, 20, "p2c", 4.2, 4.9),
    _row("task", 8, 20, "round_robin", 4.1, 5.5),
    _row("task", 8, 20, "eldr", 4.4, 5.0, "eldr[tau=0.1,balanced]"),
    _row("task", 8, 20, "eldr_cost", 4.0, 4.9),
    {"experiment": "main", "workload": "task", "num_decode": 8, "qps": 20, "policy": "jsq",
     "variant": "jsq", "tpot_median_ms": 1.0, "tpot_p99_ms": 1.0},  # not a grid row
]


def test_best_balancer_is_taken_per_metric():
    rows = grid_rows(ROWS, {"eldr": "eldr[tau=0.1,balanced]"})
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"eldr", "eldr_cost"}
    e = by["eldr"]
    assert e["best_p50_lb"] == "jsq" and e["best_p99_lb"] == "p2c"  # 4.0 ms; 4.9 ms
    assert np.isclose(e["d_p50"], 10.0) and np.isclose(e["d_p99"], 100 * (5.0 / 4.9 - 1))
    assert not e["ok"] and by["eldr_cost"]["ok"]
    assert by["eldr_cost"]["d_p50"] == 0.0 and by["eldr_cost"]["d_p99"] == 0.0


def test_table_marks_cells_over_tolerance_and_counts_them(tmp_path):
    rows = grid_rows(ROWS, {"eldr": "eldr[tau=0.1,balanced]"})
    md = grid_table(rows)
    assert "**+10.0/+2.0**" in md and "+0.0/+0.0" in md
    assert "`eldr_cost`: 1 of 1 cells within" in md and "`eldr`: 0 of 1 cells" in md
    plot_grid(rows, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 1000
