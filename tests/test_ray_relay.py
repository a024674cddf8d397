"""The Ray ingress's request path (eldr.integrations.ray.relay) against stand-in engines.

No Ray: the relay talks to a :class:`DecodeTable` in this process through coroutines, as
it talks to the table deployment's handle in Serve. The stand-in engines (tests/
_proxy_fakes.py) answer a prefill with the eldr payload of the prompt's expert counts
(prompts mentioning "code" use experts 0-3, others 4-7); the table's ``eldr`` policy at
τ = 0 sends each to the decoder whose centroid it matches (w-code, w-other).
"""

from __future__ import annotations

import asyncio
import contextvars
import json

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from _proxy_fakes import FakeEngine, make_state
from eldr.integrations.ray.relay import PDRelay, RelayConfig
from eldr.integrations.ray.table import DecodeTable, TableConfig
from eldr.proxy.config import ServeConfig


class LocalTable:
    """The table's methods as coroutines (what TableClient gives over a Serve handle)."""

    def __init__(self, table: DecodeTable) -> None:
        self.table = table

    def __getattr__(self, name):
        method = getattr(self.table, name)

        async def call(*args, **kwargs):
            return method(*args, **kwargs)

        return call


class Setup:
    def __init__(self, prefill, decoders, table, relay):
        self.prefill, self.decoders, self.table, self.relay = prefill, decoders, table, relay

    def decoder(self, name: str) -> FakeEngine:
        return self.decoders[self.table.names.index(name)]


async def _setup(*, payload: str = "counts", max_attempts: int = 3, policy: str = "eldr",
                 stream_write_timeout: float = 60.0, cost_layer_stride: int = 1):
    prefill = await FakeEngine("p0", payload=payload).start()
    decoders = [await FakeEngine(f"d{k}").start() for k in range(2)]
    serve = ServeConfig(prefill_urls=(prefill.url,), decode_urls=tuple(d.url for d in decoders),
                        policy=policy, artifact=None, cost_layer_stride=cost_layer_stride)
    table = DecodeTable(TableConfig(num_decode=2, policy=policy,
                                    cost_layer_stride=cost_layer_stride),
                        state=make_state(serve, names=("w-code", "w-other")))
    table.register("prefill", "rp", prefill.url)
    for k, d in enumerate(decoders):
        assert table.register("decode", f"rd{k}", d.url)["slot"] == ("w-code", "w-other")[k]
    relay = PDRelay(LocalTable(table), RelayConfig(max_attempts=max_attempts,
                                                 prefill_refresh=0.0,
                                                 stream_write_timeout=stream_write_timeout))
    return Setup(prefill, decoders, table, relay)


async def _teardown(s: Setup) -> None:
    await s.relay.close()
    for e in (s.prefill, *s.decoders):
        await e.close()


def _run(test):
    async def main():
        s = await _setup(**getattr(test, "setup_kw", {}))
        try:
            await test(s)
        finally:
            await _teardown(s)
    asyncio.run(main())


async def _body(answer) -> bytes:
    if answer.stream is None:
        return answer.body
    return b"".join([chunk async for chunk in answer.stream])


async def _settled(s: Setup) -> dict:
    """The table once every release the relay spawned has run."""
    for _ in range(100):
        if not s.table.held and not s.relay._tasks:
            break
        await asyncio.sleep(0.01)
    return s.table.snapshot()


def _completion(prompt: str, *, stream: bool = False, chat: bool = False) -> tuple[str, bytes]:
    body = {"model": "tiny", "max_tokens": 3, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body).encode()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_decoder_follows_the_prefill_payload_and_every_reservation_ends(stream, chat):
    async def test(s: Setup):
        for prompt, want in (("write code for me", "w-code"), ("the law of contracts", "w-other"),
                             ("more code please", "w-code")):
            path, raw = _completion(prompt, stream=stream, chat=chat)
            answer = await s.relay.handle("POST", path, raw)
            body = await _body(answer)
            assert answer.status == 200, body
            assert answer.headers["X-Eldr-Decoder"] == want
            assert answer.headers["X-Eldr-Input"] == "payload"
            assert answer.headers["X-Eldr-Attempts"] == "1"
            assert b"tok0tok1tok2" in body or body.count(b"tok") == 3
            decoded = s.decoder(want).requests[-1]
            # the prefill's kv_transfer_params are relayed, less the eldr payload
            assert decoded["kv_transfer_params"]["remote_engine_id"] == "p0"
            assert "eldr" not in decoded["kv_transfer_params"]
            assert decoded.get("stream", False) is stream
        prefill = s.prefill.requests[-1]
        assert prefill["max_tokens"] == 1 and prefill["stream"] is False
        assert prefill["kv_transfer_params"]["do_remote_decode"] is True
        assert prefill["kv_transfer_params"]["eldr_layers"] == [0, 1]  # the band's mask
        snap = await _settled(s)
        assert [d["load"] for d in snap["decoders"]] == [0.0, 0.0]
        assert snap["held"] == 0
        assert snap["counters"]["reservations:completed"] == 3
        assert snap["decisions"] == {"w-code|payload": 2, "w-other|payload": 1}
    _run(test)


def test_a_cost_layer_stride_asks_the_prefill_for_the_priced_layers_only():
    """``eldr_cost`` pricing every 2nd of the 2 layers: each prefill is asked for layer 0
    (as ``eldr serve`` asks), and the payload routes (no fallback to load)."""
    async def test(s: Setup):
        for prompt in ("write code for me", "the law of contracts"):
            path, raw = _completion(prompt)
            answer = await s.relay.handle("POST", path, raw)
            assert answer.status == 200, answer.body
            assert answer.headers["X-Eldr-Input"] == "payload"
            assert s.prefill.requests[-1]["kv_transfer_params"]["eldr_layers"] == [0]
        snap = await _settled(s)
        assert not any(k.startswith("fallbacks:") for k in snap["counters"]), snap
    test.setup_kw = {"policy": "eldr_cost", "cost_layer_stride": 2}
    _run(test)


def test_a_decoder_that_drops_before_its_first_byte_is_retried_on_the_other():
    async def test(s: Setup):
        s.decoder("w-code").mode = "drop"
        for stream in (False, True):
            path, raw = _completion("code again", stream=stream)
            answer = await s.relay.handle("POST", path, raw)
            body = await _body(answer)
            assert answer.status == 200, body
            assert answer.headers["X-Eldr-Decoder"] == "w-other"
            assert answer.headers["X-Eldr-Attempts"] == "2"
            s.table.register("decode", "rd0", s.decoder("w-code").url)  # its heartbeat
        # every attempt had its own prefill: a consumed kv_transfer_params is never reused
        assert len(s.prefill.requests) == 4
        snap = await _settled(s)
        assert snap["held"] == 0 and [d["load"] for d in snap["decoders"]] == [0.0, 0.0]
        assert snap["counters"]["reservations:failed"] == 2
        assert snap["counters"]["reservations:completed"] == 2
    _run(test)


def test_an_engine_refusing_the_request_is_relayed_and_released():
    async def test(s: Setup):
        s.decoder("w-code").mode = "400"
        path, raw = _completion("code with a bad parameter")
        answer = await s.relay.handle("POST", path, raw)
        assert answer.status == 400
        assert json.loads(answer.body) == {"error": {"message": "bad param"}}
        snap = await _settled(s)
        assert snap["counters"]["reservations:failed"] == 1 and snap["held"] == 0
        assert len(s.decoder("w-other").requests) == 0  # a 4xx is not retried elsewhere
    _run(test)


def test_a_stream_that_breaks_after_its_first_byte_ends_with_an_sse_error():
    async def test(s: Setup):
        s.decoder("w-code").mode = "break"
        path, raw = _completion("code that breaks", stream=True)
        answer = await s.relay.handle("POST", path, raw)
        assert answer.status == 200
        body = (await _body(answer)).decode()
        events = [e for e in body.split("\n\n") if e.startswith("data: ")]
        assert "tok0" in events[0]
        assert json.loads(events[-1][6:])["error"]["code"] == 502
        snap = await _settled(s)
        assert snap["counters"]["reservations:failed"] == 1 and snap["held"] == 0
    _run(test)


def test_a_client_that_leaves_mid_stream_releases_its_decoder_as_cancelled():
    async def test(s: Setup):
        s.decoder("w-code").mode = "slow"
        s.decoder("w-code").tokens = [f"t{i}" for i in range(50)]
        path, raw = _completion("code for a slow reader", stream=True)
        answer = await s.relay.handle("POST", path, raw)
        first = await answer.stream.__anext__()
        assert b"t0" in first
        assert s.table.snapshot()["decoders"][0]["load"] == 1.0  # held while it streams
        await answer.stream.aclose()  # the client went away
        snap = await _settled(s)
        assert snap["counters"].get("reservations:cancelled") == 1
        assert snap["held"] == 0 and snap["decoders"][0]["load"] == 0.0
    _run(test)


_SERVE_REQUEST = contextvars.ContextVar("serve_request", default=None)


class ServeLikeTable(LocalTable):
    """A table client that treats its calls as Serve's handle does (Ray 2.60): a call
    made in a request's context (here ``_SERVE_REQUEST``) is a child of that request
    while it is being assigned to a replica (``assign`` seconds), and cancelling the
    request cancels those children (``Replica._on_request_cancelled``)."""

    def __init__(self, table: DecodeTable, assign: float = 0.05) -> None:
        super().__init__(table)
        self.assign, self.children = assign, {}

    def __getattr__(self, name):
        method = getattr(self.table, name)

        async def call(*args, **kwargs):
            parent, task = _SERVE_REQUEST.get(), asyncio.current_task()
            if parent is not None:
                self.children.setdefault(parent, set()).add(task)
            try:
                await asyncio.sleep(self.assign)
            finally:
                self.children.get(parent, set()).discard(task)
            return method(*args, **kwargs)

        return call

    def cancel_children(self, parent: str) -> int:
        tasks = self.children.pop(parent, set())
        for task in tasks:
            task.cancel()
        return len(tasks)


def test_a_release_is_not_cancelled_with_the_request_it_releases():
    """Serve cancels a cancelled request's child calls still being assigned: the release
    the cancellation spawns must not be one of them, or the decoder stays held until its
    reservation expires (the two-node Ray test's flake, 1 run in 10)."""
    async def test(s: Setup):
        s.decoder("w-code").mode = "slow"
        s.decoder("w-code").tokens = [f"t{i}" for i in range(50)]
        table = ServeLikeTable(s.table)
        relay = PDRelay(table, RelayConfig(prefill_refresh=0.0))
        path, raw = _completion("code for a client that leaves", stream=True)
        first = asyncio.Event()

        async def request():  # what Serve runs for one HTTP request, in its own context
            _SERVE_REQUEST.set("request-1")
            answer = await relay.handle("POST", path, raw)
            async for _ in answer.stream:
                first.set()

        task = asyncio.create_task(request())
        await asyncio.wait_for(first.wait(), 10)
        assert s.table.snapshot()["held"] == 1
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task
        table.cancel_children("request-1")  # as Serve does once the request has ended
        for _ in range(100):
            if not relay._tasks:
                break
            await asyncio.sleep(0.01)
        snap = s.table.snapshot()
        assert snap["counters"].get("reservations:cancelled") == 1, snap["counters"]
        assert snap["held"] == 0 and snap["decoders"][0]["load"] == 0.0
        await relay.close()
    _run(test)


def test_a_stream_left_unread_releases_its_decoder_after_the_write_timeout():
    """A consumer that neither reads nor is cancelled (a client gone whose cancellation
    never arrived): the decoder is released as cancelled once the stream has waited
    stream_write_timeout for its next read, exactly once, and the stream then ends."""
    async def test(s: Setup):
        s.decoder("w-code").mode = "slow"
        s.decoder("w-code").tokens = [f"t{i}" for i in range(50)]
        path, raw = _completion("code for a reader that stalls", stream=True)
        answer = await s.relay.handle("POST", path, raw)
        assert b"t0" in await answer.stream.__anext__()
        assert s.table.snapshot()["decoders"][0]["load"] == 1.0
        for _ in range(200):  # nothing pulls the stream meanwhile
            if s.table.snapshot()["counters"].get("reservations:cancelled"):
                break
            await asyncio.sleep(0.05)
        snap = await _settled(s)
        assert snap["counters"].get("reservations:cancelled") == 1
        assert snap["held"] == 0 and snap["decoders"][0]["load"] == 0.0
        with pytest.raises(StopAsyncIteration):  # taken up again: it has ended
            await answer.stream.__anext__()
        snap = await _settled(s)
        assert snap["counters"].get("reservations:cancelled") == 1
        assert not snap["counters"].get("reservations:completed")
    test.setup_kw = {"stream_write_timeout": 0.3}
    _run(test)


def test_a_stream_left_unread_takes_from_its_decoder_only_what_the_buffers_hold():
    """A decoder streaming as fast as it can to a consumer that stops pulling: the relay
    reads the decoder's stream only as the consumer pulls (an async generator over
    aiohttp's reader, which pauses the socket past its buffer), so what the decoder got
    written before the stream was abandoned is socket buffers and aiohttp's, not the
    decoder's speed times the write timeout (eldr serve's engine client once read such
    streams into memory at gigabytes per second)."""
    async def test(s: Setup):
        s.decoder("w-code").mode = "flood"
        path, raw = _completion("code for a reader that stalls on a flood", stream=True)
        answer = await s.relay.handle("POST", path, raw)
        await answer.stream.__anext__()
        for _ in range(200):
            if s.table.snapshot()["counters"].get("reservations:cancelled"):
                break
            await asyncio.sleep(0.05)
        snap = await _settled(s)
        assert snap["counters"].get("reservations:cancelled") == 1
        flooded = s.decoder("w-code").flooded
        assert 0 < flooded < 48 << 20, f"{flooded / 2**20:.0f} MiB"
    test.setup_kw = {"stream_write_timeout": 1.0}
    _run(test)


def test_a_prefill_without_payload_is_routed_by_load_and_counted():
    async def test(s: Setup):
        names = []
        for i in range(2):
            path, raw = _completion(f"code {i}", stream=True)
            answer = await s.relay.handle("POST", path, raw)
            assert answer.headers["X-Eldr-Input"] == "none; fallback=missing"
            names.append(answer.headers["X-Eldr-Decoder"])
            first = await answer.stream.__anext__()  # held: the next goes elsewhere
            assert first
        assert sorted(names) == ["w-code", "w-other"]  # by load: one each
        snap = s.table.snapshot()
        assert snap["counters"]["fallbacks:missing"] == 2
    test.setup_kw = {"payload": "none"}
    _run(test)


def test_bad_bodies_and_a_missing_prefill_are_clear_errors():
    async def test(s: Setup):
        answer = await s.relay.handle("POST", "/v1/completions", b"{not json")
        assert answer.status == 400 and b"not JSON" in answer.body
        answer = await s.relay.handle("POST", "/v1/completions", b"[1, 2]")
        assert answer.status == 400
        answer = await s.relay.handle("GET", "/v1/completions", b"")
        assert answer.status == 405
        s.table.unregister("rp")
        path, raw = _completion("code without prefill")
        answer = await s.relay.handle("POST", path, raw)
        assert answer.status == 502 and b"prefill" in answer.body
        assert s.table.snapshot()["held"] == 0
    _run(test)


def test_other_routes_go_to_a_prefill_engine_and_health_reads_the_table():
    async def test(s: Setup):
        answer = await s.relay.handle("GET", "/v1/models", b"")
        assert answer.status == 200 and json.loads(answer.body)["data"][0]["id"] == "tiny"
        assert (await s.relay.handle("GET", "/health", b"")).status == 200
        s.table.mark_failed("w-code")
        s.table.mark_failed("w-other")
        assert (await s.relay.handle("GET", "/health", b"")).status == 503
        path, raw = _completion("code with no decoder left")
        answer = await s.relay.handle("POST", path, raw)
        assert answer.status == 503
        snap = json.loads((await s.relay.handle("GET", "/eldr/table", b"")).body)
        assert snap["counters"]["no_healthy_decoder"] == 1
        assert np.all([not d["healthy"] for d in snap["decoders"]])
    _run(test)


def test_a_prefill_engine_that_fails_is_skipped_and_marked_until_its_heartbeat():
    async def test(s: Setup):
        spare = await FakeEngine("p1").start()
        try:
            s.table.register("prefill", "rp1", spare.url)
            s.prefill.mode = "drop"  # the first prefill engine drops every connection
            for _ in range(2):
                path, raw = _completion("code after a prefill failure")
                answer = await s.relay.handle("POST", path, raw)
                assert answer.status == 200, answer.body
                assert answer.headers["X-Eldr-Decoder"] == "w-code"
                assert answer.headers["X-Eldr-Attempts"] == "1"
            assert len(spare.requests) == 2  # both prefills
            assert len(s.prefill.requests) == 1  # marked failed after its first drop
            assert [t["replica"] for t in s.table.prefill_targets()] == ["rp1"]
            assert "Server-Timing" in answer.headers and "route;dur=" in \
                answer.headers["Server-Timing"]
        finally:
            await spare.close()
    _run(test)
