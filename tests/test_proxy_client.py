"""The router's HTTP/1.1 client to the engines (eldr.proxy.engines.client), against raw servers."""

import asyncio

import aiohttp
import pytest

from eldr.proxy.engines.client import UpstreamConnectError, UpstreamProtocolError, UpstreamSession
from eldr.proxy.engines.upstream import error_kind, make_session


class _Server:
    """A raw HTTP/1.1 server: ``answer(head, body)`` gives bytes, a list of pieces sent
    apart, or None (say nothing until the client goes away)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.closed = 0
        self.heads: list[bytes] = []

    async def start(self) -> "_Server":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                low = head.lower()
                n = 0
                if b"content-length:" in low:
                    i = low.index(b"content-length:")
                    n = int(low[i + 15: low.index(b"\r\n", i)])
                body = await reader.readexactly(n)
                self.heads.append(head)
                out = self.answer(head, body)
                if isinstance(out, list):  # pieces written apart, with a pause between
                    for piece in out:
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.05)
                elif out is not None:
                    writer.write(out)
                    await writer.drain()
                else:  # silent until the client goes away
                    await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.closed += 1
            writer.close()

    async def stop(self) -> None:
        self.server.close()


def _json(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n" + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _run(coro):
    return asyncio.run(coro)


async def _session():
    return UpstreamSession(aiohttp.ClientSession())


def test_posts_reuse_one_keep_alive_connection_and_send_the_body_as_given():
    async def go():
        srv = await _Server(lambda head, body: _json(b'{"echo": ' + body + b"}")).start()
        s = await _session()
        try:
            for i in range(3):
                async with s.post(srv.url + "/v1/completions", data=b'{"i": %d}' % i,
                                  headers={"X-Request-Id": f"r{i}"}) as resp:
                    assert resp.status == 200
                    assert resp.content_type == "application/json"
                    assert resp.content_length == len(await resp.read())
            resp = await s.post(srv.url + "/x", json={"a": 1})
            assert await resp.read() == b'{"echo": {"a": 1}}'
            resp.close()
            async with s.request("GET", srv.url + "/v1/models?x=1") as resp:
                assert await resp.read() == b'{"echo": }'  # (no body: the echo is empty)
            return srv.connections, srv.heads
        finally:
            await s.close()
            await srv.stop()

    connections, heads = _run(go())
    assert connections == 1
    assert heads[1].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"X-Request-Id: r1\r\n" in heads[1] and b"Content-Length: 8\r\n" in heads[1]
    assert b"Content-Type: application/json" in heads[3]  # json= sets it
    assert heads[4].startswith(b"GET /v1/models?x=1 HTTP/1.1\r\n")


def test_a_chunked_stream_arrives_piece_by_piece():
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]

    def answer(head, body):
        return [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"] + [
            f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in events] + [b"0\r\n\r\n"]

    async def go():
        srv = await _Server(answer).start()
        s = await _session()
        try:
            resp = await s.post(srv.url + "/v1/completions", data=b"{}")
            assert resp.content_type == "text/event-stream" and resp.content_length is None
            got = []
            while chunk := await resp.content.readany():
                got.append(chunk)
            resp.close()
            async with s.post(srv.url + "/v1/completions", data=b"{}") as again:
                pieces = [c async for c in again.content.iter_any()]
            return got, pieces, srv.connections
        finally:
            await s.close()
            await srv.stop()

    got, pieces, connections = _run(go())
    assert got == events and b"".join(pieces) == b"".join(events)
    assert connections == 1  # a finished stream's connection is reused


def test_timeouts_connect_errors_and_protocol_errors_have_their_kinds():
    async def go():
        silent = await _Server(lambda head, body: None).start()
        garbage = await _Server(lambda head, body: b"NOT HTTP\r\n\r\n").start()
        s = await _session()
        out = {}
        try:
            for name, timeout in (("read", aiohttp.ClientTimeout(sock_read=0.2)),
                                  ("total", aiohttp.ClientTimeout(total=0.2))):
                with pytest.raises(asyncio.TimeoutError) as info:
                    async with s.post(silent.url + "/", data=b"{}", timeout=timeout):
                        pass
                out[name] = error_kind(info.value)
            port = silent.server.sockets[0].getsockname()[1]
            await silent.stop()
            await silent.server.wait_closed()
            with pytest.raises(UpstreamConnectError) as info:
                await s.post(f"http://127.0.0.1:{port}/", data=b"{}")
            out["connect"] = error_kind(info.value)
            with pytest.raises(UpstreamProtocolError) as info:
                await s.post(garbage.url + "/", data=b"{}")
            out["protocol"] = error_kind(info.value)
            with pytest.raises(ValueError, match="line break"):
                await s.post(garbage.url + "/", data=b"{}", headers={"X": "a\r\nB: c"})
            return out
        finally:
            await s.close()
            await garbage.stop()

    assert _run(go()) == {"read": "timeout", "total": "timeout", "connect": "connect",
                          "protocol": "protocol"}


def test_closing_an_unfinished_answer_aborts_its_connection():
    def answer(head, body):  # promises 100 bytes, sends 5, then waits
        return [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhello"]

    async def go():
        srv = await _Server(answer).start()
        s = await _session()
        try:
            resp = await s.post(srv.url + "/", data=b"{}")
            assert await resp.content.readany() == b"hello"
            resp.close()  # the engine sees its client go away
            for _ in range(50):
                if srv.closed:
                    break
                await asyncio.sleep(0.02)
            return srv.closed
        finally:
            await s.close()
            await srv.stop()

    assert _run(go()) == 1


def test_a_connection_the_engine_closed_is_not_reused():
    async def go():
        srv = await _Server(lambda head, body: _json(b"{}", b"Connection: close\r\n")).start()
        s = await _session()
        try:
            for _ in range(3):
                async with s.post(srv.url + "/", data=b"{}") as resp:
                    assert await resp.read() == b"{}"
            return srv.connections
        finally:
            await s.close()
            await srv.stop()

    assert _run(go()) == 3


def test_what_it_does_not_do_goes_to_aiohttp():
    class Fallback:
        def __init__(self):
            self.calls = []

        def request(self, method, url, **kw):
            self.calls.append((method, url, sorted(kw)))
            return "from aiohttp"

        async def close(self):
            self.calls.append("closed")

    fb = Fallback()
    s = UpstreamSession(fb)
    assert s.post("https://engine:8000/v1/completions", data=b"{}") == "from aiohttp"
    assert s.get("http://engine:8000/health", params={"a": "1"}) == "from aiohttp"
    assert s.request("HEAD", "http://engine:8000/health") == "from aiohttp"
    assert s.request("POST", "http://engine:8000/x", data=iter([b"{}"])) == "from aiohttp"
    _run(s.close())
    assert fb.calls[0][:2] == ("POST", "https://engine:8000/v1/completions")
    assert "params" in fb.calls[1][2] and fb.calls[2][0] == "HEAD"
    assert fb.calls[3][0] == "POST" and fb.calls[-1] == "closed"
    assert isinstance(make_session(fb), UpstreamSession)


def test_a_kept_alive_connection_closed_as_a_request_goes_out_is_retried_on_a_new_one():
    """The engine (uvicorn: 5 s keep-alive) may close an idle connection just as the next
    request is written on it: no byte of an answer comes back. The request goes once more,
    on a new connection; an answer that had started is never sent twice."""
    seen = []

    def answer(head, body):
        seen.append(body)
        if len(seen) == 2:
            raise ConnectionResetError  # closes the connection without a byte
        return _json(b'{"n": %d}' % len(seen))

    async def go():
        srv = await _Server(answer).start()
        s = await _session()
        try:
            async with s.post(srv.url + "/v1/completions", data=b"{}") as resp:
                first = await resp.read()  # its connection goes back to the pool
            async with s.post(srv.url + "/v1/completions", data=b"{}") as resp:
                second = await resp.read()
            return first, second, srv.connections
        finally:
            await s.close()
            await srv.stop()

    first, second, connections = _run(go())
    assert (first, second) == (b'{"n": 1}', b'{"n": 3}') and connections == 2


def test_idle_connections_older_than_the_keepalive_expiry_are_not_reused():
    async def go():
        srv = await _Server(lambda head, body: _json(b"{}")).start()
        s = UpstreamSession(aiohttp.ClientSession(), keepalive_expiry=0.05)
        try:
            for pause in (0.0, 0.01, 0.2):  # the third waits past the expiry
                await asyncio.sleep(pause)
                async with s.post(srv.url + "/x", data=b"{}") as resp:
                    assert resp.status == 200
            return srv.connections
        finally:
            await s.close()
            await srv.stop()

    assert _run(go()) == 2


async def _until(predicate, timeout: float = 20.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _slow_json(head, body):
    """An answer in two pieces 0.05 s apart: concurrent requests overlap."""
    answer = _json(b"{}")
    return [answer[:20], answer[20:]]


def test_idle_connections_are_closed_by_a_sweep_without_being_reused():
    """After a burst, idle connections are closed once older than the expiry, though no
    request comes to reuse them; the sweep's timer stops when nothing is idle."""
    async def go():
        srv = await _Server(_slow_json).start()
        s = UpstreamSession(aiohttp.ClientSession(), keepalive_expiry=0.2)
        try:
            async def one():
                async with s.post(srv.url + "/x", data=b"{}") as resp:
                    return resp.status, await resp.read()

            out = await asyncio.gather(*[one() for _ in range(8)])
            idle = s.idle_connections()
            closed = await _until(lambda: srv.closed == srv.connections)
            return out, idle, srv.connections, closed, s.idle_connections(), s._sweep
        finally:
            await s.close()
            await srv.stop()

    out, idle, connections, closed, idle_after, sweep = _run(go())
    assert out == [(200, b"{}")] * 8 and idle == connections == 8
    assert closed and idle_after == 0 and sweep is None


def test_the_idle_pool_is_capped_but_connections_in_use_are_not():
    async def go():
        srv = await _Server(_slow_json).start()
        s = UpstreamSession(aiohttp.ClientSession(), max_idle=3)
        try:
            async def one():
                async with s.post(srv.url + "/x", data=b"{}") as resp:
                    return await resp.read()

            out = await asyncio.gather(*[one() for _ in range(10)])
            closed = await _until(lambda: srv.closed == 7)
            return out, srv.connections, s.idle_connections(), closed
        finally:
            await s.close()
            await srv.stop()

    out, connections, idle, closed = _run(go())
    assert out == [b"{}"] * 10 and connections == 10  # none waited for a connection
    assert idle == 3 and closed  # the 7 beyond the cap were closed as they finished


def test_close_cancels_the_sweep_and_a_request_ending_after_it_is_not_pooled():
    async def go():
        srv = await _Server(_slow_json).start()
        s = UpstreamSession(aiohttp.ClientSession(), keepalive_expiry=60)
        try:
            async with s.post(srv.url + "/x", data=b"{}") as resp:
                await resp.read()  # pooled: a sweep is due in about a minute
            armed = s._sweep is not None
            resp = await s.post(srv.url + "/x", data=b"{}")  # in flight during close()
            await s.close()
            body = await resp.read()
            resp.release()
            closed = await _until(lambda: srv.closed == srv.connections)
            return armed, s._sweep, body, closed, s.idle_connections()
        finally:
            await srv.stop()

    armed, sweep, body, closed, idle = _run(go())
    assert armed and sweep is None
    assert body == b"{}" and closed and idle == 0
