from __future__ import annotations

import json

import pytest

from conftest import make_trace
from eldr.cli import main
from eldr.traces.trace import save


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "score" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2


def test_score_text_and_json(tmp_path, capsys):
    path = save(make_trace(60, seed=3), tmp_path / "t.npz")
    assert main(["score", str(path), "-r", "count_idf", "-r", "gate_prob"]) == 0
    out = capsys.readouterr().out
    assert "count_idf" in out and "gate_prob" in out and "prefill-decode Pearson" in out
    assert main(["score", str(path), "--json", "-r", "count"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["representations"][0]["representation"] == "count"
    assert -1.0 <= doc["representations"][0]["rho"] <= 1.0
    assert doc["prefill_decode_pearson"]["requests"] > 0


def test_score_bad_file_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_text("not a trace")
    assert main(["score", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a zip archive" in err[0]
    assert main(["score", str(tmp_path / "missing.npz")]) == 2


def test_simulate_refuses_a_model_the_cpu_preset_has_not_measured_before_any_work(capsys):
    assert main(["simulate", "--hardware", "cpu", "--model", "qwen3-30b-a3b", "--qps", "1"]) == 2
    assert "tiny-moe only" in capsys.readouterr().err
