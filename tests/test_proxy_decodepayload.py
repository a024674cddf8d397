"""The router strips the decode engines' payload: clients get a plain instance's bytes."""

import asyncio
import json

import numpy as np
import pytest
from aiohttp import web

from _proxy_fakes import FakeEngine, cluster, run
from eldr.capture.decode import DecodeTally, encode_decode_payload
from eldr.proxy.request.decodepayload import DecodeStripper, read_report, strip_json

L, E = 2, 8


def _payload(own=False, tokens=3):
    tally = DecodeTally(L, E)
    for t in range(tokens):
        tally.add(np.array([[[t % E, (t + 1) % E]] * L]), np.array([4, 5]))
    return encode_decode_payload(tally, own=own)


PLAIN = (b'{"id":"x","choices":[{"index":0,"text":"hi"}],"usage":{"prompt_tokens":3},'
         b'"kv_transfer_params":null,"metrics":null}')


def test_strip_json_restores_the_plain_bytes():
    p = json.dumps(_payload(own=True), separators=(",", ":")).encode()
    sent = PLAIN.replace(b'"kv_transfer_params":null',
                         b'"kv_transfer_params":{"eldr_decode":' + p + b"}")
    out, payload = strip_json(sent)
    assert out == PLAIN and payload == _payload(own=True)
    # beside a connector's own keys: only the key goes, the rest stays byte for byte
    for params in (b'{"a":1,"eldr_decode":' + p + b"}", b'{"eldr_decode":' + p + b',"a":1}'):
        out, payload = strip_json(PLAIN.replace(b"null,", params + b",", 1))
        assert json.loads(out)["kv_transfer_params"] == {"a": 1}
        assert read_report(payload).tokens == 3
    assert strip_json(PLAIN) == (PLAIN, None)


def test_a_malformed_payload_is_still_stripped():
    sent = PLAIN.replace(b"null,", b'{"eldr_decode":{"v":2,"data":"}{"}},', 1)
    out, payload = strip_json(sent)
    assert b"eldr_decode" not in out and json.loads(out)["kv_transfer_params"] == {}
    assert read_report(payload) is None


def test_stripper_drops_the_event_across_any_chunking():
    p = json.dumps({"eldr_decode": _payload()}, separators=(",", ":")).encode()
    plain = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n'
    stream = plain + b"data: " + p + b"\n\ndata: [DONE]\n\n"
    want = plain + b"data: [DONE]\n\n"
    for size in (1, 7, 64, len(stream)):
        s = DecodeStripper()
        out = b"".join(s.feed(stream[i:i + size]) for i in range(0, len(stream), size))
        assert out + s.flush() == want, size
        assert read_report(s.payload).tokens == 3
    s = DecodeStripper()  # a stream without the event passes as is
    assert s.feed(want) + s.flush() == want and s.payload is None


def _partial_len_by_every_tail(data: bytes) -> int:
    """The held tail as DecodeStripper first computed it: every tail length, longest first."""
    event = b'data: {"eldr_decode":'
    for n in range(min(len(event), len(data)), 0, -1):
        if event.startswith(data[-n:]) and (n == len(data) or data[:-n].endswith(b"\n\n")):
            return n
    return 0


def test_the_held_tail_is_the_one_every_tail_length_finds():
    """The one-search tail of a chunk against the loop over every tail length, on chunks
    cut anywhere from streams of events, blank lines and starts of the payload event."""
    rng = np.random.default_rng(0)
    parts = [b"data: ", b'data: {"eldr_decode":', b'{"choices":[]}', b"\n", b"\n\n",
             b"\n\n\n", b"data: [DONE]", b'data: {"eldr', b"d", b": "]
    assert DecodeStripper._partial_len(b"") == _partial_len_by_every_tail(b"") == 0
    for _ in range(5000):
        stream = b"".join(parts[i] for i in rng.integers(0, len(parts), rng.integers(1, 8)))
        for cut in {len(stream), int(rng.integers(0, len(stream) + 1))}:
            data = stream[:cut]
            assert DecodeStripper._partial_len(data) == _partial_len_by_every_tail(data), data


class _DecodeEngine(FakeEngine):
    """A fake decoder that appends a decode payload as the plugin does (or not)."""

    def __init__(self, *a, send="good", **kw):
        super().__init__(*a, **kw)
        self.send = send  # good | bad | none

    def _extra(self):
        if self.send == "none":
            return None
        return _payload(own=True) if self.send == "good" else {"v": 2, "data": "x", "own": 1}

    async def _complete(self, request):
        body = await request.json()
        kvp = body.get("kv_transfer_params") or {}
        if kvp.get("do_remote_decode"):
            return web.json_response(self._prefill_answer(body["prompt"], 3, body))
        extra = self._extra()
        if not body.get("stream"):
            params = "null" if extra is None else json.dumps(
                {"eldr_decode": extra}, separators=(",", ":"))
            raw = ('{"id":"x","choices":[{"index":0,"text":"tok0tok1"}],"usage":{'
                   '"prompt_tokens":3,"completion_tokens":2,"total_tokens":5},'
                   f'"kv_transfer_params":{params}}}')
            return web.Response(body=raw.encode(), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for tok in ("tok0", "tok1"):
            await resp.write(b'data: {"choices":[{"index":0,"text":"' + tok.encode()
                             + b'"}]}\n\n')
        if extra is not None:
            await resp.write(b"data: " + json.dumps({"eldr_decode": extra}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.mark.parametrize("stream", [False, True])
def test_clients_get_plain_bytes_and_the_router_reads_the_payload(stream):
    async def go():
        async with cluster(num_decode=1, policy="round_robin") as (router, client, _, decs):
            old = decs[0]
            eng = await _DecodeEngine("d0", send="none").start()
            router.pool.decode[0].url = eng.url
            try:
                bodies = {}
                for send in ("none", "good", "bad"):
                    eng.send = send
                    resp = await client.post("/v1/completions", json={
                        "model": "tiny", "prompt": "write code", "stream": stream})
                    assert resp.status == 200
                    bodies[send] = await resp.read()
                assert bodies["good"] == bodies["none"] == bodies["bad"]
                assert b"eldr_decode" not in bodies["good"]
                m = router.metrics
                assert m.decode_payloads.get(result="read") == 1
                assert m.decode_payloads.get(result="invalid") == 1
                assert m.decode_distinct.count(decoder="w-code") == 1
                page = m.registry.render()
                assert 'eldr_decoder_distinct_experts_sum{decoder="w-code"} 4.5' in page
            finally:
                await eng.close()
                del old
    run(go())


def test_the_engine_footprint_is_scraped_into_the_decoder_state():
    async def footprint_metrics(request):
        return web.Response(text='vllm:num_requests_running{model_name="tiny"} 1.0\n'
                                 "eldr_engine_step_distinct_experts 6.25\n"
                                 'eldr_engine_footprint_experts{layer="0"} 20.0\n')

    async def go():
        async with cluster(num_decode=1, policy="round_robin", scrape_interval=0.05) as (
                router, _, _, _):
            eng = _DecodeEngine("d0", send="none")
            eng._metrics = footprint_metrics  # before start(): routes bind it there
            await eng.start()
            router.pool.decode[0].url = eng.url
            try:
                for _ in range(100):
                    if router.pool.decode[0].engine_distinct is not None:
                        break
                    await asyncio.sleep(0.05)
                inst = router.pool.decode[0]
                assert inst.engine_distinct == 6.25
                assert inst.engine_load == 1.0  # the load is not mixed with it
                page = router.metrics.registry.render()
                assert 'eldr_decoder_engine_distinct_experts{decoder="w-code"} 6.25' in page
            finally:
                await eng.close()
    run(go())
