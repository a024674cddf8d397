"""The engine-free pieces of ``benchmarks/sim_engine_waves.py`` (the engine run's waves
replayed in the simulator), on tiny synthetic inputs: no vLLM, no capture."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import make_trace

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_engine_waves.py"


@pytest.fixture(scope="module")
def sew():
    spec = importlib.util.spec_from_file_location("sim_engine_waves", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench(sew):
    return sew.load_bench()


def _tiny_moe_trace(n: int = 12, seed: int = 0):
    """A trace of the tiny MoE's shapes (L 6, E 64, k 4), every request with decode rows."""
    t = make_trace(60, num_layers=6, num_experts=64, top_k=4, seed=seed, num_domains=2)
    return t.subset(np.flatnonzero(t.output_lens >= 2)[:n])


def test_artifact_mode_reads_what_the_bench_wrote(sew):
    assert sew.artifact_mode({"artifact": "fit on held-out prompts"}) == "held_out"
    assert sew.artifact_mode({"artifact": "fit on prompts"}) == "on_prompts"
    assert sew.artifact_mode({"artifact": None}) == "default"
    assert sew.artifact_mode({"artifact": "/some/dir"}) == "/some/dir"


def test_served_and_fitted_follow_the_run(sew, bench):
    prompts = {"a": ["a0", "a1", "a2"], "b": ["b0", "b1"], "c": ["c0"]}
    served, fitted = sew.served_and_fitted(bench, {"artifact": "fit on held-out prompts"},
                                           prompts)
    assert served == {"a": ["a0", "a2"], "b": ["b0"], "c": ["c0"]}
    assert fitted == {"a": ["a1"], "b": ["b1"]}
    served, fitted = sew.served_and_fitted(bench, {"artifact": "fit on prompts",
                                                   "only_domains": ["a", "b"]}, prompts)
    assert served == fitted == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1"]}
    assert sew.served_and_fitted(bench, {"artifact": None}, prompts) == (prompts, None)


def test_rebuilt_waves_are_checked_against_the_recorded_domains(sew, bench):
    prompts = {d: [f"{d}{i}" for i in range(4)] for d in "abcd"}
    res = {"rounds": 2, "per_decoder": 2, "seed": 3, "domains": 2}
    waves = sew.rebuild_waves(bench, res, prompts)
    assert len(waves) == 3 and all(len(w) == 4 for w in waves)
    assert waves == bench.make_waves(prompts, 3, 4, 3, 2)  # the bench's own draw
    doms = [d for d, _ in waves[2]]
    good = [{"round": 1, "policy": "jsq",
             "per": {"x": {"domains": doms[:3]}, "y": {"domains": doms[3:]}}}]
    sew.check_waves(waves, good)
    wrong = [{"round": 0, "policy": "jsq",  # round 1's domains recorded as round 0's
              "per": {"x": {"domains": sorted(doms)}}}]
    if sorted(doms) != sorted(d for d, _ in waves[1]):
        with pytest.raises(ValueError, match="not the run's waves"):
            sew.check_waves(waves, wrong)
    with pytest.raises(ValueError, match="no rebuilt wave"):
        sew.check_waves(waves, [{"round": 5, "policy": "jsq", "per": {}}])


def test_fixed_length_repeats_short_decode_rows_and_cuts_long_ones(sew):
    t = _tiny_moe_trace(6)
    out, padded = sew.fixed_length(t, 5)
    assert (out.output_lens == 5).all()
    assert padded == int((t.output_lens - 1 < 4).sum())
    off, off0 = out.decode_offsets, t.decode_offsets
    for r in range(t.num_requests):
        own = t.decode_topk[off0[r]:off0[r + 1]]
        rows = out.decode_topk[off[r]:off[r + 1]]
        assert rows.shape[0] == 4
        np.testing.assert_array_equal(rows, own[np.arange(4) % own.shape[0]])
        for layer in range(6):  # counts follow the rows
            np.testing.assert_array_equal(
                out.decode_counts[r, layer], np.bincount(rows[:, layer].ravel(), minlength=64))
    np.testing.assert_array_equal(out.prefill_counts, t.prefill_counts)
    with pytest.raises(ValueError, match="n_out"):
        sew.fixed_length(t, 1)


def test_busy_seconds_counts_steps_not_idle_gaps(sew):
    ev = [(1.0, "admit", 0, 0), (1.5, "step_done", 1, 0), (2.0, "step_done", 1, 0),
          (2.0, "finish", 0, 0),
          (5.0, "admit", 1, 0), (5.25, "step_done", 1, 0),  # idle 2 → 5 not counted
          (0.5, "admit", 2, 1), (0.75, "step_done", 1, 1)]
    busy, steps = sew.busy_seconds(ev, 0)
    assert steps == 3 and busy == pytest.approx(0.5 + 0.5 + 0.25)
    assert sew.busy_seconds(ev, 1) == (pytest.approx(0.25), 1)
    assert sew.busy_seconds(ev, 2) == (0.0, 0)


def test_c_term_overrides_keep_t0_and_charge_c_per_request(sew):
    from eldr.sim import SimConfig, StepFit
    from eldr.sim.steptime import StepModel

    t = _tiny_moe_trace(8)
    fit = StepFit(t0_s=0.02, b_s=4e-4, c_s=2e-4, r2=0.9, n=10, residual_s=0.0)
    over = sew.c_term_overrides(fit, t, 48)
    sm = StepModel(SimConfig(model="tiny-moe", hardware="cpu", **over))
    ctx = float(np.mean(t.prompt_lens)) + 24.0
    # a batch of 3 at the mean context, Σ_l D_l = 30: t0 + b·30 + c·3
    assert sm.decode_step_time(30, 3 * ctx) == pytest.approx(0.02 + 4e-4 * 30 + 2e-4 * 3)
    big = StepFit(t0_s=0.02, b_s=4e-4, c_s=2e-3, r2=0.9, n=10, residual_s=0.0)
    with pytest.raises(ValueError, match="cannot stand in"):  # dense read would pass t0
        sew.c_term_overrides(big, t, 48)


def _wave_records(bench, values: dict[tuple[int, str], float]) -> list[dict]:
    out = []
    for (k, p), v in values.items():
        per = {n: {"requests": 2, "domains": ["x", "y"] if p == "jsq" else ["x", "x"],
                   "itl_n": 10.0, "itl_s": v, "steps": 5, "step_s": v, "batch": 2.0,
                   "distinct": 10 * v, "distinct_sum": 60 * v} for n in ("d0", "d1")}
        out.append({"round": k, "policy": p, "per": per, "summary": bench.wave_summary(per)})
    return out


def test_gap_intervals_and_split_table(sew, bench):
    eng = _wave_records(bench, {(k, p): v for k in range(4)
                                for p, v in (("jsq", 1.0), ("eldr", 0.9 + 0.01 * k))})
    sim = _wave_records(bench, {(k, p): v for k in range(4)
                                for p, v in (("jsq", 2.0), ("eldr", 1.9))})
    gaps = sew.gap_intervals(sim, eng, "eldr", "jsq")
    # engine: −10, −9, −8, −7 %; simulator −5 % each round: gaps +5, +4, +3, +2 pp
    assert gaps["itl_ms"]["mean_pp"] == pytest.approx(3.5)
    assert gaps["step_ms"]["n"] == 4 and gaps["step_ms"]["half_pp"] > 0
    rows = sew.split_table(sim, eng)
    assert len(rows) == 8 and rows[0]["engine_split"] == rows[0]["sim_split"] == [2, 2]
    lines = sew.split_lines(rows)
    assert lines[-2].endswith("jsq 1.00, eldr 1.00")
    cmp_ = sew.compare(bench, "x", sim, eng, ["jsq", "eldr"])
    assert cmp_["sim"]["policies"]["eldr"]["itl_ms_vs_base"]["mean_pct"] == pytest.approx(-5)
    assert any("+3.5" in line for line in cmp_["table"])
    assert cmp_["steps"]["engine"]["jsq"] == {"steps": 10.0}  # 2 decoders × 5 steps
    assert cmp_["steps"]["sim"]["eldr"]["vs_base"]["mean_pct"] == 0.0
    eng[1]["per"]["d0"]["steps"] = 15  # round 0's eldr wave ramps: 20 steps, +100 %
    assert sew.wave_steps(bench, eng, ["jsq", "eldr"])["eldr"]["steps"] == pytest.approx(
        (20 + 3 * 10) / 4)


def test_a_wave_in_the_simulator_becomes_a_bench_record(sew, bench):
    from eldr.sim import SimConfig

    t, _ = sew.fixed_length(_tiny_moe_trace(8), 6)
    cfg = SimConfig(model="tiny-moe", hardware="cpu", num_prefill=1, num_decode=2,
                    max_batch=16, warmup_s=0.0, duration_s=1e6)
    policy = sew.make_router("jsq", None, 2)
    res = sew.simulate_wave(t, cfg, policy, list(range(8)), {})
    rec = sew.wave_record(res, ["a"] * 4 + ["b"] * 4, 0, "jsq", bench)
    per = rec["per"]
    assert sum(f["requests"] for f in per.values()) == 8
    assert sorted(rec["summary"]["split"]) == [4, 4]  # jsq balances a simultaneous wave
    for f in per.values():
        # 6 tokens each; the first arrival's prefill runs alone (it starts before the
        # others queue), so its decoder starts a step or more ahead of the rest
        assert 6 <= f["steps"] <= 12
        assert f["batch"] * f["steps"] == pytest.approx(4 * 6)  # one row per token
        assert 4 <= f["distinct"] <= 16  # 4 requests × k 4 experts at most
        assert f["itl_s"] == pytest.approx(f["step_s"], rel=0.2)
    # the same policy instance serves the next wave (its loads released)
    res2 = sew.simulate_wave(t, cfg, policy, list(range(8)), {})
    assert sorted(np.bincount(res2.requests["decoder"], minlength=2)) == [4, 4]


def _steps_record(k, p, steps: dict[str, int], step_s: float = 0.1) -> dict:
    return {"round": k, "policy": p,
            "per": {n: {"steps": s, "step_s": step_s} for n, s in steps.items()}}


def test_engine_spreads_turn_extra_engine_steps_into_arrival_spread(sew):
    sim = [_steps_record(0, "jsq", {"a": 50, "b": 50}),
           _steps_record(0, "eldr", {"a": 50, "b": 50}),
           _steps_record(1, "jsq", {"a": 48, "b": 0}, step_s=0.2)]
    eng = [_steps_record(0, "jsq", {"a": 54, "b": 56}),
           _steps_record(0, "eldr", {"a": 40, "b": 50}),
           _steps_record(1, "jsq", {"a": 58, "b": 0})]
    got = sew.engine_spreads(sim, eng)
    assert got[(0, "jsq")] == pytest.approx(5 * 0.1)  # (110 − 100) / 2 decoders extra steps
    assert got[(0, "eldr")] == 0.0  # fewer engine steps: no negative spread
    assert got[(1, "jsq")] == pytest.approx(10 * 0.2)  # one busy decoder
    even = sew.even_spreads(got)
    assert even[(0, "jsq")] == even[(0, "eldr")] == pytest.approx(0.25)
    assert even[(1, "jsq")] == pytest.approx(2.0)


def test_a_spread_wave_ramps_up_over_more_steps(sew):
    from eldr.sim import SimConfig

    t, _ = sew.fixed_length(_tiny_moe_trace(8), 6)
    cfg = SimConfig(model="tiny-moe", hardware="cpu", num_prefill=1, num_decode=2,
                    max_batch=16, warmup_s=0.0, duration_s=1e6)
    steps = []
    for spread in (0.0, 0.2):
        res = sew.simulate_wave(t, cfg, sew.make_router("jsq", None, 2), list(range(8)), {},
                                spread)
        assert res.requests["t_arrival"].max() == pytest.approx(spread)
        steps.append(int(res.decoder_steps.sum()))
    assert steps[1] > steps[0]  # staggered arrivals: more steps of smaller batches
