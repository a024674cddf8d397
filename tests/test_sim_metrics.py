"""Summaries over the measured window, per-decoder rows, atomic CSV/JSON."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from eldr.sim import SimConfig, SimResult, write_csv, write_json
from eldr.sim.records import RequestRecord, Requests


def _result():
    cfg = SimConfig(num_decode=2, warmup_s=1.0, duration_s=2.0)
    req = Requests.from_columns({
        "trace_index": [0, 1, 2, 3],
        "prompt_len": [10, 10, 10, 10],
        "t_arrival": np.array([0.5, 1.0, 2.0, 3.0]),
        "t_first": np.array([0.6, 1.1, 2.2, 3.1]),
        "t_last": np.array([0.7, 1.5, 2.2, 3.5]),
        "n_out": np.array([2, 5, 1, 3]),
        "decoder": np.array([0, 1, 1, 0]),
    })
    return SimResult(cfg, "jsq", req, decoder_steps=np.array([10, 0]),
                     decoder_batch_sum=np.array([30, 0]),
                     decoder_distinct_sum=np.array([48 * 10 * 20, 0]), num_layers=48,
                     window_tokens=100, total_steps=12, wall_s=0.5)


def test_summary_uses_the_window_and_defines_tpot():
    res = _result()
    np.testing.assert_array_equal(res.measured, [False, True, True, False])
    tpot = res.tpot()
    assert tpot[1] == pytest.approx(0.1) and np.isnan(tpot[2])
    s = res.summary()
    assert s["requests_measured"] == 2
    assert s["tpot_median_ms"] == pytest.approx(100.0)  # n_out = 1 excluded
    assert s["ttft_median_ms"] == pytest.approx(150.0)  # median of 100 and 200 ms
    assert s["throughput_tok_s"] == 50.0 and s["mean_batch"] == 3.0
    assert s["mean_distinct_per_layer"] == 20.0
    rows = res.decoder_table()
    assert [r["request_share"] for r in rows] == [0.0, 1.0]


def test_csv_and_json_are_written(tmp_path):
    res = _result()
    write_csv([res.summary()], tmp_path / "a" / "rows.csv")
    with open(tmp_path / "a" / "rows.csv") as fh:
        assert next(csv.DictReader(fh))["policy"] == "jsq"
    write_json({"x": float("nan"), "y": np.int64(3)}, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": None, "y": 3}


def test_the_summary_table_has_a_header_and_one_aligned_line_per_row():
    from eldr.sim.metrics import summary_table

    s = _result().summary()
    lines = summary_table([s, {**s, "policy": "eldr_cost", "qps": 12.5}]).splitlines()
    assert lines[0].split() == ["policy", "req/s", "TPOT", "p50", "TPOT", "p99", "TTFT",
                                "p50", "tok/s", "batch", "D/layer"]
    assert lines[1].split() == ["jsq", "20", "100.00", "100.00", "150.00", "50", "3.0",
                                "20.0"]
    assert lines[2].startswith("eldr_cost") and " 12.5 " in lines[2]
    assert len({len(line) for line in lines}) == 1  # columns aligned
    assert summary_table([]) == lines[0]


def test_request_records_read_by_column():
    req = Requests([RequestRecord(3, 0.5, 10, 2, decoder=1, t_first=0.7),
                    RequestRecord(4, 0.6, 12, 1)])
    np.testing.assert_array_equal(req["t_first"], [0.7, np.nan])  # unset time: NaN
    assert req[1].decoder is None and "decoder" not in req and "t_arrival" in req
    with pytest.raises(ValueError, match="'decoder' is unset"):
        req.column("decoder")
    with pytest.raises(KeyError, match="no request field"):
        req.column("nope")
    assert not req["trace_index"].flags.writeable  # cached columns stay as recorded
