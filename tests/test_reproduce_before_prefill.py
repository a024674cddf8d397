"""The report's "Routing before prefill" section (eldr.reproduce.before_prefill) on a
small part of the shipped prompt trace and a window of a fraction of a second."""

from dataclasses import replace

import numpy as np
import pytest

from eldr.capture import tiny_moe_prompt_trace_path, tiny_moe_trace_path
from eldr.reproduce import QUICK
from eldr.reproduce.before_prefill import before_prefill, section_policies
from eldr.reproduce.report import SECTIONS, before_prefill_markdown
from eldr.traces.trace import load

SMALL = replace(QUICK, prompt_rates=(100.0,), prompt_duration_s=0.5, tiny_warmup_s=0.1)


@pytest.fixture(scope="module")
def small_trace():
    """8 requests of each of the 10 domains (80), in the file's order."""
    t = load(tiny_moe_prompt_trace_path())
    keep = np.concatenate([np.flatnonzero(t.domains == d)[:8] for d in range(10)])
    return t.subset(np.sort(keep))


@pytest.fixture(scope="module")
def figures(small_trace):
    return before_prefill(SMALL, trace=small_trace)


def test_plans_with_and_without_the_section():
    assert QUICK.prompt_rates and "prompt" in dict(SECTIONS)
    assert before_prefill(replace(QUICK, prompt_rates=())) is None


def test_needs_a_captured_trace_with_prompt_ids(small_trace):
    with pytest.raises(ValueError, match="without ids"):
        before_prefill(SMALL, trace=load(tiny_moe_trace_path()))
    synthetic = replace(small_trace, meta=replace(small_trace.meta, source="synthetic:task"))
    with pytest.raises(ValueError, match="synthetic"):
        before_prefill(SMALL, trace=synthetic)


def test_figures_compare_prediction_signature_and_tfidf(figures):
    assert [r["source"] for r in figures["quality"]] == ["prompt", "prefill", "tfidf"]
    assert figures["num_fit"] + figures["num_heldout"] == 80
    assert 0.0 < figures["r2"] < 1.0
    for r in figures["quality"]:
        assert -1.0 <= r["rho"] <= 1.0
        assert r["reduction_pct"] == pytest.approx(
            100 * (1 - r["distinct"] / figures["round_robin"]))
    # ten domains: grouping by the real prefill signature beats a content-blind split
    prefill = next(r for r in figures["quality"] if r["source"] == "prefill")
    assert prefill["distinct"] < figures["round_robin"]
    (row,) = figures["tpot"]
    assert row["qps"] == 100.0 and all(row[p] > 0 for p in section_policies())
    assert row["prompt_gap_pct"] == pytest.approx(
        100 * (row["eldr_cost@prompt"] / row["eldr_cost"] - 1))
    assert row["cost_wins"] == (row["eldr_cost"] < row["jsq"])


def test_markdown_names_the_trace_and_every_figure(figures):
    text = "\n".join(before_prefill_markdown(figures, SMALL))
    assert "## Routing before prefill" in text
    assert "draw token ids uniformly" in text and "captured traces only" in text
    assert f"**{figures['r2']:.3f}**" in text
    for r in figures["quality"]:
        assert f"{r['rho']:.3f}" in text and f"{-r['reduction_pct']:+.1f}%" in text
    row = figures["tpot"][0]
    assert f"| 100 | {row['jsq']:.2f} | {row['eldr_cost']:.2f} | " \
           f"{row['eldr_cost@prompt']:.2f} | {row['prompt_gap_pct']:+.1f}% |" in text


def test_the_predictor_hashes_held_out_ids_the_calibration_never_saw(small_trace,
                                                                     monkeypatch):
    import eldr.reproduce.before_prefill as bp

    ids = small_trace.prompt_token_ids.copy()
    ends = np.cumsum(small_trace.prompt_lens) - 1
    ids[ends] = 5000 + np.arange(small_trace.num_requests)  # each request's last id its own
    trace = replace(small_trace, prompt_token_ids=ids, _cache={})
    seen, real = {}, bp.prompt_inputs

    class Done(Exception):
        pass

    def spy(ev, encoder, pred, **kw):  # predicts every held-out prompt, then stops
        seen["out"], seen["ev"], seen["pred"] = real(ev, encoder, pred, **kw), ev, pred
        raise Done

    monkeypatch.setattr(bp, "prompt_inputs", spy)
    with pytest.raises(Done):
        bp._tpot_rows(SMALL, trace)
    pred, ev = seen["pred"], seen["ev"]
    assert (pred.vocab_size, pred.vocab_source) == (int(ids.max()) + 1, "calibration")
    assert pred.vocab_size >= int(ev.prompt_token_ids.max()) + 1
    assert np.isfinite(seen["out"][1]).all()
    assert np.isfinite(pred.predict(np.array([3, pred.vocab_size + 7]))).all()
