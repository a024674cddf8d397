import asyncio
import concurrent.futures
import os

import numpy as np
import pytest

from _learn_data import K, mix, records
from eldr.fit import artifact as artifact_io
from eldr.learn.config import LearnConfig
from eldr.learn.controller import Learner, learned_artifact

IDS = ("d0", "d1")


class FakeRouter:
    """What the learner needs from a router: its artifact, and a reload that may refuse."""

    def __init__(self, refuse: bool = False) -> None:
        self.artifact: str | None = None
        self.refuse = refuse
        self.swaps: list[str] = []
        self.events: list[tuple[str, dict]] = []

    async def swap(self, path: str) -> None:
        if self.refuse:
            raise ValueError("artifact_workers: refused by the router")
        artifact_io.load(path)  # what a reload does first
        self.swaps.append(path)
        self.artifact = path

    def learner(self, tmp_path, executor=None, **kw) -> Learner:
        settings = {"min_requests": 40, "drift_window": 30, "persist_interval": 3600.0, **kw}
        return Learner(LearnConfig(directory=str(tmp_path), **settings),
                       worker_ids=lambda: IDS, current_artifact=lambda: self.artifact,
                       swap=self.swap, on_event=lambda n, i: self.events.append((n, i)),
                       executor=executor)


def _feed(learner, recs, router=None):
    learner.buffer.top_k = K
    enc = None
    if router is not None and router.artifact is not None:
        enc = artifact_io.load(router.artifact).encoder
    for r in recs:
        sig = None if enc is None else enc.transform(r.prefill_counts).astype(np.float64)
        learner.observe(r, sig)


def test_first_fit_runs_in_another_process_and_the_loop_stays_free(tmp_path):
    router = FakeRouter()
    rng = np.random.default_rng(0)

    async def go():
        learner = router.learner(tmp_path)  # the default executor: a spawned process
        await learner.start()
        ticks = 0

        async def heartbeat():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beat = asyncio.ensure_future(heartbeat())
        _feed(learner, records(rng, mix(rng, 39, (1, 1, 0, 0))))
        assert learner.fit_task is None  # one short of min_requests
        _feed(learner, records(rng, mix(rng, 1, (1, 1, 0, 0))))
        assert learner.fit_task is not None
        ticks_at_start = ticks
        await learner.fit_task
        beat.cancel()
        await learner.stop()
        return ticks - ticks_at_start

    ticks = asyncio.run(go())
    accepted = [i for n, i in router.events if n == "fit_accepted"]
    assert len(accepted) == 1 and accepted[0]["pid"] != os.getpid()
    assert ticks >= 10  # the event loop kept running while the fit ran elsewhere
    assert router.swaps == [str(tmp_path / "artifacts" / "0001")]
    assert accepted[0]["candidate"]["score"] < 1.0
    assert learned_artifact(str(tmp_path)) == router.swaps[0]  # what a restart starts with


def test_a_refused_candidate_keeps_the_running_artifact(tmp_path):
    router = FakeRouter(refuse=True)
    rng = np.random.default_rng(1)

    async def go():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            learner = router.learner(tmp_path, executor=pool)
            await learner.start()
            _feed(learner, records(rng, mix(rng, 40, (1, 1, 0, 0))))
            await learner.fit_task
            await learner.stop()
            return learner

    learner = asyncio.run(go())
    assert router.artifact is None and router.swaps == []
    refused = [i for n, i in router.events if n == "fit_refused"]
    assert refused and refused[0]["reasons"][0].startswith("reload:")
    assert learner.state["refused"] == 1 and learner.state["accepted"] == 0
    assert not (tmp_path / "artifacts" / "0001").exists()  # the refused candidate is gone


def test_restart_reloads_the_buffer_and_the_counters(tmp_path):
    router = FakeRouter()
    rng = np.random.default_rng(2)
    recs = records(rng, mix(rng, 25, (1, 1, 1, 1)))

    async def first():
        learner = router.learner(tmp_path, executor=concurrent.futures.ThreadPoolExecutor(1))
        await learner.start()
        _feed(learner, recs)
        await learner.stop()  # writes DIR/buffer

    async def second():
        learner = router.learner(tmp_path, executor=concurrent.futures.ThreadPoolExecutor(1))
        await learner.start()
        await learner.stop()
        return learner

    asyncio.run(first())
    learner = asyncio.run(second())
    assert len(learner.buffer) == 25 and learner.buffer.num_seen == 25
    assert learner.buffer.top_k == K
    assert [r.time for r in learner.buffer.snapshot()] == [r.time for r in recs]


def test_drift_triggers_a_refit_on_the_new_traffic_and_a_swap(tmp_path, monkeypatch):
    learner, router, _ = _drift_run(tmp_path, monkeypatch, 0, "")
    names = [n for n, _ in router.events]
    assert "drift" in names
    drift = next(i for n, i in router.events if n == "drift")
    assert "shift" in drift["signals"]
    refit = [i for n, i in router.events if n == "fit_started"][-1]
    assert refit["reason"] == "drift"
    assert len(router.swaps) == 2 and learner.state["drifts"] == 1


def _drift_run(tmp_path, monkeypatch, refusals: int, reason: str):
    """Fit on two domains, then the mix moves to the other two; the first ``refusals``
    refits after the first fit are refused for ``reason``: the fit process runs them for
    real with a gain no candidate can reach (so it refuses, writes nothing and calibrates
    drift for the running artifact, as for any refusal), and the reason is then replaced.
    What the learner does next is what is tested. Returns (learner, router, records per
    fit)."""
    import dataclasses

    from eldr.learn import controller

    sizes, real = [], controller.run_fit_job

    def verdict(job):
        sizes.append(len(job.records))
        if 2 <= len(sizes) <= 1 + refusals:
            out = real(dataclasses.replace(job, min_gain=1.0))
            assert not out.accepted and out.reasons[0].startswith("no_gain:")
            return dataclasses.replace(out, reasons=[reason])
        return real(job)

    monkeypatch.setattr(controller, "run_fit_job", verdict)
    router = FakeRouter()
    rng = np.random.default_rng(3)

    async def go():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            learner = router.learner(tmp_path, executor=pool, min_requests=120,
                                     drift_window=40)
            await learner.start()
            _feed(learner, records(rng, mix(rng, 120, (1, 1, 0, 0))))
            await learner.fit_task
            for _ in range(24):  # the mix moves to the other two domains
                _feed(learner, records(rng, mix(rng, 20, (0, 0, 1, 1))), router)
                await asyncio.sleep(0.02)
                while learner._checks:
                    await asyncio.gather(*learner._checks)
                await learner.fit_task
            await learner.stop()
            return learner

    return asyncio.run(go()), router, sizes


WORSE = ("worse: worse than the running artifact (score 0.9000 > 0.8000, difference "
         "+0.1000 ± 0.0100 over 4 folds)")


@pytest.mark.parametrize("reason", [WORSE,
                                    "rho: held-out rho 0.100 below the running artifact's"])
def test_a_refused_drift_refit_keeps_the_running_artifact_until_drift_is_declared_anew(
        tmp_path, monkeypatch, reason):
    """Refused (as worse beyond the folds' noise, or for another reason): no further refit
    for that drift, no retry; the drift reference moves to the new traffic, and only a
    drift declared anew (later in the run) refits again."""
    steps = ("drift", "fit_started", "fit_refused", "fit_accepted")
    learner, router, sizes = _drift_run(tmp_path, monkeypatch, 1, reason)
    seq = [n for n, _ in router.events if n in steps]
    assert seq[:5] == ["fit_started", "fit_accepted", "drift", "fit_started",
                       "fit_refused"], seq
    assert seq[5:6] in ([], ["drift"]), seq  # the next refit only after a new drift
    refused = [i for n, i in router.events if n == "fit_refused"]
    assert refused[0]["reasons"] == [reason] and "retry_at" not in refused[0]
    assert sizes[1] >= 120  # the refit on drift saw the new traffic
    assert "drift_retry" not in learner.state


def test_a_given_artifact_gets_a_drift_reference_from_the_traffic(tmp_path):
    """Started with an artifact it did not learn and an empty DIR: no fit, but once
    min_requests are in, drift is calibrated for that artifact."""
    from eldr.learn.buffer import records_to_trace
    from eldr.learn.refit import fit_candidate

    router = FakeRouter()
    rng = np.random.default_rng(5)
    trace, known = records_to_trace(records(rng, mix(rng, 80, (1, 1, 0, 0))), model="s",
                                    top_k=K)
    router.artifact = str(artifact_io.save(fit_candidate(trace, known, worker_ids=IDS),
                                           tmp_path / "given"))

    async def go():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            learner = router.learner(tmp_path / "learn", executor=pool)
            await learner.start()
            _feed(learner, records(rng, mix(rng, 40, (1, 1, 0, 0))), router)
            await learner.fit_task
            await learner.stop()
            return learner

    learner = asyncio.run(go())
    assert learner.detector is not None and learner.detector.is_calibrated
    assert learner.state["fits"] == 0 and router.swaps == []
    assert [n for n, _ in router.events if n == "calibrated"]


def test_a_pool_change_during_a_fit_is_followed_by_a_refit_for_the_new_decoders(tmp_path):
    """The first fit runs for (d0, d1); a decoder joins meanwhile. Its candidate, for the
    old set, swaps in (the fake router takes any artifact), and a refit for the three
    decoders must follow at once, as a ``pool`` refit (not a drift one)."""
    router = FakeRouter()
    rng = np.random.default_rng(5)
    ids = list(IDS)

    async def go():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            learner = Learner(LearnConfig(directory=str(tmp_path), min_requests=40,
                                          drift_window=30, persist_interval=3600.0),
                              worker_ids=lambda: tuple(ids),
                              current_artifact=lambda: router.artifact, swap=router.swap,
                              on_event=lambda n, i: router.events.append((n, i)),
                              executor=pool)
            await learner.start()
            _feed(learner, records(rng, mix(rng, 40, (1, 1, 1, 0))))
            first = learner.fit_task
            await asyncio.sleep(0.01)  # the fit's job (decoders included) is built
            ids.append("d2")  # the router's decoders change while the fit runs
            learner.pool_changed()
            await first
            assert learner.fit_task is not first  # the refit started when the fit ended
            await learner.fit_task
            await learner.stop()
            return learner

    learner = asyncio.run(go())
    started = [i["reason"] for n, i in router.events if n == "fit_started"]
    assert started == ["first", "pool"], started
    assert [n for n, _ in router.events].count("pool_refit") == 1
    assert len(router.swaps) == 2 and learner.state["drift_point"] is None
    assert tuple(artifact_io.load(router.swaps[-1]).worker_ids) == ("d0", "d1", "d2")
