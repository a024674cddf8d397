import asyncio

import aiohttp
import pytest

from _proxy_fakes import FakeEngine, run
from eldr.proxy.config import ServeConfig
from eldr.proxy.upstream import UpstreamPool, error_kind


def _pool(**kw) -> UpstreamPool:
    cfg = ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1", "http://d:2"),
                      policy="jsq", unhealthy_after=2, **kw)
    return UpstreamPool(cfg, ["a", "b"])


def test_connect_failure_takes_an_instance_out_at_once():
    pool = _pool()
    d = pool.decode[0]
    pool.record_failure(d, "connect", "refused")
    assert not d.healthy and not pool.tracker.healthy[0]
    assert d.last_error == "connect: refused"


def test_other_failures_count_up_to_the_threshold_and_success_resets():
    pool = _pool()
    recovered = []
    pool.on_recover = recovered.append
    p = pool.prefill[0]
    pool.record_failure(p, "timeout", "t")
    assert p.healthy
    pool.record_failure(p, "http_5xx", "500")
    assert not p.healthy and not pool.prefill_healthy[0]
    pool.record_success(p)
    assert p.healthy and pool.prefill_healthy[0] and p.failures == 0
    assert recovered == [p]


def test_begin_end_track_loads():
    pool = _pool()
    d, p = pool.decode[1], pool.prefill[0]
    pool.begin(d)
    pool.begin(d)
    pool.begin(p)
    assert pool.tracker.loads.tolist() == [0, 2] and d.in_flight == 2
    assert pool.prefill_loads.tolist() == [1]
    pool.end(d)
    pool.end(p)
    assert pool.tracker.loads.tolist() == [0, 1] and pool.prefill_loads.tolist() == [0]


def test_models_configured_or_learned():
    pool = _pool()
    pool.prefill[0].models = ("m1",)
    pool.decode[0].models = ("m1", "m2")
    assert pool.models() == ("m1", "m2")
    assert _pool(models=("x",)).models() == ("x",)


def test_error_kinds():
    assert error_kind(asyncio.TimeoutError()) == "timeout"
    assert error_kind(aiohttp.ServerDisconnectedError()) == "disconnect"
    assert error_kind(ValueError("x")) == "protocol"
    assert error_kind(RuntimeError("x")) == "other"


@pytest.mark.parametrize("healthy", [True, False])
def test_check_and_scrape_against_an_engine(healthy):
    async def go():
        eng = await FakeEngine("e").start()
        eng.healthy = healthy
        cfg = ServeConfig(prefill_urls=(eng.url,), decode_urls=(eng.url + "/",), policy="jsq",
                          unhealthy_after=1)
        pool = UpstreamPool(cfg, ["w"])
        async with aiohttp.ClientSession() as session:
            pool._session = session
            ok = await pool.check(pool.decode[0])
            await pool.scrape(pool.decode[0])
        await eng.close()
        return ok, pool

    ok, pool = run(go())
    assert ok is healthy and pool.decode[0].healthy is healthy
    assert pool.decode[0].models == (("tiny",) if healthy else ())
    assert pool.tracker.loads.tolist() == [7.0]  # running 5 + waiting 2
    assert pool.decode[0].engine_load == 7.0


def test_check_of_a_dead_instance():
    async def go():
        cfg = ServeConfig(prefill_urls=("http://127.0.0.1:9",), decode_urls=("http://127.0.0.1:9",),
                          policy="jsq", health_timeout=1.0)
        pool = UpstreamPool(cfg, ["w"])
        async with aiohttp.ClientSession() as session:
            pool._session = session
            return await pool.check(pool.prefill[0]), pool

    ok, pool = run(go())
    assert not ok and not pool.prefill[0].healthy
    assert pool.prefill[0].last_error.startswith("connect")


def test_an_odd_model_list_does_not_take_an_engine_out():
    from eldr.proxy.config import ServeConfig
    from eldr.proxy.upstream import Instance, UpstreamPool

    pool = UpstreamPool(ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",),
                                    policy="jsq"), ["d"])
    inst = Instance("decode", 0, "http://d:1", "d")
    for doc, models, length in [
            ({"data": [{"id": "m", "max_model_len": 512}, {"id": 3}, "x"]}, ("m",), 512),
            ({"data": "oops"}, (), None), ({"data": [{"id": "m", "max_model_len": True}]},
                                           ("m",), None)]:
        pool._learn_models(inst, doc)
        assert (inst.models, inst.max_model_len) == (models, length)
