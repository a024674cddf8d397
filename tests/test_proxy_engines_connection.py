"""eldr.proxy.engines.connection: one engine connection fed raw HTTP/1.1 bytes, as the event
loop would feed them, and what the router then reads, waits on, pools or aborts."""

from __future__ import annotations

import asyncio
from collections import deque

import aiohttp
import pytest

from eldr.proxy.engines.connection import UpstreamProtocolError, _Connection, _Response


class _Transport:
    """What the connection uses of its transport: abort(), which, as asyncio's does, tells
    the protocol ``connection_lost`` on the loop's next turn."""

    def __init__(self, protocol: _Connection) -> None:
        self.protocol = protocol
        self.aborted = False
        self.paused = False  # reading, as pause_reading/resume_reading left it

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self.protocol.loop.call_soon(self.protocol.connection_lost, None)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def _connection(loop, maxlen: int = 4, on_idle=None) -> tuple[_Connection, _Transport, deque]:
    pool: deque = deque(maxlen=maxlen)
    conn = _Connection(pool, loop, on_idle)
    transport = _Transport(conn)
    conn.connection_made(transport)
    return conn, transport, pool


def _response(conn: _Connection) -> _Response:
    """The answer object the session builds once the headers are in."""
    conn.response = _Response(conn, conn.parser.get_status_code(), conn.headers)
    return conn.response


def test_a_reader_that_falls_behind_stops_the_engines_socket_until_it_takes():
    """A stream the router's client does not read (it cannot write to its own client) is
    not read from the engine either past READ_HIGH_WATER: the bytes wait in the engine's
    socket, not in the router's memory."""
    from eldr.proxy.engines.connection import READ_HIGH_WATER

    async def main():
        conn, transport, _ = _connection(asyncio.get_running_loop())
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        event = b"x" * 65536
        frame = f"{len(event):x}\r\n".encode() + event + b"\r\n"
        fed = 0
        while not transport.paused:
            conn.data_received(frame)
            fed += len(event)
            assert fed <= READ_HIGH_WATER + len(event)
        resp = _response(conn)
        assert len(await resp.content.readany()) == fed and not transport.paused
        conn.data_received(frame + b"0\r\n\r\n")
        assert await resp.content.readany() == event and await resp.content.readany() == b""

    asyncio.run(main())


def test_a_whole_answer_larger_than_the_high_water_mark_is_read_in_full():
    async def main():
        loop = asyncio.get_running_loop()
        conn, transport, pool = _connection(loop)
        body = bytes(range(256)) * 4096  # 1 MiB
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        resp = _response(conn)

        async def engine():  # sends while the connection reads, as a socket would
            for i in range(0, len(body), 100_000):
                while transport.paused:
                    await asyncio.sleep(0.001)
                conn.data_received(body[i:i + 100_000])
                await asyncio.sleep(0)

        sender = asyncio.ensure_future(engine())
        got = await asyncio.wait_for(resp.read(), 5)
        await sender
        assert got == body and not transport.paused
        resp.release()
        assert conn in pool

    asyncio.run(main())


def test_a_sized_answer_in_pieces_is_read_whole_and_its_connection_pooled():
    async def main():
        conn, transport, pool = _connection(asyncio.get_running_loop())
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8"
                           b"\r\nContent-Length: 11\r\n\r\n{\"a\":")
        resp = _response(conn)
        assert (resp.status, resp.content_type, resp.content_length) == (
            200, "application/json", 11)
        reading = asyncio.ensure_future(resp.read())
        await asyncio.sleep(0)
        assert not reading.done()  # waits for the rest of the body
        conn.data_received(b" 1234}")
        assert await reading == b'{"a": 1234}'
        resp.release()
        assert list(pool) == [conn] and not transport.aborted
        assert conn.headers is None and conn.chunks == []  # ready for the next request
        assert conn.idle_since > 0

    asyncio.run(main())


def test_a_chunked_answer_streams_its_chunks_and_ends():
    async def main():
        conn, transport, pool = _connection(asyncio.get_running_loop())
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"6\r\ndata: \r\n")
        resp = _response(conn)
        assert resp.content_length is None
        got = [await resp.content.readany()]
        conn.data_received(b"3\r\n{}\n\r\n0\r\n\r\n")
        got += [chunk async for chunk in resp.content.iter_any()]
        assert b"".join(got) == b"data: {}\n"
        resp.release()
        assert list(pool) == [conn] and not transport.aborted

    asyncio.run(main())


def test_connection_close_is_not_pooled():
    async def main():
        conn, transport, pool = _connection(asyncio.get_running_loop())
        conn.data_received(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n"
                           b"\r\nok")
        resp = _response(conn)
        assert await resp.read() == b"ok"
        resp.release()
        assert not pool and transport.aborted

    asyncio.run(main())


def test_an_unfinished_answer_released_is_aborted_so_the_engine_stops():
    async def main():
        conn, transport, pool = _connection(asyncio.get_running_loop())
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        resp = _response(conn)
        resp.release()
        resp.release()  # twice: nothing more happens
        assert not pool and transport.aborted and conn.closed

    asyncio.run(main())


def test_invalid_http_fails_the_waiter_and_aborts():
    async def main():
        conn, transport, _ = _connection(asyncio.get_running_loop())
        waiting = asyncio.ensure_future(conn.wait())
        await asyncio.sleep(0)
        conn.data_received(b"NOT HTTP AT ALL\r\n\r\n")
        with pytest.raises(UpstreamProtocolError, match="invalid HTTP answer"):
            await waiting
        assert transport.aborted
        with pytest.raises(UpstreamProtocolError):  # and every later wait
            await conn.wait()

    asyncio.run(main())


@pytest.mark.parametrize(("data", "error"), [
    (b"", aiohttp.ServerDisconnectedError),  # closed before a byte of answer
    (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", aiohttp.ClientPayloadError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
     aiohttp.ClientPayloadError),
])
def test_the_engine_closing_mid_answer_is_an_error(data, error):
    async def main():
        conn, _, _ = _connection(asyncio.get_running_loop())
        if data:
            conn.data_received(data)
            _response(conn)
        waiting = asyncio.ensure_future(conn.wait())
        await asyncio.sleep(0)
        conn.connection_lost(None)
        with pytest.raises(error):
            await waiting
        assert conn.closed

    asyncio.run(main())


def test_a_body_delimited_by_the_close_is_complete():
    async def main():
        conn, _, pool = _connection(asyncio.get_running_loop())
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        resp = _response(conn)
        conn.connection_lost(None)
        assert await resp.read() == b"all of it"
        resp.release()
        assert not pool  # complete, but closed: never reused

    asyncio.run(main())


def test_a_silent_engine_times_out_on_the_read_timeout():
    async def main():
        conn, transport, _ = _connection(asyncio.get_running_loop())
        conn.sock_read = 0.05
        with pytest.raises(aiohttp.ServerTimeoutError):
            await conn.wait()
        assert transport.aborted and conn.closed

    asyncio.run(main())


def test_the_read_timeout_counts_from_each_wait_not_from_the_first():
    """A stream whose chunks come every 30 ms reads on past many read timeouts of 50 ms
    (each wait moves the deadline of the connection's one timer); when the chunks stop, the
    wait in progress times out about 50 ms after it began, not when the timer was armed."""
    async def main():
        loop = asyncio.get_running_loop()
        conn, transport, _ = _connection(loop)
        conn.sock_read = 0.05
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")

        async def send(n):
            for _ in range(n):
                await asyncio.sleep(0.03)
                conn.data_received(b"2\r\nhi\r\n")

        sender = asyncio.ensure_future(send(10))
        got = b""
        while len(got) < 20:
            await conn.wait()
            got += conn.take()
        await sender
        assert got == b"hi" * 10 and not transport.aborted  # 0.3 s: six read timeouts
        t0 = loop.time()
        with pytest.raises(aiohttp.ServerTimeoutError):
            await conn.wait()
        assert 0.04 <= loop.time() - t0 < 0.2 and transport.aborted

    asyncio.run(main())


def test_a_pooled_connection_outlives_the_deadlines_of_the_request_it_carried():
    """The connection's timer is left armed when a request ends: when it fires with nothing
    due it stops, and the idle connection stays pooled and open."""
    async def main():
        loop = asyncio.get_running_loop()
        conn, transport, pool = _connection(loop)
        conn.set_deadline(loop.time() + 0.05)
        conn.sock_read = 0.05
        waiting = asyncio.ensure_future(conn.wait())
        await asyncio.sleep(0)
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await waiting
        resp = _response(conn)
        assert await resp.read() == b"ok"
        resp.release()
        assert conn in pool
        await asyncio.sleep(0.15)  # past both old deadlines
        assert not transport.aborted and conn in pool and conn._watch_handle is None

    asyncio.run(main())


def test_a_reused_connection_times_out_on_the_shorter_deadline_of_its_next_request():
    """A health check (2 s) on a connection a decode (300 s) left its timer armed on: the
    timer comes forward to the check's deadline, it does not wait for the decode's."""
    async def main():
        loop = asyncio.get_running_loop()
        conn, transport, pool = _connection(loop)
        conn.set_deadline(loop.time() + 300)
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        resp = _response(conn)
        assert await resp.read() == b"ok"
        resp.release()
        assert conn in pool and conn._watch_handle is not None
        conn.set_deadline(loop.time() + 0.05)  # the next request, on the same connection
        t0 = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(conn.wait(), 5)  # 5 s: a test that fails, not hangs
        assert 0.04 <= loop.time() - t0 < 0.5 and transport.aborted
        conn2, transport2, _ = _connection(loop)  # and a read timeout, the same way
        conn2.set_deadline(loop.time() + 300)
        conn2.sock_read = 0.05
        t0 = loop.time()
        with pytest.raises(aiohttp.ServerTimeoutError):
            await asyncio.wait_for(conn2.wait(), 5)
        assert 0.04 <= loop.time() - t0 < 0.5 and transport2.aborted

    asyncio.run(main())


def test_the_total_deadline_fails_a_waiter_with_a_timeout():
    async def main():
        conn, transport, _ = _connection(asyncio.get_running_loop())
        waiting = asyncio.ensure_future(conn.wait())
        await asyncio.sleep(0)
        conn._total_timeout()
        with pytest.raises(asyncio.TimeoutError):
            await waiting
        assert transport.aborted

    asyncio.run(main())


@pytest.mark.parametrize("keep", [True, False])
def test_the_session_decides_whether_an_idle_connection_is_kept(keep):
    async def main():
        asked = []

        def on_idle(c):
            asked.append(c)
            return keep

        conn, transport, pool = _connection(asyncio.get_running_loop(), on_idle=on_idle)
        conn.data_received(b"HTTP/1.1 204 No Content\r\n\r\n")
        resp = _response(conn)
        assert await resp.read() == b""
        resp.release()
        assert asked == [conn] and not pool  # the session pools it, not the connection
        assert transport.aborted is (not keep)

    asyncio.run(main())


def test_a_full_pool_closes_the_connection():
    async def main():
        conn, transport, pool = _connection(asyncio.get_running_loop(), maxlen=1)
        pool.append(object())  # another idle connection fills it
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        _response(conn).release()
        assert conn not in pool and transport.aborted

    asyncio.run(main())


@pytest.mark.parametrize(("headers", "ctype", "length"), [
    (b"", "application/octet-stream", None),
    (b"Content-Type: Text/Event-Stream ; charset=utf-8\r\nContent-Length: 0\r\n",
     "text/event-stream", 0),
])
def test_content_type_and_length_as_aiohttp_reads_them(headers, ctype, length):
    async def main():
        conn, _, _ = _connection(asyncio.get_running_loop())
        conn.data_received(b"HTTP/1.1 200 OK\r\n" + headers + b"\r\n")
        resp = _response(conn)
        assert (resp.content_type, resp.content_length) == (ctype, length)

    asyncio.run(main())
