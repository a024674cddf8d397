import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest

from _proxy_fakes import FakeEngine, run
from eldr.proxy.config import ServeConfig
from eldr.proxy.engines.upstream import UpstreamPool, error_kind


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
            pool.session = session
            ok = await pool.check(pool.decode[0])
            await pool.scrape(pool.decode[0])
        await eng.close()
        return ok, pool

    ok, pool = run(go())
    assert ok is healthy and pool.decode[0].healthy is healthy
    assert pool.decode[0].models == (("tiny",) if healthy else ())
    assert pool.tracker.loads.tolist() == [7.0]  # running 5 + waiting 2
    assert pool.decode[0].engine_load == 7.0


def test_requests_that_end_while_the_scrape_travels_leave_the_load():
    """The engine counts 7 (running 5 + waiting 2) when the scrape is asked, with the
    router's 7 in flight; 5 of them end before its answer arrives. The load is the 2 left,
    and 0 when they end: read against the in-flight count at arrival, 5 stale requests
    stayed on an idle decoder until the next scrape."""

    class SlowEngine(FakeEngine):
        on_scrape = None  # called while the answer is on its way

        async def _metrics(self, request):
            self.on_scrape()
            return await super()._metrics(request)

    async def go():
        eng = await SlowEngine("e").start()
        cfg = ServeConfig(prefill_urls=(eng.url,), decode_urls=(eng.url,), policy="jsq")
        pool = UpstreamPool(cfg, ["w"])
        eng.on_scrape = lambda: [pool.end(pool.decode[0]) for _ in range(5)]
        async with aiohttp.ClientSession() as session:
            pool.session = session
            for _ in range(7):
                pool.begin(pool.decode[0])
            await pool.scrape(pool.decode[0])
        await eng.close()
        return pool

    pool = run(go())
    assert pool.decode[0].engine_load == 7.0
    assert pool.tracker.loads.tolist() == [2.0]
    pool.end(pool.decode[0])
    pool.end(pool.decode[0])
    assert pool.tracker.loads.tolist() == [0.0]


def test_check_of_a_dead_instance():
    async def go():
        cfg = ServeConfig(prefill_urls=("http://127.0.0.1:9",), decode_urls=("http://127.0.0.1:9",),
                          policy="jsq", health_timeout=1.0)
        pool = UpstreamPool(cfg, ["w"])
        async with aiohttp.ClientSession() as session:
            pool.session = session
            return await pool.check(pool.prefill[0]), pool

    ok, pool = run(go())
    assert not ok and not pool.prefill[0].healthy
    assert pool.prefill[0].last_error.startswith("connect")


def test_an_odd_model_list_does_not_take_an_engine_out():
    from eldr.proxy.config import ServeConfig
    from eldr.proxy.engines.upstream import Instance, UpstreamPool

    pool = UpstreamPool(ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",),
                                    policy="jsq"), ["d"])
    inst = Instance("decode", 0, "http://d:1", "d")
    for doc, models, length in [
            ({"data": [{"id": "m", "max_model_len": 512}, {"id": 3}, "x"]}, ("m",), 512),
            ({"data": "oops"}, (), None), ({"data": [{"id": "m", "max_model_len": True}]},
                                           ("m",), None)]:
        pool._learn_models(inst, doc)
        assert (inst.models, inst.max_model_len) == (models, length)


# -- the engines' own footprints, read by the scrape (--engine-footprint) -----------------
def _footprint_doc(freq_counts, steps, **extra):
    from eldr.capture.digits import encode_digits

    data = encode_digits(np.asarray(freq_counts).ravel(), 1)
    return {"v": 1, "shape": [1, 4], "window": 32, "steps": steps, "time": 0.0, "w": 1,
            "data": data, "age": 0.05, **extra}


class _FootprintEngine:
    """/metrics and /eldr/footprint of one decode engine; ``reply`` sets the latter."""

    def __init__(self) -> None:
        self.reply = (200, json.dumps(_footprint_doc([4, 2, 0, 0], 4)))
        self.footprint_calls = 0

    async def start(self):
        from aiohttp import web
        from aiohttp.test_utils import TestServer

        async def metrics(request):
            return web.Response(text="vllm:num_requests_running 3\n"
                                     "vllm:num_requests_waiting 0\n")

        async def footprint(request):
            self.footprint_calls += 1
            status, body = self.reply
            return web.Response(status=status, text=body, content_type="application/json")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/eldr/footprint", footprint)
        self.server = TestServer(app, port=0)
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")
        return self


def _scrape_with(replies, *, policy, **cfg):
    """Scrape the engine once per reply; returns (pool, engine, outcome per scrape)."""
    async def go():
        eng = await _FootprintEngine().start()
        config = ServeConfig(prefill_urls=("http://p:1",), decode_urls=(eng.url,),
                             policy="jsq", **{"scrape_interval": 1.0, **cfg})
        pool = UpstreamPool(config, ["w"])
        pool.footprints.policy_of = lambda: policy
        seen = []
        pool.footprints.on_result = seen.append
        async with aiohttp.ClientSession() as session:
            pool.session = session
            for reply in replies:
                eng.reply = reply
                await pool.scrape(pool.decode[0])
        await eng.server.close()
        return pool, eng, seen

    return run(go())


def test_the_scrape_hands_a_valid_engine_footprint_to_the_policy():
    from eldr.routing import CostPolicy

    policy = CostPolicy(1, num_layers=1, num_experts=4, memory=0)
    pool, _, seen = _scrape_with([(200, json.dumps(_footprint_doc([4, 2, 0, 0], 4)))],
                                 policy=policy)
    assert seen == ["read"] and pool.footprints.counts["read"] == 1
    assert pool.tracker.loads.tolist() == [3.0]  # the load scrape is unchanged
    np.testing.assert_allclose(policy.footprint.miss[0], [0.0, 0.5, 1.0, 1.0])
    until = policy.footprint.engine.until[0] - time.monotonic()
    assert 3.0 - 0.05 - 1.0 < until <= 3.0 - 0.05  # valid 3 scrape intervals from its time


def test_bad_missing_and_stale_engine_footprints_are_counted_and_ignored():
    from eldr.routing import CostPolicy

    policy = CostPolicy(1, num_layers=1, num_experts=4, memory=0)
    replies = [(404, '{"error": "no decode footprint yet"}'),  # no plugin / no step yet
               (200, "{not json"), (200, json.dumps([1, 2])),
               (200, json.dumps({**_footprint_doc([1] * 8, 1), "shape": [2, 4]})),
               (200, json.dumps(_footprint_doc([4, 2, 0, 0], 3))),  # a count above steps
               (200, "\xff"), (200, json.dumps(_footprint_doc([4, 2, 0, 0], 4, age=9.0))),
               (500, "")]
    pool, _, seen = _scrape_with(replies, policy=policy)
    assert seen == ["missing", "invalid", "invalid", "invalid", "invalid", "invalid",
                    "stale", "missing"]
    assert policy.footprint.engine is None and pool.decode[0].healthy
    assert pool.tracker.loads.tolist() == [3.0]


def test_no_footprint_is_asked_for_when_off_or_unwanted():
    from eldr.routing import CostPolicy, make_policy

    cost = CostPolicy(1, num_layers=1, num_experts=4)
    good = [(200, json.dumps(_footprint_doc([4, 2, 0, 0], 4)))]
    for policy, cfg in ((cost, {"engine_footprint": "off"}),
                        (make_policy("jsq", num_workers=1), {})):
        _, eng, seen = _scrape_with(good, policy=policy, **cfg)
        assert eng.footprint_calls == 0 and seen == []
    _, eng, seen = _scrape_with(good, policy=cost)
    assert eng.footprint_calls == 1 and seen == ["read"]
