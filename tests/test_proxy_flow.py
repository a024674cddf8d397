import asyncio
import json

import pytest

from _proxy_fakes import cluster, run
from eldr.proxy.flow import RequestFlow, _SSEUsage, decode_body, fix_usage, prompt_key

CODE = {"model": "tiny", "prompt": "write code now"}
LAW = {"model": "tiny", "prompt": "a legal text"}


def _metric(router, name, **labels):
    return getattr(router.metrics, name).get(**labels)


# -- pure helpers -------------------------------------------------------------------------
def test_fix_usage():
    u = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert fix_usage(u, 7) and u == {"prompt_tokens": 7, "completion_tokens": 3,
                                     "total_tokens": 10}
    assert not fix_usage(u, 7)
    assert not fix_usage(None, 7) and not fix_usage(u, None)


def test_sse_usage_rewrites_events_split_across_chunks():
    ev1 = b'data: {"choices": [{"text": "a"}]}\n\n'
    ev2 = b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}\n\n'
    stream = ev1 + ev2 + b"data: [DONE]\n\n"
    fixer = _SSEUsage(5)
    out = b"".join(fixer.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))
    out += fixer.flush()
    events = out.split(b"\n\n")
    assert events[0] + b"\n\n" == ev1 and events[2] == b"data: [DONE]"
    assert json.loads(events[1][6:])["usage"] == {"prompt_tokens": 5, "completion_tokens": 2,
                                                  "total_tokens": 7}
    assert _SSEUsage(None).feed(b"x") == b"x"


def test_prompt_key():
    assert prompt_key({"prompt": "héllo"}, "completions") == "héllo".encode()
    assert prompt_key({"messages": [{"role": "user", "content": "hi"}]}, "chat") == \
        b'[{"role":"user","content":"hi"}]'


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "n": 1} \n', b'{"prompt":"x","n":1}'])
def test_decode_body_splices_or_reserialises(raw):
    body = json.loads(raw)
    kvp = {"remote_engine_id": "e", "remote_block_ids": [1]}
    assert json.loads(decode_body(body, raw, kvp)) == {**body, "kv_transfer_params": kvp}
    assert decode_body(body, raw, None) == raw
    old = {**body, "kv_transfer_params": {"stale": True}}
    assert json.loads(decode_body(old, json.dumps(old).encode(), kvp)) == \
        {**body, "kv_transfer_params": kvp}
    assert json.loads(decode_body(old, None, None)) == body


def test_prefill_body():
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 4, "max_tokens": 50, "temperature": 0}
    flow = RequestFlow.__new__(RequestFlow)
    pre = json.loads(flow._prefill_body(body, "chat"))
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert pre["stream"] is False and "stream_options" not in pre and "min_tokens" not in pre
    assert pre["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert pre["temperature"] == 0 and body["max_tokens"] == 50  # the original is untouched


# -- the flow through fake engines ----------------------------------------------------------
def test_domains_reach_their_decoders_with_relayed_kv_params():
    async def go():
        async with cluster() as (router, client, prefills, decoders):
            r1 = await client.post("/v1/completions", json=CODE,
                                   headers={"X-Request-Id": "req-1"})
            r2 = await client.post("/v1/completions", json=LAW)
            return router, (r1.status, r1.headers["X-Eldr-Decoder"], await r1.json()), \
                (r2.status, r2.headers["X-Eldr-Decoder"]), prefills, decoders

    router, (s1, d1, doc1), (s2, d2), prefills, decoders = run(go())
    assert (s1, d1, s2, d2) == (200, "w-code", 200, "w-other")
    assert doc1["choices"][0]["text"] == "tok0tok1tok2"
    assert doc1["usage"]["prompt_tokens"] == 3
    sent = decoders[0].requests[0]
    assert sent["prompt"] == "write code now" and "max_tokens" not in sent
    assert sent["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert "eldr" not in sent["kv_transfer_params"]
    assert prefills[0].request_ids[0] == decoders[0].request_ids[0] == "req-1"
    assert _metric(router, "decisions", policy="eldr", decoder="w-code") == 1
    assert _metric(router, "decisions", policy="eldr", decoder="w-other") == 1
    assert _metric(router, "signatures", source="payload") == 2
    assert router.metrics.band.count() == 2


def test_upstream_headers_forward_auth_and_ask_for_identity_encoding():
    async def go():
        async with cluster() as (_, client, prefills, decoders):
            r = await client.post("/v1/completions", json=CODE,
                                  headers={"Authorization": "Bearer k", "Cookie": "a=b"})
            return r.status, prefills[0].headers[0], decoders[0].headers[0]

    status, pre, dec = run(go())
    assert status == 200
    for h in (pre, dec):
        assert h["Authorization"] == "Bearer k"
        assert "Accept-Encoding" not in h and "Cookie" not in h


def test_partial_signatures_are_used_and_counted():
    async def go():
        async with cluster() as (router, client, prefills, _):
            r1 = await client.post("/v1/completions", json=CODE)
            prefills[0].cached_tokens = 2
            r2 = await client.post("/v1/completions", json=CODE)
            return router, r1.headers["X-Eldr-Decoder"], r2.headers["X-Eldr-Decoder"]

    router, d1, d2 = run(go())
    assert d1 == d2 == "w-code"
    assert router.metrics.partial.get() == 1
    assert router.metrics.fallbacks.values == {}


@pytest.mark.parametrize("payload, source, reason", [
    ("none", "none", "missing"), ("garbage", "payload", "malformed"),
    ("routed", "routed_experts", None), ("blocks", "payload", None)])
def test_signature_sources_and_fallbacks(payload, source, reason):
    async def go():
        async with cluster(engine_kw={"payload": payload}) as (router, client, _, _d):
            r = await client.post("/v1/completions", json=CODE)
            return router, r.status, r.headers["X-Eldr-Decoder"]

    router, status, decoder = run(go())
    assert status == 200
    assert _metric(router, "signatures", source=source) == 1
    if reason is None:
        assert decoder == "w-code"
    else:  # JSQ on idle decoders: lowest index
        assert _metric(router, "fallbacks", reason=reason) == 1


@pytest.mark.parametrize("mode", ["500", "drop", "hang", "empty"])
def test_decode_failure_retries_with_a_fresh_prefill_on_another_decoder(mode):
    async def go():
        async with cluster(decode_read_timeout=0.5) as (router, client, prefills, decoders):
            decoders[0].mode = mode
            body = {**CODE, "stream": mode == "empty"}
            r = await client.post("/v1/completions", json=body,
                                  headers={"X-Request-Id": "r"})
            text = await r.text()
            return router, r, text, prefills, decoders

    router, r, text, prefills, decoders = run(go())
    assert r.status == 200 and r.headers["X-Eldr-Decoder"] == "w-other"
    assert r.headers["X-Eldr-Attempts"] == "2"
    assert "tok0" in text
    assert prefills[0].request_ids == ["r", "r-retry1"]  # a fresh prefill, own id
    assert decoders[1].request_ids == ["r-retry1"]
    assert _metric(router, "retries") == 1
    kinds = {"500": "http_5xx", "drop": "disconnect", "hang": "timeout", "empty": "disconnect"}
    assert _metric(router, "upstream_errors", role="decode", instance="w-code",
                   kind=kinds[mode]) == 1
    assert router.pool.tracker.loads.tolist() == [0, 0]


def test_dead_decoder_is_taken_out_and_requests_still_succeed():
    async def go():
        async with cluster(health_interval=60) as (router, client, _, decoders):
            await decoders[0].close()
            r1 = await client.post("/v1/completions", json=CODE)
            r2 = await client.post("/v1/completions", json=CODE)
            return router, r1, r2

    router, r1, r2 = run(go())
    assert r1.status == 200 and r1.headers["X-Eldr-Attempts"] == "2"
    assert not router.pool.decode[0].healthy
    assert r2.headers["X-Eldr-Attempts"] == "1" and r2.headers["X-Eldr-Decoder"] == "w-other"


def test_all_attempts_failing_is_a_502():
    async def go():
        async with cluster(max_attempts=3, unhealthy_after=10) as (router, client, p, decoders):
            for d in decoders:
                d.mode = "500"
            r = await client.post("/v1/completions", json=CODE)
            return router, r.status, (await r.json())["error"], p

    router, status, err, prefills = run(go())
    assert status == 502 and err["code"] == "upstream_failed"
    assert len(prefills[0].requests) == 3
    assert _metric(router, "retries") == 2


def test_engine_4xx_is_relayed_not_retried():
    async def go():
        async with cluster() as (_, client, prefills, decoders):
            decoders[0].mode = "400"
            r1 = await client.post("/v1/completions", json=CODE)
            prefills[0].mode = "400"
            r2 = await client.post("/v1/completions", json=CODE)
            return r1.status, await r1.json(), r2.status, decoders

    s1, doc1, s2, decoders = run(go())
    assert (s1, s2) == (400, 400) and doc1 == {"error": {"message": "bad param"}}
    assert len(decoders[1].requests) == 0


def test_failed_prefill_moves_to_another_prefill_instance():
    async def go():
        async with cluster(num_prefill=2, unhealthy_after=99) as (router, client, prefills, _):
            prefills[0].mode = "500"
            statuses = []
            for _ in range(3):
                r = await client.post("/v1/completions", json=CODE)
                statuses.append((r.status, r.headers["X-Eldr-Prefill"]))
            return router, statuses, prefills

    router, statuses, prefills = run(go())
    assert statuses == [(200, "prefill-1")] * 3
    assert len(prefills[1].requests) == 3
    errors = _metric(router, "upstream_errors", role="prefill", instance="prefill-0",
                     kind="http_5xx")
    assert errors == len(prefills[0].requests) >= 1


def test_streaming_chat_and_usage_counts_the_whole_prompt():
    async def go():
        async with cluster(engine_kw={"report_prompt_tokens": 0}) as (_, client, _p, _d):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "code a b"}],
                    "stream": True, "stream_options": {"include_usage": True}}
            r = await client.post("/v1/chat/completions", json=body)
            stream = await r.text()
            r2 = await client.post("/v1/completions", json=CODE)
            return r, stream, await r2.json()

    r, stream, doc = run(go())
    assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
    events = [e for e in stream.split("\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:3]] == \
        ["tok0", "tok1", "tok2"]
    assert json.loads(events[3][6:])["usage"]["prompt_tokens"] == 3  # fixed from 0
    assert events[4] == "data: [DONE]"
    assert doc["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_stream_broken_after_first_byte_ends_with_an_error_event():
    async def go():
        async with cluster() as (router, client, _, decoders):
            decoders[0].mode = "break"
            r = await client.post("/v1/completions", json={**CODE, "stream": True})
            return router, r.status, await r.text()

    router, status, text = run(go())
    assert status == 200
    events = [e for e in text.split("\n\n") if e]
    assert json.loads(events[0][6:])["choices"][0]["text"] == "tok0"
    assert json.loads(events[-1][6:])["error"]["type"] == "upstream_error"
    assert _metric(router, "retries") == 0


def test_client_disconnect_aborts_the_upstream_stream():
    async def go():
        async with cluster(engine_kw={"tokens": 200}) as (router, client, _, decoders):
            decoders[0].mode = "slow"
            r = await client.post("/v1/completions", json={**CODE, "stream": True})
            await r.content.readany()
            r.close()  # the client goes away mid-stream
            for _ in range(500):
                await asyncio.sleep(0.02)
                if decoders[0].aborted and router.pool.decode[0].in_flight == 0:
                    break
            return router, decoders

    router, decoders = run(go())
    assert decoders[0].aborted == 1
    assert router.pool.decode[0].in_flight == 0 and router.pool.tracker.loads[0] == 0
    assert _metric(router, "client_disconnects") == 1
