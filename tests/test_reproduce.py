"""`eldr reproduce` on a tiny plan (seconds), and the `eldr simulate` command."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace

import numpy as np
import pytest

from conftest import make_trace
from eldr.cli import main
from eldr.reproduce import Analysis, Plan, headline_text, run_plan, write_report
from eldr.reproduce.plan import plan_tasks
from eldr.reproduce.sweeps import make_job
from eldr.traces.trace import save

L, E, K_TOP = 48, 128, 8

TINY = Plan(
    name="tiny", workloads=("task",), calib_requests=40, rates=(150.0,), warmup_s=0.05,
    duration_s=0.3, num_prefill=2, num_decode=4,
    policies=("round_robin", "jsq", "p2c", "domain", "eldr", "oracle_signature"),
    tau_values=(0.0, 0.1, 1.0), tau_rate=150.0, pool_sizes=(2, 4), pool_rates=(150.0,),
    selection_max_pairs=2_000, max_pairs=5_000,
    grid_workloads=("task",), grid_pools=(4,), grid_rates=(150.0,), grid_warmup_s=0.05,
    grid_duration_s=0.4, grid_min_requests=10, grid_max_seeds=3, main_seeds=2,
    tiny_rates=(100.0,), tiny_num_prefill=2, tiny_warmup_s=0.1, tiny_duration_s=0.5,
    real_models=False,  # tests/test_reproduce_real_models.py
)


def test_plan_tasks_cover_every_experiment_once():
    tasks = plan_tasks(TINY)
    keys = [(t.workload, t.qps, t.num_decode, t.variant, t.warmup_s, t.duration_s,
             t.replicate) for t in tasks]
    assert len(keys) == len(set(keys))  # no duplicated simulation
    assert {t.experiment for t in tasks} == {"main", "tau", "pool", "vanilla", "grid", "tiny"}
    main_ = [t for t in tasks if t.experiment == "main"]
    assert len(main_) == 2 * len(TINY.policies)  # main_seeds = 2
    assert {t.replicate for t in main_} == {0, 1}
    assert all(t.replicate == 0 for t in tasks if t.experiment not in ("main", "grid"))
    grid = [t for t in tasks if t.experiment == "grid"]
    assert {t.policy for t in grid} == {"round_robin", "jsq", "p2c", "eldr", "eldr_cost"}
    assert {t.replicate for t in grid} == {0, 1, 2}  # grid_min_seeds
    assert all(t.duration_s == 0.4 for t in grid)  # 10 requests at 150 req/s: the window
    tiny = [t for t in tasks if t.experiment == "tiny"]
    assert all(t.model == "tiny-moe" and t.hardware == "cpu" for t in tiny)


def test_tiny_reproduce_writes_a_report(tmp_path):
    trace = make_trace(100, L, E, K_TOP, seed=5, with_topk=False)
    res = run_plan(TINY, trace=trace, jobs=1, log=lambda msg: None, progress=False)
    assert len(res.rows) == len(plan_tasks(TINY))
    for row in res.rows:
        assert row["requests_measured"] > 0 and np.isfinite(row["tpot_median_ms"])
    path = write_report(res, tmp_path)
    text = path.read_text()
    assert "## Headline" in text and "τ sweep" in text and "Decode-pool size" in text
    assert "Never worse than load balancing" in text and "tiny-MoE trace" in text
    assert (tmp_path / "grid.png").stat().st_size > 1000
    for png in ("main_task.png", "tau.png", "pool.png", "vanilla.png", "decoders.png"):
        assert (tmp_path / png).stat().st_size > 1000
    head = Analysis(res).headline()
    assert len(head) == 1 and head[0]["best_lb"] in ("round_robin", "jsq", "p2c")
    assert head[0]["seeds"] == 2 and np.isfinite(head[0]["d_p50_h"])
    assert "task" in headline_text(Analysis(res)) and "±" in headline_text(Analysis(res))
    assert f"{head[0]['d_p50']:+.1f}±{head[0]['d_p50_h']:.1f}%" in text  # headline ±
    assert "| `eldr` | any balancer |" in text and "expected false" in text  # the grid
    assert {r["replicate"] for r in res.rows if r["experiment"] == "grid"} == {0, 1, 2}
    assert json.loads((tmp_path / "results.json").read_text())["headline"]


def test_grid_cells_get_seeds_until_the_target_or_the_maximum():
    trace = make_trace(100, L, E, K_TOP, seed=5, with_topk=False)
    plan = replace(TINY, tau_values=(0.1,), pool_sizes=(4,), vanilla=False, tiny=False,
                   main_seeds=1, grid_min_seeds=2, grid_max_seeds=4)

    def grid_seeds(p):
        res = run_plan(p, trace=trace, jobs=1, log=lambda msg: None, progress=False)
        rows = [r for r in res.rows if r["experiment"] == "grid"]
        return rows, sorted({(r["replicate"], r["seed"]) for r in rows})

    wide, seeds = grid_seeds(replace(plan, target_half_width=1e-9))  # never reached
    assert seeds == [(0, 0), (1, 1), (2, 2), (3, 3)]  # added up to the maximum
    assert grid_seeds(replace(plan, target_half_width=1e9))[1] == [(0, 0), (1, 1)]
    again, _ = grid_seeds(replace(plan, target_half_width=1e-9))
    volatile = ("wall_s", "sim_requests_per_wall_s")
    assert [{k: v for k, v in r.items() if k not in volatile} for r in wide] == \
        [{k: v for k, v in r.items() if k not in volatile} for r in again]  # deterministic
    jsq = [r["tpot_median_ms"] for r in wide if r["policy"] == "jsq"]
    assert len(set(jsq)) == len(jsq)  # each seed its own arrivals


def test_a_replayed_trace_starts_elsewhere_on_another_seed():
    from eldr.reproduce.sweeps import replayed_arrivals

    class Replay:  # the two fields and the method of a RoutingSetup that replay reads
        arrival_times = np.cumsum(np.random.default_rng(0).exponential(0.2, 50)) - 0.1
        arrival_rate = 5.0

        def arrivals(self, qps, horizon_s):
            from eldr.reproduce.setup import RoutingSetup

            return RoutingSetup.arrivals(self, qps, horizon_s)

    st = Replay()
    _, i0 = replayed_arrivals(st, 10.0, 2.0, 0, 0)
    np.testing.assert_array_equal(i0, np.arange(i0.size))  # seed 0: from the start
    t1, i1 = replayed_arrivals(st, 10.0, 2.0, 1, 1)
    t1b, i1b = replayed_arrivals(st, 10.0, 2.0, 1, 1)
    np.testing.assert_array_equal(i1, i1b)  # deterministic
    np.testing.assert_array_equal(t1, t1b)
    assert i1[0] != 0 and t1[0] == 0.0 and np.all(np.diff(t1) > 0) and t1[-1] < 2.0
    assert len(set(i1.tolist())) == i1.size  # each request at most once
    scaled = st.arrival_times * 0.5  # the file's gaps at 10 req/s, kept around the start
    k = int(i1[0])
    n = min(i1.size, 50 - k)
    np.testing.assert_allclose(np.diff(t1[:n]), np.diff(scaled[k:k + n]))


def test_two_worker_processes_give_the_rows_of_one():
    trace = make_trace(100, L, E, K_TOP, seed=5, with_topk=False)
    plan = replace(TINY, tau_values=(0.1,), pool_sizes=(4,), vanilla=False, grid=False,
                   tiny=False)
    rows = [run_plan(plan, trace=trace, jobs=jobs, log=lambda msg: None, progress=False).rows
            for jobs in (1, 2)]
    volatile = ("wall_s", "sim_requests_per_wall_s")
    assert [{k: v for k, v in r.items() if k not in volatile} for r in rows[0]] == \
        [{k: v for k, v in r.items() if k not in volatile} for r in rows[1]]


def test_each_call_of_the_local_runner_has_a_parallel_of_its_own(monkeypatch):
    """One joblib Parallel reused for every round of grid seeds made loky's resource
    tracker print KeyError tracebacks (eldr.reproduce.sweeps.local_runner says why): every
    call builds its own, with the same arguments, and yields each output at its task's
    position, the longest task run first."""
    from eldr.reproduce import sweeps
    from eldr.reproduce.plan import Task

    made = []

    class Recording:  # joblib.Parallel's call protocol, run in this process
        def __init__(self, **kwargs):
            self.kwargs, self.calls = kwargs, 0
            made.append(self)

        def __call__(self, jobs):
            self.calls += 1
            return [f(*args, **kw) for f, args, kw in jobs]

    monkeypatch.setattr(sweeps, "Parallel", Recording)
    monkeypatch.setattr(sweeps, "make_job", lambda plan, setup, task: task)
    monkeypatch.setattr(sweeps, "run_job", lambda task: task.qps)
    runner = sweeps.local_runner(n_jobs=2, temp_folder="tmp", max_nbytes="1M")
    tasks = [Task("grid", "task", "jsq", q, 4, 0.1) for q in (10.0, 80.0, 40.0)]
    first, again = list(runner(TINY, None, tasks)), list(runner(TINY, None, tasks))
    assert first == again == [(1, 80.0), (2, 40.0), (0, 10.0)]  # (position, output)
    assert len(made) == 2 and [p.calls for p in made] == [1, 1]
    assert made[0].kwargs == made[1].kwargs == {"return_as": "generator", "n_jobs": 2,
                                                "temp_folder": "tmp", "max_nbytes": "1M"}


def test_a_job_carries_what_its_task_needs_and_not_the_setup():
    from eldr.reproduce.setup import fit_setup

    trace = make_trace(100, L, E, K_TOP, seed=5, with_topk=False)
    st = fit_setup(trace, "task", calib_requests=40, selection_max_pairs=2_000,
                   max_pairs=5_000)
    for task in plan_tasks(TINY):
        job = make_job(TINY, st, task)
        assert job.tokens.trace is st.eval and "encoder" not in job.inputs
        assert job.needs_patterns == (task.policy == "oracle_signature")
        blob = pickle.dumps(job)
        assert len(blob) < 2 * sum(a.nbytes for a in vars(st.eval).values()
                                   if isinstance(a, np.ndarray)) + 200_000
        assert b"calib" not in blob  # the calibration split stays in the parent


def test_simulate_command_json(tmp_path, capsys):
    path = save(make_trace(60, L, E, K_TOP, seed=6, with_topk=False), tmp_path / "t.npz")
    rc = main(["simulate", "--trace", str(path), "--calib", "20", "--prefill", "2",
               "--decode", "3", "--qps", "100,200", "--policies", "jsq,round_robin",
               "--duration", "0.2", "--warmup", "0.05", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["qps"]) for r in rows] == [
        ("jsq", 100.0), ("round_robin", 100.0), ("jsq", 200.0), ("round_robin", 200.0)]
    assert all(r["num_decode"] == 3 for r in rows)


def test_simulate_command_rejects_unknown_policy(tmp_path, capsys):
    path = save(make_trace(20, L, E, K_TOP, seed=6, with_topk=False), tmp_path / "t.npz")
    assert main(["simulate", "--trace", str(path), "--policies", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


MOONCAKE_LINES = "\n".join(
    json.dumps({"timestamp": t, "input_length": p, "output_length": o, "hash_ids": ids})
    for t, p, o, ids in [
        (0, 1100, 5, [0, 1, 2]), (250, 600, 3, [0, 1]), (250, 1024, 4, [0, 7]),
        (1000, 20, 2, [9]), (1400, 700, 6, [0, 1]), (2000, 40, 3, [11])])


def _poisson_row_keys(tmp_path, capsys):
    path = save(make_trace(60, L, E, K_TOP, seed=6, with_topk=False), tmp_path / "t.npz")
    assert main(["simulate", "--trace", str(path), "--calib", "20", "--prefill", "2",
                 "--decode", "3", "--qps", "100", "--policies", "jsq", "--duration", "0.2",
                 "--warmup", "0.05", "--json"]) == 0
    return set(json.loads(capsys.readouterr().out)[0])


def test_simulate_arrivals_file_told_by_content_replays_every_arrival(tmp_path, capsys):
    keys = _poisson_row_keys(tmp_path, capsys)
    path = tmp_path / "kimi.dat"  # no telling extension: the content says Mooncake
    path.write_text(MOONCAKE_LINES + "\n")
    rc = main(["simulate", "--arrivals", str(path), "--rate", "2.5,5", "--calib", "20",
               "--prefill", "2", "--decode", "3", "--policies", "jsq,eldr",
               "--warmup", "0", "--duration", "60", "--prefix-caching", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert set(rows[0]) == keys  # --json rows keep the Poisson rows' fields
    assert [(r["policy"], r["qps"]) for r in rows] == [
        ("jsq", 2.5), ("eldr", 2.5), ("jsq", 5.0), ("eldr", 5.0)]
    assert all(r["workload"] == "kimi" for r in rows)
    assert all(r["requests"] == 6 for r in rows)  # every arrival of the file, once


def test_simulate_shipped_arrivals_shorthand(capsys):
    rc = main(["simulate", "--arrivals", "azure_conv", "--rate", "40", "--calib", "30",
               "--prefill", "2", "--decode", "4", "--policies", "jsq", "--warmup", "0.5",
               "--duration", "2", "--json"])
    assert rc == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["workload"] == "azure_conv" and row["qps"] == 40.0 and row["requests"] > 20


def test_simulate_arrivals_option_conflicts_are_refused(tmp_path, capsys):
    assert main(["simulate", "--rate", "5", "--policies", "jsq"]) == 2
    assert "give --arrivals too" in capsys.readouterr().err
    assert main(["simulate", "--arrivals", "azure_conv", "--qps", "5"]) == 2
    assert "use --rate instead of --qps" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    assert main(["simulate", "--arrivals", str(bad)]) == 2
    assert "line 1, field 'output_length': missing" in capsys.readouterr().err


def test_simulate_the_real_tiny_moe_trace_through_its_preset(capsys):
    from eldr.capture import tiny_moe_trace_path

    rc = main(["simulate", "--trace", str(tiny_moe_trace_path()), "--calib", "100",
               "--prefill", "2", "--decode", "4", "--qps", "50", "--policies", "jsq,eldr",
               "--warmup", "0.5", "--duration", "3", "--json"])
    assert rc == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert "tiny_moe: 314 requests, L=6 E=64 k=4" in out.err
    assert all(r["requests"] > 100 and r["tpot_median_ms"] > 0 for r in rows)


def test_trace_arrays_move_to_files_unchanged(tmp_path):
    from eldr.reproduce.memmaps import map_to_files

    trace = make_trace(20, L, E, K_TOP, seed=5, with_topk=False)
    before = {k: v.copy() for k, v in vars(trace).items() if isinstance(v, np.ndarray)}
    map_to_files(trace, str(tmp_path / "eval"), min_bytes=0)
    for name, arr in before.items():
        now = getattr(trace, name)
        assert isinstance(now.base, np.memmap) and not now.flags.writeable
        np.testing.assert_array_equal(now, arr)


@pytest.mark.parametrize("representation", ["count_idf", "binary", "gate_prob"])
def test_signatures_in_chunks_are_the_whole_transform(representation):
    from eldr.fit.signature import SignatureEncoder
    from eldr.reproduce.setup import _signatures

    trace = make_trace(150, L, E, K_TOP, seed=5, with_topk=False)
    enc = SignatureEncoder(representation=representation, layers=[0, 5, 9]).fit(trace)
    np.testing.assert_array_equal(_signatures(enc, trace, chunk=64), enc.transform(trace))
