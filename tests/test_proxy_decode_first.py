"""Decode-first (``eldr serve --decode-first``): the decoder chosen and held before the
prefill, named in the prefill request, with the normal path's retry, poison and
accounting rules. Stand-in engines check the decoder each prefill request names."""

import asyncio
import json

import pytest

from _proxy_fakes import cluster, run, spy_events
from test_proxy_prompts import CODE_IDS, LAW_IDS, with_prompt

# what each decoder's push connector would need in the prefill request (its address)
NAMED = (("w-code", json.dumps({"remote_host": "10.0.0.1", "remote_port": 7001})),
         ("w-other", json.dumps({"remote_host": "10.0.0.2", "remote_port": 7002})))


def _balanced(events) -> bool:
    dispatched = sorted(e[1] for e in events if e[0] == "dispatch")
    return dispatched == sorted(e[1] for e in events if e[0] == "release") and \
        len(set(dispatched)) == len(dispatched)


def _named_port(body: dict) -> int:
    """The decoder a prefill request named (its port in NAMED)."""
    return body["kv_transfer_params"]["remote_port"]


def _idle(router) -> bool:
    return not router.pool.tracker.loads.any() and \
        all(i.in_flight == 0 for i in router.pool.decode)


def test_the_prefill_names_the_decoder_chosen_on_the_prompt():
    async def go():
        async with cluster(decode_first=True, decode_kv_params=NAMED,
                           engine_kw={"payload": "none"}) as (router, client, prefills,
                                                              decoders):
            with_prompt(router)
            got = []
            for ids in (CODE_IDS, LAW_IDS, LAW_IDS, CODE_IDS):
                r = await client.post("/v1/completions", json={"model": "tiny", "prompt": ids,
                                                               "stream": ids is LAW_IDS})
                await r.read()
                got.append((r.status, r.headers["X-Eldr-Decoder"]))
            return router, got, prefills[0], decoders

    router, got, prefill, decoders = run(go())
    assert got == [(200, "w-code"), (200, "w-other"), (200, "w-other"), (200, "w-code")]
    named = [_named_port(p) for p in prefill.requests]
    assert named == [7001, 7002, 7002, 7001]
    for p in prefill.requests:
        kvp = p["kv_transfer_params"]
        assert kvp["do_remote_decode"] is True and kvp["remote_host"].startswith("10.0.0.")
    # each decode carried the prefill's answer, not the names the router added
    assert [d["kv_transfer_params"]["remote_engine_id"] for d in decoders[0].requests] == \
        ["p0", "p0"]
    assert router.metrics.route_inputs.get(source="prompt") == 4
    assert _idle(router)


def test_without_a_prediction_the_decoder_is_chosen_by_load_and_held_during_prefill():
    async def go():
        async with cluster(decode_first=True, engine_kw={"payload": "none"}) as (
                router, client, prefills, _d):
            prefills[0].hold = asyncio.Event()
            tasks = [asyncio.ensure_future(client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "two words"}))
                for _ in range(2)]
            for _ in range(200):
                await asyncio.sleep(0.01)
                if len(prefills[0].requests) == 2:
                    break
            held = router.pool.tracker.loads.tolist()  # both prefills running
            prefills[0].hold.set()
            decoders = sorted([(await t).headers["X-Eldr-Decoder"] for t in tasks])
            return router, held, decoders

    router, held, decoders = run(go())
    assert held == [1.0, 1.0]  # each held decoder counts as a request in flight
    assert decoders == ["w-code", "w-other"]
    assert router.metrics.fallbacks.get(reason="decode_first") == 2
    assert router.metrics.predictions.get(result="no_predictor") == 2
    assert router.metrics.route_inputs.get(source="none") == 2
    assert _idle(router)


def test_a_failed_prefill_gives_the_held_decoder_back():
    async def go():
        async with cluster(policy="eldr_cost", decode_first=True, unhealthy_after=99,
                           decode_kv_params=NAMED) as (router, client, prefills, _d):
            with_prompt(router)
            events = spy_events(router.state.policy)
            prefills[0].mode = "500"
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": CODE_IDS})
            return router, r.status, events

    router, status, events = run(go())
    assert status == 502
    assert events[0][0] == "dispatch" and events[1] == ("release", events[0][1], "cancelled")
    assert _balanced(events) and len(router.state.policy.footprint) == 0
    assert _idle(router)
    assert all(i.breaker.state == "closed" for i in router.pool.decode)


def test_a_failed_decode_is_retried_with_a_fresh_prefill_naming_the_next_decoder():
    async def go():
        async with cluster(decode_first=True, decode_kv_params=NAMED, unhealthy_after=99,
                           engine_kw={"payload": "none"}) as (router, client, prefills,
                                                              decoders):
            with_prompt(router)
            events = spy_events(router.state.policy)
            decoders[0].mode = "500"
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": CODE_IDS})
            return router, r, prefills[0], events

    router, r, prefill, events = run(go())
    assert r.status == 200 and r.headers["X-Eldr-Decoder"] == "w-other"
    assert r.headers["X-Eldr-Attempts"] == "2"
    assert [_named_port(p) for p in prefill.requests] == [7001, 7002]
    assert len(set(prefill.request_ids)) == 2  # each attempt its own id
    assert [e[2] for e in events if e[0] == "release"] == ["failed", "completed"]
    assert router.metrics.abandoned.get(reason="decode_failed") == 1
    assert router.metrics.retries.get() == 1 and _idle(router)


def test_an_unreachable_decoder_reuses_the_prefill_only_when_it_was_not_named():
    async def go(named):
        kw = {"decode_kv_params": NAMED} if named else {}
        async with cluster(decode_first=True, unhealthy_after=99, **kw,
                           engine_kw={"payload": "none"}) as (router, client, prefills,
                                                              decoders):
            with_prompt(router)
            await decoders[0].close()  # refuses connections
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": CODE_IDS})
            return r.status, r.headers.get("X-Eldr-Decoder"), len(prefills[0].requests)

    # named: the KV went to (or waits for) the unreachable decoder, a new prefill names the
    # other one; not named: no byte reached the decoder, the KV is read by the next
    assert run(go(True)) == (200, "w-other", 2)
    assert run(go(False)) == (200, "w-other", 1)


def test_two_engine_deaths_make_a_decode_first_request_poison():
    async def go():
        async with cluster(decode_first=True, decode_kv_params=NAMED,
                           engine_kw={"payload": "none"}) as (router, client, _p, decoders):
            with_prompt(router)
            events = spy_events(router.state.policy)
            for d in decoders:
                d.die_on = "poison"
            body = {"model": "tiny", "prompt": "poison pill"}
            first = await client.post("/v1/completions", json=body)
            again = await client.post("/v1/completions", json=body)
            return router, first, await first.json(), again.status, events

    router, first, doc, again, events = run(go())
    assert first.status == 502 and doc["error"]["code"] == 502
    assert "poison" in doc["error"]["message"] or "died" in doc["error"]["message"]
    assert again == 422
    assert router.metrics.poison.get(event="detected") == 1
    assert _balanced(events) and _idle(router)


def test_a_client_leaving_during_the_prefill_gives_the_decoder_back():
    async def go():
        async with cluster(policy="eldr_cost", decode_first=True,
                           engine_kw={"payload": "none"}) as (router, client, prefills, _d):
            events = spy_events(router.state.policy)
            prefills[0].hold = asyncio.Event()
            task = asyncio.ensure_future(client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "a b c"}))
            for _ in range(200):
                await asyncio.sleep(0.01)
                if prefills[0].requests:
                    break
            task.cancel()
            for _ in range(200):
                await asyncio.sleep(0.01)
                if _idle(router):
                    break
            prefills[0].hold.set()
            return router, events

    router, events = run(go())
    assert [e[2] for e in events if e[0] == "release"] == ["cancelled"]
    assert _balanced(events) and _idle(router)
    assert len(router.state.policy.footprint) == 0


def test_decode_kv_params_need_decode_first_and_objects():
    from eldr.proxy.config import ServeConfig

    base = {"prefill_urls": ("http://p:1",), "decode_urls": ("http://d:1",)}
    with pytest.raises(ValueError, match="need --decode-first"):
        ServeConfig(**base, decode_kv_params=NAMED)
    with pytest.raises(ValueError, match="non-empty JSON object"):
        ServeConfig(**base, decode_first=True, decode_kv_params=(("d", "[1]"),))
    with pytest.raises(ValueError, match="not valid JSON"):
        ServeConfig(**base, decode_first=True, decode_kv_params=(("d", "{"),))
    with pytest.raises(ValueError, match="sets"):
        ServeConfig(**base, decode_first=True,
                    decode_kv_params=(("d", '{"do_remote_decode": false}'),))
    with pytest.raises(ValueError, match="twice"):
        ServeConfig(**base, decode_first=True, decode_kv_params=NAMED + NAMED[:1])
    ok = ServeConfig(**base, decode_first=True, decode_kv_params=NAMED)
    assert ok.decoder_kv_params()["w-other"] == {"remote_host": "10.0.0.2",
                                                 "remote_port": 7002}


def test_a_decoder_removed_during_a_held_prefill_does_not_move_the_held_one():
    """The held decoder is kept as itself: removing a decoder before it in the pool (its
    index moves down) while the prefill runs sends the decode where it was held."""
    async def go():
        async with cluster(decode_first=True, admin_token="t" * 16, decode_kv_params=NAMED,
                           engine_kw={"payload": "none"}) as (router, client, prefills,
                                                              decoders):
            with_prompt(router)
            prefills[0].hold = asyncio.Event()
            task = asyncio.ensure_future(client.post(
                "/v1/completions", json={"model": "tiny", "prompt": LAW_IDS}))
            for _ in range(200):
                await asyncio.sleep(0.01)
                if prefills[0].requests:
                    break
            await router.elastic.remove("w-code")  # index 0 goes; w-other becomes 0
            names = [d.name for d in router.pool.decode]
            prefills[0].hold.set()
            r = await task
            return router, names, r.status, r.headers["X-Eldr-Decoder"], decoders

    router, names, status, decoder, decoders = run(go())
    assert names == ["w-other"]
    assert (status, decoder) == (200, "w-other")
    assert len(decoders[1].requests) == 1 and not decoders[0].requests
    assert _idle(router)
