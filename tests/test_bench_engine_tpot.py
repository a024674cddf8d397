"""The engine-free parts of ``benchmarks/bench_engine_tpot.py``: the held-out split, the
lockstep count of distinct experts, the per-wave step fits and the analysis of saved
records (what ``--analyse`` runs on a ``result.json``). The engines themselves run in
``tests/e2e/test_engine_tpot_e2e.py``."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench(engine_bench):
    return engine_bench


def test_a_policy_entry_names_the_router_policy_and_its_layer_stride(bench):
    assert bench.policy_spec("eldr") == ("eldr", ())
    assert bench.policy_spec("eldr_cost/3") == ("eldr_cost", ("--cost-layer-stride", "3"))
    for bad in ("eldr/3", "eldr_cost/0", "eldr_cost/x", "eldr_cost/"):
        with pytest.raises(ValueError, match="layer stride"):
            bench.policy_spec(bad)


def test_held_out_split_serves_and_fits_disjoint_halves(bench):
    prompts = bench.load_prompts()
    served, fitted = bench.split_held_out(prompts)
    assert sorted(served) == sorted(prompts) == sorted(fitted)
    for d, texts in prompts.items():
        assert not set(served[d]) & set(fitted[d])
        assert sorted(served[d] + fitted[d]) == sorted(texts)
    # a wave of 16 from 4 domains needs 4 prompts per domain: the served half has them
    waves = bench.make_waves(served, 3, 16, seed=0, num_domains=4)
    assert all(len(w) == 16 for w in waves)


def test_lockstep_distinct_counts_the_union_of_each_step(bench):
    a = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]]])  # (T=2, L=2, k=2)
    b = np.array([[[1, 4], [2, 3]], [[5, 6], [7, 8]], [[9, 9], [9, 9]]])  # T=3
    assert bench.lockstep_distinct([a]) == 2.0
    # step 0: {0,1,4}, {2,3}; step 1: {0,1,5,6}, {2,3,7,8}; b's third token has no partner
    assert bench.lockstep_distinct([a, b]) == (3 + 2 + 4 + 4) / 4
    assert bench.lockstep_distinct([a, a]) == 2.0  # the same requests add no expert
    assert np.isnan(bench.lockstep_distinct([a[:0], b]))


def _record(k, policy, per):
    per = {n: {"requests": 4, "domains": ["x"] * 4, "itl_n": 10.0, "itl_s": f["step_s"],
               **f} for n, f in per.items()}
    return {"round": k, "policy": policy, "per": per, "summary": bench_summary(per)}


def bench_summary(per):
    spec = sys.modules["bench_engine_tpot"]
    return spec.wave_summary(per)


def _synthetic_records(rng, t0=0.01, b=0.001, c=0.002):
    """Waves whose mean steps follow t0 + b·ΣD + c·B exactly; eldr has 20 % fewer ΣD."""
    records = []
    for k in range(6):
        for policy, scale in (("jsq", 1.0), ("eldr", 0.8)):
            per = {}
            for name in ("decode-0", "decode-1"):
                dsum = scale * rng.uniform(60, 120)
                batch = rng.uniform(6, 10)
                per[name] = {"steps": 40, "batch": batch, "distinct_sum": dsum,
                             "distinct": dsum / 6, "step_s": t0 + b * dsum + c * batch}
            records.append(_record(k, policy, per))
    return records


def test_wave_fits_recover_a_linear_step_model(bench):
    records = _synthetic_records(np.random.default_rng(0))
    fits = bench.wave_fits(records)
    for f in fits.values():
        assert f.t0_s == pytest.approx(0.01, abs=1e-9)
        assert f.b_s == pytest.approx(0.001, rel=1e-6)
        assert f.c_s == pytest.approx(0.002, rel=1e-6)
        assert f.r2 == pytest.approx(1.0)
    # leaving a round out drops its waves
    assert all(f.n == 10 for f in bench.wave_fits(records, leave_out=0).values())


def test_analysis_predicts_the_measured_difference_of_an_exact_model(bench):
    records = _synthetic_records(np.random.default_rng(1))
    out = bench.analyse(records, ["jsq", "eldr"], fits=None)
    e = out["policies"]["eldr"]
    measured, predicted = e["step_ms_vs_base"], e["wave_predicted_vs_base"]
    assert measured["mean_pct"] < -5  # fewer distinct experts, faster steps
    assert predicted["mean_pct"] == pytest.approx(measured["mean_pct"], abs=1e-6)
    assert predicted["n"] == 6


def test_reanalyse_reads_a_saved_result(bench, tmp_path):
    from eldr.sim.stepfit import fit_step_model

    rng = np.random.default_rng(2)
    records = _synthetic_records(rng)
    fit = fit_step_model(rng.uniform(0.05, 0.1, 50), rng.integers(1, 9, 50),
                         rng.uniform(10, 100, 50))
    doc = {"records": records, "policies": ["jsq", "eldr"],
           "fits": {"decode-0": fit.to_json(), "decode-1": fit.to_json()}}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(doc))
    res = bench.reanalyse(path)
    assert bench.fit_from_json(fit.to_json()) == fit
    e = res["analysis"]["policies"]["eldr"]
    assert {"predicted_vs_base", "wave_predicted_vs_base", "step_ms_vs_base"} <= set(e)
    text = bench.report({**res, "width": 2048, "per_decoder": 8, "max_tokens": 48,
                         "seconds": 1.0})
    assert "| eldr |" in text and "decode-1: t0 10000 µs, b 1000.0 µs" in text


def test_pooled_runs_number_their_rounds_on_and_must_match(bench, tmp_path):
    paths = []
    for seed in (3, 4):
        doc = {"records": _synthetic_records(np.random.default_rng(seed)),
               "policies": ["jsq", "eldr"], "width": 2048, "per_decoder": 4,
               "max_tokens": 48, "seconds": 10.0, "seed": seed}
        paths.append(tmp_path / f"r{seed}.json")
        paths[-1].write_text(json.dumps(doc))
    res = bench.pool_results(paths)
    assert sorted({r["round"] for r in res["records"]}) == list(range(12))  # 6 + 6
    assert res["analysis"]["policies"]["eldr"]["step_ms_vs_base"]["n"] == 12
    assert res["seeds"] == [3, 4] and res["seconds"] == 20.0
    assert "| eldr |" in bench.report(res)
    other = json.loads(paths[1].read_text())
    other["max_tokens"] = 16
    paths[1].write_text(json.dumps(other))
    with pytest.raises(ValueError, match="max_tokens 16 differs"):
        bench.pool_results(paths)
