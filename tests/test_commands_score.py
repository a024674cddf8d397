import json
from dataclasses import replace

import pytest

from _prompt_data import token_trace
from eldr.cli import main
from eldr.traces.trace import save as save_trace


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("score") / "t.npz"
    save_trace(token_trace(90), path)
    return path


def _score(path, capsys, *extra):
    assert main(["score", str(path), "-r", "count_idf", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_score_reports_the_prompt_predictor_beside_the_prefill_signature(trace_path, capsys):
    doc = _score(trace_path, capsys)
    res = doc["prompt_predictor"]
    assert doc["prompt_predictor_note"] is None
    assert res["num_fit"] + res["num_heldout"] == 90 and res["num_groups"] == 2
    assert set(res["rho"]) == {"prompt", "prefill", "tfidf"}
    # tokens fix their experts in this trace: the prediction is close to the truth
    assert res["r2"] > 0.5
    assert all(-1 <= v <= 1 for v in res["rho"].values()) and res["rho"]["prompt"] > 0
    for key, red in res["reduction_vs_round_robin"].items():
        assert red == pytest.approx(
            1 - res["distinct_experts_per_step"][key] / res["round_robin"])
    assert res["reduction_vs_round_robin"]["prompt"] > 0


def test_score_says_why_it_skips_the_prompt_predictor(trace_path, tmp_path, capsys):
    assert _score(trace_path, capsys, "--no-prompt")["prompt_predictor_note"] == \
        "skipped (--no-prompt)"
    trace = token_trace(30)
    synth = tmp_path / "s.npz"
    save_trace(replace(trace, meta=replace(trace.meta, source="synthetic:test")), synth)
    doc = _score(synth, capsys)
    assert doc["prompt_predictor"] is None and "synthetic" in doc["prompt_predictor_note"]
    none = tmp_path / "n.npz"
    save_trace(replace(trace, prompt_token_ids=None), none)
    assert "no prompt_token_ids" in _score(none, capsys)["prompt_predictor_note"]
    assert main(["score", str(trace_path), "-r", "count_idf", "--prompt-groups", "2"]) == 0
    out = capsys.readouterr().out
    assert "prompt predictor (routing before prefill)" in out and "token TF-IDF" in out
