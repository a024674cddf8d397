"""eldr.proxy.request.choice: the decoder of an attempt among the healthy ones it has not
failed on (the choice through stand-in engines is in tests/test_proxy_flow.py)."""

import time

import pytest

from _proxy_fakes import cluster, run
from eldr.proxy.errors import ProxyError
from eldr.proxy.request.signatures import Reading

NONE = Reading(None, None, 0, "none", None)


def test_a_failed_decoder_is_avoided_unless_it_is_the_last_one():
    async def go():
        async with cluster(policy="round_robin") as (router, _client, _p, _d):
            choice, state, pool = router.flow.choice, router.live.state, router.pool
            avoid = [choice.decide(state, f"r{i}", NONE, None, None, [pool.decode[0]], None,
                                   time.perf_counter()).worker for i in range(4)]
            both = choice.decide(state, "r9", NONE, None, None, list(pool.decode), None,
                                 time.perf_counter()).worker
            return avoid, both, router.metrics.decisions.get(policy="round_robin",
                                                             decoder="w-other")

    avoid, both, counted = run(go())
    assert avoid == [1, 1, 1, 1]  # round robin, the failed decoder left out
    assert both in (0, 1)  # every decoder failed: retry on one rather than on none
    assert counted >= 4


def test_no_healthy_decoder_is_a_503():
    async def go():
        async with cluster(policy="jsq") as (router, _client, _p, _d):
            choice, state = router.flow.choice, router.live.state
            router.pool.tracker.healthy[:] = False  # until the next health check
            with pytest.raises(ProxyError) as err:
                choice.decide(state, "r", NONE, None, None, [], None, time.perf_counter())
            return err.value

    err = run(go())
    assert err.status == 503 and err.code == "no_decoder"


def test_the_request_keeps_its_snapshot_until_the_decoder_set_changes():
    import dataclasses

    async def go():
        async with cluster(policy="jsq") as (router, _client, _p, _d):
            choice, state = router.flow.choice, router.live.state
            same = choice.current(state)
            renamed = dataclasses.replace(state, worker_names=("w-code", "w-gone"))
            return same is state, choice.current(renamed) is router.live.state

    kept, moved = run(go())
    assert kept and moved
