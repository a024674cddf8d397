import asyncio
import json

import pytest

from _proxy_fakes import cluster, make_state, run, spy_events, until

CODE = {"model": "tiny", "prompt": "write code now"}
LAW = {"model": "tiny", "prompt": "a legal text"}


def _metric(router, name, **labels):
    return getattr(router.metrics, name).get(**labels)


# -- the flow through fake engines ----------------------------------------------------------
def test_the_prefill_names_stay_importable_from_the_flow():
    from eldr.proxy.request import flow, prefill

    assert flow.prefill_body is prefill.prefill_body and flow.prompt_key is prefill.prompt_key
    assert flow.PREFILL_KV_PARAMS is prefill.PREFILL_KV_PARAMS


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
    assert prefills[0].request_ids[0] == decoders[0].request_ids[0] != "req-1"
    # the band reads a signature and no profile: the engine is asked for its layers only
    assert prefills[0].requests[0]["kv_transfer_params"]["eldr_layers"] == [0, 1]
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
    first, second = prefills[0].request_ids  # a fresh prefill, own id
    assert first != second and decoders[1].request_ids == [second]
    assert r.headers["X-Request-Id"] == "r"
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
    assert status == 502 and err["code"] == 502
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
    assert json.loads(events[-1][6:])["error"]["type"] == "Bad Gateway"
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


@pytest.mark.parametrize("chat", [False, True])
def test_a_client_closing_right_after_done_is_a_completed_request(chat):
    """Issue 14: clients (openai's among them) close as soon as they read ``[DONE]``, while
    the decoder's stream may still be open (its end in a later TCP segment; ``linger``
    holds it 0.3 s). That is a completed request: counted 200, released ``completed``,
    and the decoder's stream ends on its own, never aborted."""
    async def go():
        async with cluster(engine_kw={"tokens": 5}) as (router, client, _, decoders):
            for d in decoders:
                d.mode = "linger"
            events = spy_events(router.state.policy)
            path, body = (("/v1/chat/completions",
                           {"model": "tiny", "messages": [{"role": "user", "content": "code"}]})
                          if chat else ("/v1/completions", CODE))
            r = await client.post(path, json={**body, "stream": True})
            got = b""
            while b"data: [DONE]" not in got:
                got += await r.content.readany()
            r.close()  # right after [DONE], before the decoder's end of stream
            for _ in range(200):
                await asyncio.sleep(0.02)
                if sum(d.finished_streams + d.aborted for d in decoders) and \
                        not router.pool.tracker.loads.any() and not router.flow._background:
                    break
            return router, decoders, events, got

    router, decoders, events, got = run(go())
    assert got.rstrip().endswith(b"data: [DONE]")
    endpoint = "chat" if chat else "completions"
    assert _metric(router, "requests", endpoint=endpoint, status="200") == 1
    assert _metric(router, "client_disconnects") == 0
    assert [e[2] for e in events if e[0] == "release"] == ["completed"]
    assert sum(d.finished_streams for d in decoders) == 1  # upstream ended cleanly
    assert sum(d.aborted for d in decoders) == 0


def test_a_client_closing_before_done_is_still_a_disconnect():
    async def go():
        async with cluster(engine_kw={"tokens": 50}) as (router, client, _, decoders):
            for d in decoders:
                d.mode = "slow"
            events = spy_events(router.state.policy)
            r = await client.post("/v1/completions", json={**CODE, "stream": True})
            await r.content.readany()
            r.close()
            for _ in range(300):
                await asyncio.sleep(0.02)
                if any(d.aborted for d in decoders) and not router.pool.tracker.loads.any():
                    break
            return router, decoders, events

    router, decoders, events = run(go())
    assert _metric(router, "client_disconnects") == 1
    assert _metric(router, "requests", endpoint="completions", status="200") == 0
    assert [e[2] for e in events if e[0] == "release"] == ["cancelled"]
    assert sum(d.aborted for d in decoders) == 1


# -- the stateful policy contract (dispatch / release) ---------------------------------------
def _assert_empty_footprint(policy):
    fp = policy.footprint
    assert len(fp) == 0
    assert not fp.count.any() and not fp.log_miss.any() and not fp.context.any()


def test_eldr_cost_routes_end_to_end_and_packs_by_experts():
    async def go():
        async with cluster(policy="eldr_cost") as (router, client, _, decoders):
            policy = router.state.policy
            events = spy_events(policy)
            decoders[0].mode = decoders[1].mode = "slow"
            # two concurrent code streams, then a law one: the law prompt's experts are
            # disjoint, so it adds fewer distinct experts to the empty-of-law decoder
            r1 = await client.post("/v1/completions", json={**CODE, "stream": True})
            await r1.content.readany()
            held = len(policy.footprint)
            r2 = await client.post("/v1/completions", json={**LAW, "stream": True})
            await r2.content.readany()
            placed = (r1.headers["X-Eldr-Decoder"], r2.headers["X-Eldr-Decoder"])
            await r1.text(), await r2.text()
            return router, policy, events, held, placed

    router, policy, events, held, placed = run(go())
    assert held == 1 and placed == ("w-code", "w-other")
    assert [e[0] for e in events] == ["dispatch", "dispatch", "release", "release"]
    assert {e[2] for e in events if e[0] == "release"} == {"completed"}
    assert _metric(router, "decisions", policy="eldr_cost", decoder="w-code") == 1
    assert router.metrics.fallbacks.values == {}
    _assert_empty_footprint(policy)


def test_every_dispatch_is_released_once_whatever_happens():
    """Completed, engine 4xx, retried, failed for good, broken mid-stream, client gone:
    the cost policy's footprint is back to exactly zero and each attempt released once."""
    async def go():
        async with cluster(policy="eldr_cost", decode_read_timeout=0.5, unhealthy_after=99,
                           breaker_failures=99,
                           engine_kw={"tokens": 50}) as (router, client, _, decoders):
            policy = router.state.policy
            events = spy_events(policy)
            statuses = []
            for _ in range(3):  # completed, JSON and streamed
                statuses.append((await client.post("/v1/completions", json=CODE)).status)
                r = await client.post("/v1/completions", json={**LAW, "stream": True})
                await r.text()
                statuses.append(r.status)
            decoders[0].mode = "400"  # relayed 4xx
            statuses.append((await client.post("/v1/completions", json=CODE)).status)
            decoders[0].mode = "500"  # retried on the other decoder
            statuses.append((await client.post("/v1/completions", json=CODE)).status)
            decoders[1].mode = "hang"  # both fail: 502 after a timeout
            statuses.append((await client.post("/v1/completions", json=CODE)).status)
            decoders[0].mode = "break"  # mid-stream break
            decoders[1].mode = "ok"
            r = await client.post("/v1/completions", json={**CODE, "stream": True})
            await r.text()
            statuses.append(r.status)
            decoders[0].mode = decoders[1].mode = "slow"  # the client leaves mid-stream
            r = await client.post("/v1/completions", json={**CODE, "stream": True})
            await r.content.readany()
            r.close()
            decoders[0].mode = decoders[1].mode = "hang"  # the client leaves before a byte
            task = asyncio.ensure_future(client.post("/v1/completions", json=CODE))
            for _ in range(200):
                await asyncio.sleep(0.01)
                if len(policy.footprint):
                    break
            task.cancel()
            for _ in range(500):
                await asyncio.sleep(0.02)
                if len(policy.footprint) == 0 and not router.pool.tracker.loads.any():
                    break
            return policy, events, statuses

    policy, events, statuses = run(go())
    assert statuses == [200] * 6 + [400, 200, 502, 200]
    dispatched = [e[1] for e in events if e[0] == "dispatch"]
    released = [e[1] for e in events if e[0] == "release"]
    assert sorted(dispatched) == sorted(released) and len(set(dispatched)) == len(dispatched)
    outcomes = [e[2] for e in events if e[0] == "release"]
    assert outcomes.count("cancelled") == 2
    # 4xx; 500 then retried; 500, hang, 500 (three attempts); the mid-stream break
    assert outcomes.count("failed") == 6
    _assert_empty_footprint(policy)


def test_releases_go_to_the_policy_that_got_the_dispatch_across_a_reload():
    async def go():
        async with cluster(policy="eldr_cost") as (router, client, _, decoders):
            old = router.state.policy
            decoders[0].mode = decoders[1].mode = "slow"
            r = await client.post("/v1/completions", json={**CODE, "stream": True})
            await r.content.readany()
            held = len(old.footprint)
            router.swap(make_state(router.config))  # what a reload does
            await r.text()
            return old, router.state.policy, held

    old, new, held = run(go())
    assert held == 1
    _assert_empty_footprint(old)
    _assert_empty_footprint(new)


# -- issue 12: upstream answers that do not parse are protocol errors -----------------------
def test_a_prefill_answer_nested_too_deep_is_a_protocol_error_of_that_instance():
    async def go():
        async with cluster(num_prefill=2, unhealthy_after=99) as (router, client, prefills, _):
            prefills[0].mode = "deep"
            statuses = [(await client.post("/v1/completions", json=CODE)).status
                        for _ in range(2)]
            return router, statuses

    router, statuses = run(go())
    assert statuses == [200, 200]
    assert _metric(router, "upstream_errors", role="prefill", instance="prefill-0",
                   kind="protocol") >= 1


@pytest.mark.parametrize("mode", ["deep", "notjson"])
def test_an_unparsable_decoder_answer_is_retried_elsewhere(mode):
    async def go():
        async with cluster() as (router, client, _p, decoders):
            decoders[0].mode = mode
            r = await client.post("/v1/completions", json=CODE)
            return router, r.status, r.headers.get("X-Eldr-Decoder"), r.content_type, \
                await r.text()

    router, status, decoder, ctype, text = run(go())
    assert (status, decoder, ctype) == (200, "w-other", "application/json")
    assert json.loads(text)["choices"][0]["text"] == "tok0tok1tok2"
    assert _metric(router, "upstream_errors", role="decode", instance="w-code",
                   kind="protocol") == 1


def test_a_stream_that_is_not_sse_is_retried_elsewhere():
    async def go():
        async with cluster() as (_router, client, _p, decoders):
            decoders[0].mode = "notjson"
            r = await client.post("/v1/completions", json={**CODE, "stream": True})
            return r.status, r.headers.get("X-Eldr-Decoder"), await r.text()

    status, decoder, text = run(go())
    assert (status, decoder) == (200, "w-other") and text.endswith("data: [DONE]\n\n")


def test_an_sse_usage_event_nested_too_deep_ends_the_stream_with_an_error_event():
    async def go():
        async with cluster() as (router, client, _p, decoders):
            decoders[0].mode = "deep"
            body = {**CODE, "stream": True, "stream_options": {"include_usage": True}}
            r = await client.post("/v1/completions", json=body)
            return router, r.status, await r.text()

    router, status, text = run(go())
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and json.loads(events[0][6:])["choices"][0]["text"] == "tok0"
    assert json.loads(events[-1][6:])["error"]["type"] == "Bad Gateway"
    assert _metric(router, "upstream_errors", role="decode", instance="w-code",
                   kind="protocol") == 1


# -- issue 12: no prefill is spent for a request that cannot be decoded ---------------------
def test_no_prefill_is_spent_when_every_decoder_is_down():
    async def go():
        async with cluster() as (router, client, prefills, decoders):
            for d in decoders:
                d.healthy = False
            for _ in range(500):
                await asyncio.sleep(0.02)
                if not router.pool.tracker.healthy.any():
                    break
            rs = [await client.post("/v1/completions", json=CODE) for _ in range(5)]
            return [(r.status, (await r.json())["error"]["code"]) for r in rs], prefills

    out, prefills = run(go())
    assert out == [(503, 503)] * 5
    assert len(prefills[0].requests) == 0  # prefills wasted per refused request: 0


def test_upstream_request_ids_are_unique_per_attempt_whatever_the_client_sends():
    async def go():
        async with cluster() as (_, client, prefills, decoders):
            rs = await asyncio.gather(*(client.post("/v1/completions", json=CODE,
                                                    headers={"X-Request-Id": "same"})
                                        for _ in range(20)))
            return [(r.status, r.headers["X-Request-Id"]) for r in rs], prefills, decoders

    out, prefills, decoders = run(go())
    assert out == [(200, "same")] * 20  # the client's id comes back
    sent = prefills[0].request_ids
    assert len(set(sent)) == 20 and "same" not in sent
    decoded = decoders[0].request_ids + decoders[1].request_ids
    assert sorted(decoded) == sorted(sent)  # prefill and decode of an attempt share it


# -- issue 12: bounded memory and no pinned decoder under clients that never read ----------
async def _open_and_never_read(client, body: dict):
    """Send a request on a raw socket with a tiny receive buffer, then never read."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (client.host, client.port))
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    await asyncio.get_running_loop().sock_sendall(sock, head + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_never_reads_is_dropped_and_the_decode_aborted(stream):
    async def go():
        async with cluster(write_timeout=0.5) as (router, client, _, decoders):
            decoders[0].mode = "flood" if stream else "big"
            decoders[0].big_bytes = 8 << 20
            socks = [await _open_and_never_read(client, {**CODE, "stream": stream})
                     for _ in range(3)]
            for _ in range(500):
                await asyncio.sleep(0.02)
                if router.metrics.slow_clients.get() == 3 and \
                        router.pool.decode[0].in_flight == 0:
                    break
            for s in socks:
                s.close()
            await asyncio.sleep(0.1)
            return router, decoders

    router, decoders = run(go())
    assert router.metrics.slow_clients.get() == 3
    assert router.pool.decode[0].in_flight == 0 and router.pool.tracker.loads[0] == 0
    if stream:
        assert decoders[0].aborted == 3  # the decoder stopped generating for them
    _assert_empty_footprint_if_any(router)


def test_the_router_reads_a_stream_only_as_fast_as_its_client_reads():
    """An engine streaming to a client that never reads: what the engine got written before
    the client was dropped is bounded by socket buffers and the connection's 256 KiB, not
    by the engine's speed times the write timeout (the router's own engine client once read
    such streams into memory at loopback speed: gigabytes per second)."""
    async def go():
        async with cluster(write_timeout=1.0) as (router, client, _, decoders):
            decoders[0].mode = "flood"
            sock = await _open_and_never_read(client, {**CODE, "stream": True})
            for _ in range(500):
                await asyncio.sleep(0.02)
                if router.metrics.slow_clients.get() == 1:
                    break
            sock.close()
            return router, decoders[0].flooded

    router, flooded = run(go())
    assert router.metrics.slow_clients.get() == 1
    assert flooded < 48 << 20, f"{flooded / 2**20:.0f} MiB"


def _assert_empty_footprint_if_any(router):
    fp = getattr(router.state.policy, "footprint", None)
    assert fp is None or len(fp) == 0


def test_buffered_answers_over_their_cap_are_refused_not_buffered():
    async def go():
        async with cluster(max_response_bytes=1 << 20, max_prefill_bytes=1 << 20,
                           num_prefill=2, unhealthy_after=99) as (router, client, prefills,
                                                                  decoders):
            decoders[0].mode = decoders[1].mode = "big"
            decoders[0].big_bytes = decoders[1].big_bytes = 2 << 20
            r1 = await client.post("/v1/completions", json=CODE)
            decoders[0].mode = decoders[1].mode = "ok"
            prefills[0].mode, prefills[0].big_bytes = "big", 2 << 20
            rs = [await client.post("/v1/completions", json=CODE) for _ in range(2)]
            return router, (r1.status, await r1.json()), \
                [(r.status, r.headers["X-Eldr-Prefill"]) for r in rs], prefills

    router, (s1, doc1), served, _prefills = run(go())
    assert s1 == 502 and doc1["error"]["code"] == 502
    assert served == [(200, "prefill-1")] * 2  # the oversized one is skipped
    assert _metric(router, "upstream_errors", role="prefill", instance="prefill-0",
                   kind="too_large") >= 1


def test_buffered_answers_share_one_budget_while_clients_do_not_read():
    async def go():
        async with cluster(write_timeout=0.5, max_response_bytes=12 << 20,
                           max_buffered_bytes=12 << 20) as (router, client, _, decoders):
            # ~8 MiB answers (more than the sockets buffer): one fits the budget at a time
            decoders[0].mode, decoders[0].big_bytes = "big", 4 << 20
            socks = [await _open_and_never_read(client, CODE) for _ in range(2)]
            budget, peak = router.flow.budget, 0
            for _ in range(500):
                await asyncio.sleep(0.01)
                peak = max(peak, budget.used)
                if router.metrics.slow_clients.get() == 2 and budget.used == 0:
                    break
            for s in socks:
                s.close()
            return router, budget, peak

    router, budget, peak = run(go())
    assert router.metrics.slow_clients.get() == 2
    assert 0 < peak <= budget.total and budget.used == 0


# -- issue 12: a decoder that passes health checks but fails requests is held off ----------
def test_a_flapping_decoder_is_held_off_by_its_breaker_then_probed():
    async def go():
        async with cluster(breaker_failures=3, breaker_backoff=0.5,
                           breaker_max_backoff=4.0) as (router, client, _, decoders):
            # The breaker reads an injected clock, moved by hand: on a loaded machine the
            # eight requests below can outlast a wall-clock back-off, and a probe would
            # then go out inside the loop (seen once in CI: 4 tries instead of 3).
            now = [0.0]
            router.pool.decode[0].breaker.clock = lambda: now[0]
            decoders[0].mode = "500"  # /health stays 200: health checks re-admit it
            statuses = []
            for _ in range(8):
                r = await client.post("/v1/completions", json=CODE)
                statuses.append(r.status)
                await until(lambda: router.pool.decode[0].healthy,
                            "a health round re-admits it each time")
            tried_while_open = len(decoders[0].requests)
            state = router.pool.decode[0].breaker.state
            now[0] += 0.6  # back-off over: one probe, which fails
            r = await client.post("/v1/completions", json=CODE)
            statuses.append(r.status)
            after_probe = (len(decoders[0].requests), router.pool.decode[0].breaker.backoff)
            decoders[0].mode = "ok"
            now[0] += 1.1
            await until(lambda: router.pool.decode[0].healthy, "a health round re-admits it")
            r = await client.post("/v1/completions", json=CODE)  # the probe succeeds
            statuses.append(r.status)
            return router, statuses, tried_while_open, state, after_probe, \
                r.headers["X-Eldr-Decoder"]

    router, statuses, tried, state, (after_probe, backoff), last = run(go())
    assert statuses == [200] * 10  # every request served (retried on the other decoder)
    assert tried == 3 and state == "open"  # 3 failures opened it; then nothing went there
    assert after_probe == 4 and backoff == 1.0  # one probe, failed: back-off doubled
    assert last == "w-code" and router.pool.decode[0].breaker.state == "closed"
    assert router.metrics.retries.get() == 4


def test_transient_failures_do_not_open_the_breaker():
    async def go():
        async with cluster(breaker_failures=3) as (router, client, _, decoders):
            statuses, decoders_used = [], []
            for i in range(12):
                decoders[0].mode = "500" if i % 3 == 0 else "ok"  # one failure in three
                r = await client.post("/v1/completions", json=CODE)
                statuses.append(r.status)
                decoders_used.append(r.headers["X-Eldr-Decoder"])
                await until(lambda: router.pool.decode[0].healthy,
                            "the health check re-admits after a failure")
            return router, statuses, decoders_used

    router, statuses, used = run(go())
    assert statuses == [200] * 12
    assert router.pool.decode[0].breaker.num_opened == 0
    assert used.count("w-code") == 8  # the two requests in three it served itself


def test_a_decoder_that_cannot_be_reached_costs_no_second_prefill():
    async def go():
        async with cluster(health_interval=60) as (router, client, prefills, decoders):
            await decoders[0].close()  # refused: no byte of the decode reaches it
            r = await client.post("/v1/completions", json=CODE)
            return router, r, await r.json(), prefills, decoders

    router, r, doc, prefills, decoders = run(go())
    assert r.status == 200 and r.headers["X-Eldr-Attempts"] == "2"
    assert doc["choices"][0]["text"] == "tok0tok1tok2"
    assert len(prefills[0].requests) == 1  # prefills wasted: 0
    assert decoders[1].request_ids == prefills[0].request_ids  # the same prefill, read once
    assert router.metrics.abandoned.values == {}


def test_abandoned_prefills_are_counted_by_reason():
    async def go():
        async with cluster(unhealthy_after=99, breaker_failures=99) as (router, client, p,
                                                                         decoders):
            decoders[0].mode = "400"
            await client.post("/v1/completions", json=CODE)
            decoders[0].mode = decoders[1].mode = "500"
            await client.post("/v1/completions", json=CODE)
            return router, p

    router, prefills = run(go())
    assert _metric(router, "abandoned", reason="decoder_4xx") == 1
    assert _metric(router, "abandoned", reason="decode_failed") == 3  # 3 attempts, 3 prefills
    assert len(prefills[0].requests) == 4


def test_a_refused_decode_reads_the_prefills_kv_with_a_one_token_decode():
    async def go():
        async with cluster() as (router, client, prefills, decoders):
            decoders[0].mode = "400"
            r = await client.post("/v1/completions", json={**CODE, "max_tokens": 7,
                                                           "logit_bias": {"1": 100}})
            for _ in range(200):
                await asyncio.sleep(0.01)
                if router.metrics.kv_releases.get(result="ok"):
                    break
            return router, r.status, prefills, decoders

    router, status, prefills, decoders = run(go())
    assert status == 400
    refused, release = decoders[0].requests
    assert release == {"model": "tiny", "prompt": "write code now", "max_tokens": 1,
                       "stream": False, "kv_transfer_params": refused["kv_transfer_params"]}
    assert decoders[0].request_ids == [prefills[0].request_ids[0]] * 2
    assert router.metrics.kv_releases.get(result="ok") == 1


def test_a_client_leaving_during_a_large_answer_is_no_error(caplog):
    async def go():
        async with cluster(write_timeout=5) as (router, client, _, decoders):
            decoders[0].mode, decoders[0].big_bytes = "big", 4 << 20
            socks = [await _open_and_never_read(client, CODE) for _ in range(3)]
            for _ in range(300):
                await asyncio.sleep(0.01)
                if router.flow.budget.used:
                    break
            await asyncio.sleep(0.2)  # the answers are being written
            for s in socks:
                s.close()
            for _ in range(300):
                await asyncio.sleep(0.02)
                if router.pool.decode[0].in_flight == 0 and router.flow.budget.used == 0:
                    break
            return router

    router = run(go())
    assert router.pool.decode[0].in_flight == 0 and router.flow.budget.used == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert router.metrics.requests.get(endpoint="completions", status="500") == 0


def test_a_policy_reading_profiles_asks_the_engine_for_every_layer():
    async def go():
        async with cluster(policy="eldr_cost") as (_, client, prefills, _d):
            r = await client.post("/v1/completions", json=CODE)
            return r.status, prefills[0].requests[0]["kv_transfer_params"]

    status, params = run(go())
    assert status == 200 and "eldr_layers" not in params and params["do_remote_decode"]


def test_a_learning_router_asks_for_every_layer_even_for_the_band():
    """The learn buffer takes whole (L, E) counts: with a learner attached the band's layer
    mask is not requested (masked payloads were dropped as another model's)."""
    async def go():
        async with cluster() as (router, client, prefills, _d):
            router.attach_learner(_CountingLearner())
            r = await client.post("/v1/completions", json=CODE)
            return r.status, prefills[0].requests[0]["kv_transfer_params"], router.learner

    status, params, learner = run(go())
    assert status == 200 and "eldr_layers" not in params and params["do_remote_decode"]
    assert learner.done == 1


class _CountingLearner:
    """What the flow needs of a learner: its completion hook."""

    done = 0

    def on_request_done(self, doc, decoder, resp=None, decode=None):
        self.done += 1

    async def start(self):
        pass

    async def stop(self):
        pass


# -- containment: short prompts, poison requests, the retry budget (docs/failures.md) -----
def test_short_prompts_are_served_whole_by_a_decoder_and_counted():
    async def go():
        async with cluster(short_prompt_tokens=32) as (router, client, prefills, decoders):
            out = []
            for body, path in (
                    ({"model": "tiny", "prompt": "hi", "max_tokens": 4}, "/v1/completions"),
                    ({"model": "tiny", "prompt": [5, 6, 7]}, "/v1/completions"),
                    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "stream": True}, "/v1/chat/completions"),
                    ({"model": "tiny", "prompt": "hi", "kv_transfer_params": {"x": 1}},
                     "/v1/completions")):
                r = await client.post(path, json=body)
                out.append((r.status, r.headers["X-Eldr-Prefill"], await r.text()))
            long = await client.post("/v1/completions",
                                     json={"model": "tiny", "prompt": "x" * 40})
            return router, out, long.headers["X-Eldr-Prefill"], prefills, decoders

    router, out, long_prefill, prefills, decoders = run(go())
    assert [(s, p) for s, p, _ in out] == [(200, "none")] * 4
    assert all("tok0" in text for _, _, text in out)
    assert "data: [DONE]" in out[2][2]
    assert long_prefill == "prefill-0"  # 40 bytes may be 32 tokens or more: PD flow
    assert len(prefills[0].requests) == 1  # only the long prompt was prefilled
    whole = [b for d in decoders for b in d.requests][:4]
    assert all("kv_transfer_params" not in b for b in whole)  # a client's own is dropped too
    assert whole[1]["prompt"] == [5, 6, 7] and whole[0]["max_tokens"] == 4
    assert _metric(router, "short_prompts") == 4
    assert _metric(router, "fallbacks", reason="short_prompt") == 4  # routed by load
    assert sum(_metric(router, "decisions", policy="eldr", decoder=n)
               for n in ("w-code", "w-other")) == 5
    assert _metric(router, "abandoned", reason="decode_failed") == 0
    assert router.pool.tracker.loads.tolist() == [0, 0]


def test_a_short_prompt_whose_decoder_fails_is_retried_on_another_without_a_prefill():
    async def go():
        async with cluster(short_prompt_tokens=32, unhealthy_after=10) as (
                router, client, prefills, decoders):
            decoders[0].mode = decoders[1].mode = "500"
            failed = await client.post("/v1/completions", json={"prompt": "hi"})
            decoders[1].mode = "ok"
            r = await client.post("/v1/completions", json={"prompt": "hi"})
            return router, failed.status, r, prefills, decoders

    router, failed, r, prefills, _ = run(go())
    assert failed == 502
    assert r.status == 200 and r.headers["X-Eldr-Decoder"] == "w-other"
    assert prefills[0].requests == []
    assert _metric(router, "retries") >= 2


def test_the_short_prompt_threshold_defaults_to_the_engines_kv_block():
    async def go():
        async with cluster(short_prompt_tokens=None) as (router, client, prefills, decoders):
            for e in (*prefills, *decoders):
                e.block_size = 8
            for inst in (*router.pool.prefill, *router.pool.decode):
                inst.block_size = None  # as before the first check (the fakes start first)
            await router.pool.check_all()
            r8 = await client.post("/v1/completions", json={"prompt": "1234567"})
            r9 = await client.post("/v1/completions", json={"prompt": "12345678"})
            return router, r8.headers["X-Eldr-Prefill"], r9.headers["X-Eldr-Prefill"]

    router, short, long = run(go())
    assert router.pool.block_size() == 8
    assert (short, long) == ("none", "prefill-0")


def test_without_a_reported_block_the_threshold_is_16_tokens():
    async def go():
        async with cluster(short_prompt_tokens=None) as (router, client, _, __):
            a = await client.post("/v1/completions", json={"prompt": "x" * 15})
            b = await client.post("/v1/completions", json={"prompt": "x" * 16})
            return router, a.headers["X-Eldr-Prefill"], b.headers["X-Eldr-Prefill"]

    router, a, b = run(go())
    assert router.pool.block_size() is None
    assert (a, b) == ("none", "prefill-0")


POISON = {"model": "tiny", "prompt": "POISON pill"}


def test_a_request_that_kills_two_decoders_is_poison_and_refused_on_resend():
    async def go():
        async with cluster(num_decode=3, policy="jsq", health_interval=60) as (
                router, client, prefills, decoders):
            for d in decoders:
                d.die_on = "POISON"
            first = await client.post("/v1/completions", json=POISON,
                                      headers={"X-Request-Id": "bad-1"})
            again = await client.post("/v1/completions", json=POISON)
            fine = await client.post("/v1/completions", json=CODE)
            return (router, first.status, (await first.json())["error"], again.status,
                    (await again.json())["error"], fine.status, prefills, decoders)

    router, status, err, again, again_err, fine, prefills, decoders = run(go())
    assert status == 502
    assert "bad-1" in err["message"] and "died" in err["message"]
    assert "decode w-code (disconnect)" in err["message"]
    # distinct ids: a request on a reused connection may go twice (eldr.proxy.engines.client)
    poison_ids = [{i for i, b in zip(d.request_ids, d.requests, strict=True)
                   if "POISON" in b["prompt"]} for d in decoders]
    assert [len(ids) for ids in poison_ids] == [1, 1, 0]  # no third engine touched
    assert again == 422 and "poison" in again_err["message"]
    assert len(prefills[0].requests) == 2 + 1  # the resend reached no engine; CODE did
    assert fine == 200
    assert _metric(router, "poison", event="detected") == 1
    assert _metric(router, "poison", event="refused") == 1
    assert _metric(router, "engine_deaths", role="decode", instance="w-code") == 1
    assert _metric(router, "engine_deaths", role="decode", instance="w-other") == 1
    assert router.pool.tracker.loads.tolist() == [0, 0, 0]


def test_an_engine_killed_from_outside_poisons_none_of_its_requests():
    async def go():
        async with cluster(policy="jsq", health_interval=60) as (router, client, _, decoders):
            decoders[0].hold = asyncio.Event()  # d0 holds what it gets until it is killed
            body = {"model": "tiny", "prompt": "the same words for everyone"}
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                     for _ in range(6)]
            for _ in range(200):
                if len(decoders[0]._open) >= 3:
                    break
                await asyncio.sleep(0.01)
            held = len(decoders[0]._open)
            decoders[0].kill()
            rs = await asyncio.gather(*tasks)
            decoders[0].healthy, decoders[0].hold = True, None  # restarted
            resend = await client.post("/v1/completions", json=body)
            return router, held, [r.status for r in rs], resend.status

    router, held, statuses, resend = run(go())
    assert held >= 3
    assert statuses == [200] * 6 and resend == 200
    assert _metric(router, "engine_deaths", role="decode", instance="w-code") == 1
    assert _metric(router, "poison", event="detected") == 0


def test_a_prompt_that_kills_the_only_prefill_is_refused_at_its_third_death():
    async def go():
        async with cluster(health_interval=60) as (router, client, prefills, _):
            prefills[0].die_on = "POISON"
            out = []
            for _ in range(4):
                r = await client.post("/v1/completions", json=POISON)
                out.append((r.status, (await r.json())["error"]["message"]))
                prefills[0].healthy = True  # restarted (eldr cluster)
                await router.pool.check(router.pool.prefill[0])
            return router, out, prefills

    router, out, prefills = run(go())
    assert [s for s, _ in out] == [502, 502, 502, 422]
    assert "prefill failed" in out[0][1] and "died" in out[2][1]
    assert len(set(prefills[0].request_ids)) == 3  # the fourth never reached it
    assert _metric(router, "poison", event="detected") == 1


def test_a_stream_cut_by_the_second_death_ends_with_a_poison_error_event():
    async def go():
        async with cluster(policy="jsq", health_interval=60) as (router, client, _, decoders):
            decoders[0].die_on = "POISON"  # dies before its first byte
            decoders[1].mode = "break_dead"  # dies after its first event
            r = await client.post("/v1/completions", json={**POISON, "stream": True})
            text = await r.text()
            again = await client.post("/v1/completions", json={**POISON, "stream": True})
            return router, r.status, text, again.status

    router, status, text, again = run(go())
    assert status == 200 and "tok0" in text
    assert '"error"' in text and "died" in text
    assert again == 422
    assert _metric(router, "poison", event="detected") == 1


def test_retries_beyond_the_budget_fail_fast():
    async def go():
        async with cluster(retry_budget_ratio=0.0, retry_budget_min=0.1,
                           retry_budget_window=10, unhealthy_after=10) as (
                router, client, _, decoders):
            for d in decoders:
                d.mode = "500"
            first = await client.post("/v1/completions", json=CODE)  # 1 retry: the floor
            second = await client.post("/v1/completions", json=CODE)  # none left
            return (router, first.status, second.status, (await second.json())["error"],
                    decoders)

    router, first, second, err, decoders = run(go())
    assert first == 502 and second == 502
    assert "retry budget" in err["message"]
    assert sum(len(d.requests) for d in decoders) == 2 + 1
    assert _metric(router, "retries") == 1
    assert _metric(router, "retries_refused") == 2


def test_a_cost_layer_stride_asks_the_engine_for_the_priced_layers_only():
    """``eldr_cost --cost-layer-stride 2`` on a 2-layer model prices layer 0: the prefill
    is asked for it alone, and the (whole) payload the fake engine sends still routes."""
    async def go():
        async with cluster(policy="eldr_cost", cost_layer_stride=2) as (router, client,
                                                                         prefills, _d):
            r = await client.post("/v1/completions", json=CODE)
            return r.status, prefills[0].requests[0]["kv_transfer_params"], router

    status, params, router = run(go())
    assert status == 200 and params["eldr_layers"] == [0] and params["do_remote_decode"]
    assert router.state.policy.footprint.num_cells == 8  # one layer of 8 experts
    assert _metric(router, "decisions", policy="eldr_cost", decoder="w-code") + \
        _metric(router, "decisions", policy="eldr_cost", decoder="w-other") == 1
    assert router.state.policy.num_fallbacks == 0  # routed on the profile, not by load
