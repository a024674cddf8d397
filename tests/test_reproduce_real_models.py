"""Simulating recorded routing (eldr.reproduce.recorded) and the report's "Real models"
section (eldr.reproduce.real_models): which input each policy routes on, arrivals that
never batch a request with itself, decode-only traces with and without prompt ids, the
section's tables."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from _recorded_data import K, recorded_trace
from eldr.reproduce import QUICK
from eldr.reproduce.real_models import CASES, real_models, real_models_markdown
from eldr.reproduce.recorded import (
    cap_outputs,
    compare,
    copies_in_flight,
    fit_recorded,
    policy_input,
    recycled_arrivals,
    routing_input,
)


def test_routing_input_of_each_kind_of_trace():
    assert routing_input(recorded_trace(prefill=True)) == "prefill"
    assert routing_input(recorded_trace()) == "prompt"
    assert routing_input(recorded_trace(prompt_ids=False)) == "none"
    assert policy_input("jsq", "prompt") == "load"
    assert policy_input("eldr_cost", "prompt") == "prompt"
    assert policy_input("oracle_signature", "prefill") == "decode"


def test_recycled_arrivals_space_copies_exactly_r_apart():
    times, idx = recycled_arrivals(7, 50.0, 3.0, seed=1)
    assert (np.diff(times) >= 0).all() and times[-1] < 3.0
    assert sorted(idx[:7]) == list(range(7))
    assert (idx[7:] == idx[:-7]).all()  # one permutation, repeated


def test_cap_outputs_keeps_the_first_tokens_and_their_counts():
    t = recorded_trace()
    c = cap_outputs(t, 5)
    assert (c.decode_lens == np.minimum(t.decode_lens, 5)).all()
    assert (c.decode_counts.sum(axis=2) == K * c.decode_lens[:, None]).all()
    r = int(np.argmax(t.decode_lens))
    assert (c.decode_topk[c.decode_offsets[r]:c.decode_offsets[r + 1]]
            == t.decode_topk[t.decode_offsets[r]:t.decode_offsets[r] + 5]).all()
    with pytest.raises(ValueError, match="max_decode_tokens"):
        cap_outputs(t, 0)


@pytest.mark.parametrize(("prefill", "ids", "kind"), [(False, True, "prompt"),
                                                      (True, False, "prefill")])
def test_compare_runs_every_policy_on_its_input_without_copies_meeting(prefill, ids, kind):
    t = recorded_trace(prefill=prefill, prompt_ids=ids)
    c = compare(t, num_decode=2, seeds=2, warmup_s=0.5, duration_s=2.0, num_prefill=2)
    assert c.trace_input == kind and c.model == "gpt-oss-20b"
    assert {r["policy"] for r in c.rows} == {"round_robin", "jsq", "p2c", "eldr",
                                            "eldr_cost", "oracle_signature"}
    by = {r["policy"]: r["input"] for r in c.rows}
    assert by["eldr"] == by["eldr_cost"] == kind and by["jsq"] == "load"
    assert by["oracle_signature"] == "decode"
    assert all(r["fallbacks"] == 0 for r in c.rows)  # every request had its input
    assert sum(r["copies_in_flight"] for r in c.rows) == 0
    assert c.best_balancer in ("round_robin", "jsq", "p2c")
    assert c.deltas["eldr_cost"]["p50"].n == 2 and np.isfinite(c.deltas["eldr"]["p99"].mean)
    assert len(c.rho) == 2 and np.isfinite(c.rho).all()
    doc = c.as_dict()
    assert doc["deltas"]["eldr_cost"]["p50"]["n"] == 2 and doc["seeds"] == 2


def test_a_decode_only_trace_without_prompt_ids_runs_balancers_and_says_why_not_eldr():
    t = recorded_trace(prompt_ids=False)
    c = compare(t, num_decode=2, seeds=2, warmup_s=0.5, duration_s=1.5, num_prefill=2)
    assert c.trace_input == "none"
    assert set(c.skipped) == {"eldr", "eldr_cost"}
    assert "no routing input" in c.skipped["eldr_cost"]
    assert {r["policy"] for r in c.rows} == {"round_robin", "jsq", "p2c", "oracle_signature"}
    assert not np.isfinite(c.rho).any()


def test_fit_recorded_refuses_a_trace_without_per_token_decode_experts():
    t = replace(recorded_trace(), decode_topk=None, _cache={})
    with pytest.raises(ValueError, match="decode_topk"):
        fit_recorded(t)


def test_copies_in_flight_counts_a_request_batched_with_itself():
    from eldr.routing import make_policy
    from eldr.sim import SimConfig, simulate

    t = recorded_trace()
    st = fit_recorded(t, seed=0)
    cfg = SimConfig(model="gpt-oss-20b", num_prefill=1, num_decode=1, qps=400.0,
                    warmup_s=0.1, duration_s=0.5, seed=0)
    res = simulate(st.eval, cfg, make_policy("jsq", num_workers=1), tokens=st.tokens,
                   arrivals=recycled_arrivals(st.eval.num_requests, 400.0, 0.6, 0))
    assert copies_in_flight(res) > 0  # one decoder, far above what 24 requests sustain


def test_the_section_is_in_every_plan_and_off_returns_none():
    from eldr.reproduce.plan import PLANS

    assert all(p.real_models and p.real_seeds >= 2 for p in PLANS.values())
    assert real_models(replace(QUICK, real_models=False)) is None
    with pytest.raises(ValueError, match="real_seeds"):
        replace(QUICK, real_seeds=1)


def _canned_case(key, label, trace_input="prompt"):
    iv = {"mean": -2.5, "half_width": 0.7, "n": 3}
    rows = [{"policy": p, "copies_in_flight": 0} for p in ("jsq", "eldr", "eldr_cost")]
    return {"key": key, "label": label, "trace": key, "cap": None, "num_decode": 8,
            "trace_input": trace_input, "heldout": 310, "qps": 60.3, "seeds": 3,
            "rho": [0.6, 0.62, 0.61], "best_balancer": "jsq", "rows": rows,
            "deltas": {p: {"p50": iv, "p99": iv} for p in ("eldr", "eldr_cost")},
            "means": {p: {"p50": 6.8, "p99": 7.0, "distinct": 22.0, "batch": 14.6}
                      for p in ("jsq", "eldr", "eldr_cost")}}


def test_the_section_markdown_names_inputs_intervals_and_the_premise_gap():
    res = {"cases": [_canned_case("gpt-oss-20b", "GPT-OSS-20B"),
                     {"key": "esft", "label": "ESFT", "error": "no constants"}],
           "premises": [{"trace": "task", "kind": "synthetic", "domains": ["code"],
                         "batch": 16, "same_domain": 56.9, "mixed": 70.6, "cut_pct": 19.4},
                        {"trace": "gpt-oss-20b", "kind": "real", "domains": ["mmlu"],
                         "batch": 16, "note": "no domain has 16 requests"}],
           "seconds": 1.0}
    head = [{"workload": "task", "qps": 80.0, "lb_batch": 6.9, "lb_distinct": 41.8,
             "eldr_distinct": 31.8, "cost_distinct": 33.5, "d_p50": -10.8, "d_p50_h": 3.0,
             "d_p99": -5.9, "d_p99_h": 40.5, "cost_d_p50": -10.8, "cost_d_p50_h": 5.4,
             "cost_d_p99": -9.7, "cost_d_p99_h": 21.5}]
    text = "\n".join(real_models_markdown(res, QUICK, head))
    assert "## Real models" in text and "prompt prediction" in text
    assert "-2.5±0.7% / -2.5±0.7%" in text  # eldr_cost and band Δ with intervals
    assert "310 / 60.3 / 14.6" in text and "0.61" in text  # held-out / rate / batch, ρ
    assert "not run: no constants" in text
    assert "| task | 80 | 6.9 | 41.8 → 31.8 → 33.5 |" in text  # the synthetic presets' own
    assert "-19.4%" in text and "17–21%" in text and "no domain has 16" in text
    assert [c.key for c in CASES] == ["gpt-oss-20b", "esft", "esft-capped"]


@pytest.mark.slow
def test_the_shipped_real_traces_simulate_on_their_presets():
    from eldr.traces.real import load_real_trace

    esft = load_real_trace("esft-vanilla-lite")
    c = compare(cap_outputs(esft, 32), num_decode=4, seeds=2, warmup_s=1.0, duration_s=3.0)
    assert c.model == "deepseek-v2-lite" and c.trace_input == "prefill"
    assert sum(r["copies_in_flight"] for r in c.rows) == 0


@pytest.mark.parametrize("prompt_ids", [True, False])
def test_eldr_simulate_takes_a_decode_only_trace(tmp_path, capsys, prompt_ids):
    from eldr.cli import main
    from eldr.traces.trace import save

    path = save(recorded_trace(R=40, prompt_ids=prompt_ids), tmp_path / "t.npz")
    assert main(["simulate", "--trace", str(path), "--decode", "2", "--prefill", "2",
                 "--qps", "20", "--duration", "1", "--warmup", "0.5", "--policies",
                 "jsq,domain,eldr,eldr_cost"]) == 0
    out, err = capsys.readouterr()
    if prompt_ids:
        assert "routing input: prompt prediction" in err
    else:
        assert "not simulated: the trace is decode-only without prompt token ids" in err
    assert ("eldr_cost" in out) == prompt_ids and "domain" in out


def test_the_prompt_predictor_hashes_held_out_ids_the_calibration_never_saw():
    t = recorded_trace()
    ids = t.prompt_token_ids.copy()
    ends = np.cumsum(t.prompt_lens) - 1
    ids[ends] = 1000 + np.arange(t.num_requests)  # each request's last id its own
    t = replace(t, prompt_token_ids=ids, _cache={})
    st = fit_recorded(t, seed=0)
    pred = st.calibration.predictor
    assert st.eval.prompt_token_ids.max() > st.calib.prompt_token_ids.max()
    # the vocabulary both splits use, from the calibration (never refused), not patched
    assert (pred.vocab_size, pred.vocab_source) == (int(ids.max()) + 1, "calibration")
    assert np.isfinite(st.eval_profiles).all()
    assert np.isfinite(pred.predict(np.array([3, pred.vocab_size + 7]))).all()
