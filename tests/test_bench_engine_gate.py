"""``benchmarks/engine_gate.py`` (the pass-through hop of ``bench_engine_tpot.py --gate``)
against an in-process stand-in engine: what it relays, what it records, and its barrier;
and the bench's join of the gate's records with its client's."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer


def _load(name: str):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gate_mod():
    return _load("engine_gate")


def _engine() -> web.Application:
    """An engine that streams three events, and has a /metrics page."""
    async def generate(request):
        body = await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for k in range(3):
            await out.write(f"data: {json.dumps({'k': k, 'p': body['prompt']})}\n\n".encode())
            await asyncio.sleep(0.01)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def metrics(_):
        return web.Response(text="vllm:x 1\n")

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/metrics", metrics)
    return app


async def _with_gate(gate_mod, body):
    """Run ``body(gate, session, url_of)`` with a stand-in engine behind hops named
    prefill-0 and decode-0."""
    engine = TestServer(_engine())
    await engine.start_server()
    gate = gate_mod.Gate()
    await gate.start_session()
    hops = {n: TestServer(gate.engine_app(n, str(engine.make_url("")).rstrip("/")))
            for n in ("prefill-0", "decode-0")}
    for hop in hops.values():
        await hop.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            return await body(gate, session, lambda n: str(hops[n].make_url("")).rstrip("/"))
    finally:
        for hop in hops.values():
            await hop.close()
        await gate.session.close()
        await engine.close()


async def _post(session, url, prompt, rid):
    async with session.post(url + "/v1/completions", json={"prompt": prompt},
                            headers={"X-Request-Id": rid}) as resp:
        return resp.status, await resp.read()


def test_the_hop_relays_answers_and_other_routes(gate_mod):
    async def body(gate, session, url_of):
        status, raw = await _post(session, url_of("decode-0"), "hello", "r1")
        async with session.get(url_of("decode-0") + "/metrics") as resp:
            page = await resp.text()
        return status, raw, page

    status, raw, page = asyncio.run(_with_gate(gate_mod, body))
    assert status == 200 and raw.count(b"data: ") == 4 and raw.endswith(b"[DONE]\n\n")
    assert page == "vllm:x 1\n"


def test_records_and_the_bench_key_agree(gate_mod):
    bench = _load("bench_engine_tpot")

    async def body(gate, session, url_of):
        await _post(session, url_of("prefill-0"), "a prompt", "r1")
        await _post(session, url_of("decode-0"), "a prompt", "r1")
        async with session.get(url_of("decode-0") + "/metrics"):
            pass
        return list(gate.records)

    recs = asyncio.run(_with_gate(gate_mod, body))
    assert [r["engine"] for r in recs] == ["prefill-0", "decode-0"]  # /metrics untimed
    for r in recs:
        assert r["rid"] == "r1" and r["status"] == 200 and not r["held"]
        assert r["key"] == bench._prompt_key("a prompt")
        assert r["t_in"] <= r["t_up"] <= r["t_hdr"] <= r["t_first"] <= r["t_end"]
    assert recs[0]["t_end"] <= recs[1]["t_in"]


def test_an_armed_gate_releases_the_decodes_together(gate_mod):
    async def body(gate, session, url_of):
        gate.barrier.arm(2, timeout=30)
        first = asyncio.ensure_future(_post(session, url_of("decode-0"), "one", "a"))
        await asyncio.sleep(0.2)
        assert not first.done()  # held until the wave's second decode arrives
        await _post(session, url_of("prefill-0"), "two", "b")  # a prefill is never held
        second = await _post(session, url_of("decode-0"), "two", "b")
        await first
        return second, list(gate.records)

    second, recs = asyncio.run(_with_gate(gate_mod, body))
    assert second[0] == 200
    dec = {r["key"]: r for r in recs if r["engine"] == "decode-0"}
    a, b = dec[gate_mod.prompt_key(b'{"prompt": "one"}')], \
        dec[gate_mod.prompt_key(b'{"prompt": "two"}')]
    assert a["held"] and b["held"]
    assert a["t_up"] >= b["t_in"] > a["t_in"] + 0.15  # the first waited for the second


def test_a_wave_that_never_completes_is_released_late(gate_mod):
    async def body(gate, session, url_of):
        gate.barrier.arm(3, timeout=0.2)
        got = await _post(session, url_of("decode-0"), "alone", "a")
        return got, gate.barrier.late, gate.barrier.n

    (status, _), late, armed = asyncio.run(_with_gate(gate_mod, body))
    assert status == 200 and late == 1 and armed is None
    with pytest.raises(ValueError, match="n must be"):
        gate_mod.Barrier().arm(0, 1.0)


def test_join_and_summary_of_a_wave():
    bench = _load("bench_engine_tpot")
    client = [{"decoder": "decode-0", "key": "k1", "t_send": 100.0, "t_first": 100.5,
               "t_last": 103.0},
              {"decoder": "decode-0", "key": "k2", "t_send": 100.0, "t_first": 100.9,
               "t_last": 103.2}]
    gate = [{"engine": "prefill-0", "key": "k1", "t_in": 100.01, "t_up": 100.01,
             "t_end": 100.2},
            {"engine": "prefill-0", "key": "k2", "t_in": 100.01, "t_up": 100.01,
             "t_end": 100.4},
            {"engine": "decode-0", "key": "k1", "t_in": 100.21, "t_up": 100.21,
             "t_first": 100.45, "t_end": 102.9},
            {"engine": "decode-0", "key": "k2", "t_in": 100.43, "t_up": 100.43,
             "t_first": 100.8, "t_end": 103.1}]
    rows = bench.join_timings(client, gate, start=100.0)
    assert rows[1]["p_end"] == pytest.approx(0.4) and rows[1]["d_up"] == pytest.approx(0.43)
    per = {"decode-0": {"step_s": 0.1}, "decode-1": {"step_s": 0.1}}
    t = bench.timing_summary(rows, per, tokens=3)
    assert t["route_ms"] == pytest.approx(20.0)  # (10 + 30) / 2
    assert t["prefill_spread_ms"] == pytest.approx(200.0)
    assert t["spread_ms"] == pytest.approx(220.0)  # decode-1 got no requests: not counted
    assert t["spread_steps"] == pytest.approx(2.2)
    assert t["ttft_ms"] == pytest.approx(700.0) and t["hold_ms"] == pytest.approx(0.0)
    assert t["client_tpot_ms"] == pytest.approx((2500 + 2300) / 2 / 2)
    assert t["first_decoder"] == "decode-0"
    assert t["early"] == {"decode-0": 1, "decode-1": 0}  # k1 started before k2's prefill ended
