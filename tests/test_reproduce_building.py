"""Building the set-ups of a reproduction: in worker processes or here, the same set-ups."""

from __future__ import annotations

import numpy as np

from conftest import make_trace
from eldr.reproduce import Plan
from eldr.reproduce.building import build_setups, setup_jobs
from eldr.reproduce.plan import DEFAULT, FULL, QUICK, plan_tasks

TINY = Plan(
    name="tiny", workloads=("task",), calib_requests=40, rates=(150.0,), warmup_s=0.05,
    duration_s=0.3, num_prefill=2, num_decode=4,
    policies=("round_robin", "jsq", "eldr", "eldr_cost", "oracle_signature"),
    tau_values=(0.1,), tau_rate=150.0, pool_sizes=(2, 4), pool_rates=(150.0,),
    selection_max_pairs=2_000, max_pairs=5_000, grid=False, main_seeds=1,
    tiny_rates=(100.0,), tiny_num_prefill=2, tiny_warmup_s=0.1, tiny_duration_s=0.5,
)


def test_two_workers_build_the_same_primed_setups_as_one_process():
    trace = make_trace(100, 48, 128, 8, seed=5, with_topk=False)
    serial = build_setups(TINY, trace=trace, log=lambda msg: None, jobs=1)
    parallel = build_setups(TINY, trace=trace, log=lambda msg: None, jobs=2)
    assert list(serial) == list(parallel) == ["task", "tiny_moe"]
    for key, a in serial.items():
        b = parallel[key]
        np.testing.assert_array_equal(a.signatures, b.signatures)
        np.testing.assert_array_equal(a.eval.decode_counts, b.eval.decode_counts)
        np.testing.assert_array_equal(a.encoder.layers_, b.encoder.layers_)
        assert a.encoder.rho_ == b.encoder.rho_
        # every centroid set and cluster profile the tasks use is fitted already
        needed = {t.num_decode for t in plan_tasks(TINY) if t.workload == key}
        assert {k for k, kind in a._centroids if kind == "balanced"} == needed
        assert a._centroids.keys() == b._centroids.keys()
        for k in a._centroids:
            np.testing.assert_array_equal(a._centroids[k], b._centroids[k])
            np.testing.assert_array_equal(a._labels[k], b._labels[k])
        assert a._decoder_profiles.keys() == b._decoder_profiles.keys()
        for k in a._decoder_profiles:
            np.testing.assert_array_equal(a._decoder_profiles[k], b._decoder_profiles[k])


def test_only_small_plans_build_setups_in_parallel(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert setup_jobs(QUICK) == 2
    assert setup_jobs(DEFAULT) == 2  # 4,000-request traces
    assert setup_jobs(FULL) == 1  # 12k-14k-request traces: one set-up's memory at a time
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert setup_jobs(QUICK) == 1


def test_a_worker_builds_the_token_slab_the_parent_maps(tmp_path):
    """With a folder, the process that fits a set-up writes its slab file (two at a time
    here) and the parent maps it read-only: the rows of an in-memory build, bit for bit."""
    trace = make_trace(100, 48, 128, 8, seed=5, with_topk=False)
    plain = build_setups(TINY, trace=trace, log=lambda msg: None, jobs=1)
    lines: list[str] = []
    shared = build_setups(TINY, trace=trace, log=lines.append, folder=str(tmp_path), jobs=2)
    for key, a in plain.items():
        b = shared[key]
        assert b.tokens.is_built
        slab = b.tokens.flat_rows()
        assert not slab.flags.writeable  # a read-only map of the file, not a copy
        np.testing.assert_array_equal(a.tokens.build_all(), b.tokens.build_all())
    assert sorted(p.name for p in tmp_path.glob("*-tokens.npy")) == [
        "setup-0-tokens.npy", "setup-1-tokens.npy"]
    assert all("token slab" in line and "set-up" in line for line in lines)
