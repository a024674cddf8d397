"""`eldr reproduce --cluster`: a plan's simulations on a Dask distributed cluster
(eldr.reproduce.dask_cluster, docs/cluster.md).

The cluster tests start a ``distributed.LocalCluster`` of 2 worker processes with 1
thread each and their own scratch folder, and require the rows of a local run in every
column but the wall-time ones. They skip, saying so, only when ``distributed`` (the
``cluster`` extra, which ``scripts/setup.sh --all`` installs) is absent.
"""

from __future__ import annotations

import pickle
import shutil
import socket
import sys
from dataclasses import replace

import pytest

from conftest import make_trace
from eldr.cli import main
from eldr.reproduce import run_plan
from eldr.reproduce.building import build_setups
from eldr.reproduce.dask_cluster import (
    MISSING,
    check_workers,
    code_fingerprint,
    run_shipped,
    shipped_setup,
)
from eldr.reproduce.memmaps import map_to_files
from eldr.reproduce.plan import plan_tasks
from eldr.reproduce.sweeps import prime_setups, run_task, run_tasks
from test_reproduce import TINY

L, E, K_TOP = 48, 128, 8
VOLATILE = ("wall_s", "sim_requests_per_wall_s")  # wall-time columns: differ run to run
# TINY (test_reproduce): every experiment, the shipped tiny-MoE trace too, 2 set-ups, 42
# simulations. ROUNDS: the main experiment and a grid cell that gets one more seed (a
# second round), 21 simulations.
ROUNDS = replace(TINY, tau_values=(0.1,), pool_sizes=(4,), vanilla=False, tiny=False,
                 main_seeds=1, grid_min_seeds=2, grid_max_seeds=3, target_half_width=1e-9)

try:
    import distributed
except ImportError:
    distributed = None
needs_dask = pytest.mark.skipif(
    distributed is None, reason="dask[distributed] is not installed (the cluster extra; "
    "bash scripts/setup.sh --all installs it): the Dask cluster tests do not run")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


@pytest.fixture(scope="module")
def trace():
    return make_trace(100, L, E, K_TOP, seed=5, with_topk=False)


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """A LocalCluster of 2 worker processes, 1 thread each, scratch space in a folder of
    their own; closed (workers and scheduler stopped) after the module's tests."""
    from distributed import LocalCluster

    scratch = tmp_path_factory.mktemp("dask-workers")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      local_directory=str(scratch), dashboard_address=None,
                      scheduler_port=0, silence_logs=40) as cluster:
        yield cluster


def test_a_shipped_setup_runs_every_task_as_the_local_one(trace, tmp_path):
    """Without its calibration split, pickled and back: the same rows (no Dask needed)."""
    plan = ROUNDS
    setups = build_setups(plan, trace=trace, log=lambda msg: None)
    tasks = plan_tasks(plan)
    prime_setups(setups, tasks)
    shipped = {k: pickle.loads(pickle.dumps(shipped_setup(st))) for k, st in setups.items()}
    assert all(st.calib is None and st.calibration.trace is None for st in shipped.values())
    assert all(st.calib is not None for st in setups.values())  # the original is kept
    here = [run_task(plan, setups, t) for t in tasks]
    there = [run_shipped(plan, shipped[t.workload], t) for t in tasks]
    assert _stable([r for r, _ in here]) == _stable([r for r, _ in there])
    assert [d for _, d in here] == [d for _, d in there] and any(d for _, d in here)


@needs_dask
def test_workers_without_the_client_folder_give_the_local_rows(trace, tmp_path,
                                                               local_cluster):
    """Set-ups built into memory-mapped files of a folder that is then deleted: the
    workers (2 processes, their own scratch folders) get the bytes, not the file names,
    and return the rows of this process, whatever order they finish in."""
    from distributed import get_task_stream

    from eldr.reproduce.dask_cluster import connect

    folder = tmp_path / "client-setups"
    folder.mkdir()
    setups = build_setups(TINY, trace=trace, log=lambda msg: None, folder=str(folder))
    tasks = plan_tasks(TINY)
    prime_setups(setups, tasks)
    for n, st in enumerate(setups.values()):
        map_to_files(st.calib, str(folder / f"setup-{n}-calib"))
    assert any(folder.iterdir())
    shutil.rmtree(folder)  # the set-ups' arrays now live only in this process's maps
    assert not folder.exists()

    local = [run_task(TINY, setups, t) for t in tasks]
    with connect(local_cluster.scheduler_address) as cluster:
        assert cluster.num_threads == 2 and "2 worker(s)" in str(cluster)
        with get_task_stream(cluster.client) as stream:
            remote = run_tasks(TINY, setups, tasks, cluster.run)
        workers = {t["worker"] for t in stream.data if "run_shipped" in t["key"]}
    assert len(workers) == 2  # both worker processes ran simulations
    assert len(remote) == len(tasks) == len(local)
    assert _stable([r for r, _ in remote]) == _stable([r for r, _ in local])
    assert [d for _, d in remote] == [d for _, d in local] and any(d for _, d in local)


@needs_dask
def test_run_plan_on_a_cluster_gives_the_rows_of_a_local_run(trace, local_cluster):
    """The whole of run_plan, a round of added grid seeds included."""
    from eldr.reproduce.dask_cluster import connect

    logged: list[str] = []
    local = run_plan(ROUNDS, trace=trace, jobs=1, log=lambda msg: None, progress=False)
    with connect(local_cluster.scheduler_address) as cluster:
        remote = run_plan(ROUNDS, trace=trace, log=logged.append, progress=False,
                          cluster=cluster)
    assert any("on the Dask cluster at tcp://" in m for m in logged)
    assert any(r["replicate"] == 2 and r["experiment"] == "grid" for r in local.rows)
    assert len(remote.rows) == len(local.rows) > len(plan_tasks(ROUNDS))  # a round ran
    assert _stable(remote.rows) == _stable(local.rows)
    assert remote.decoder_rows == local.decoder_rows
    assert remote.seconds["jobs"] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_dask
@pytest.mark.parametrize("address", ["unused port", "tcp://127.0.0.1", "not an address"])
def test_an_unreachable_scheduler_is_one_line_and_exit_2(address, capsys):
    import dask

    if address == "unused port":
        address = f"tcp://127.0.0.1:{_free_port()}"  # nothing listens there
        said = f"cannot reach a Dask scheduler at '{address}': Timed out"
    else:
        said = f"'{address}' is no Dask scheduler address (missing port number"
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        rc = main(["reproduce", "--quick", "--cluster", address])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 2  # the plan's line, then the error
    assert err[-1].startswith(f"eldr reproduce: error: {said}")


def test_without_the_extra_cluster_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed fails
    rc = main(["reproduce", "--quick", "--cluster", "tcp://127.0.0.1:8786"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"eldr reproduce: error: {MISSING}"


def test_jobs_and_cluster_together_are_refused(capsys):
    rc = main(["reproduce", "--quick", "--jobs", "2", "--cluster", "tcp://127.0.0.1:8786"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == ("eldr reproduce: error: --jobs sets local worker processes: "
                               "not with --cluster, whose workers have their own threads")


class _Client:
    """What check_workers reads of a distributed.Client: run() on every worker."""

    def __init__(self, answers: dict) -> None:
        self.answers = answers

    def run(self, function, on_error):
        assert on_error == "return" and callable(function)
        return self.answers


def test_a_worker_with_other_code_or_no_eldr_is_named():
    mine = code_fingerprint()
    check_workers(_Client({"tcp://a:1": mine, "tcp://b:1": mine}))  # all the same: fine
    with pytest.raises(ValueError, match=r"^Dask worker tcp://b:1 has 0\.0\.9 \(code x\), "
                       r"this client eldr .*install the same eldr on every worker"):
        check_workers(_Client({"tcp://a:1": mine, "tcp://b:1": "0.0.9 (code x)"}))
    with pytest.raises(ValueError, match=r"^Dask worker tcp://a:1 cannot run it "
                       r"\(No module named 'eldr'\)"):
        check_workers(_Client({"tcp://a:1": ModuleNotFoundError("No module named 'eldr'")}))


def test_the_fingerprint_probe_runs_without_the_module_loaded():
    """The probe travels by value (a nested function) and answers the fingerprint."""
    from eldr.reproduce.dask_cluster import _fingerprint_probe

    probe = _fingerprint_probe()
    assert "<locals>" in probe.__qualname__ and probe() == code_fingerprint()
    version, code = code_fingerprint().split(" (code ")
    assert version == __import__("eldr").__version__ and len(code) == 13  # 12 hex + ")"
