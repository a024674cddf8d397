"""One keep-alive HTTP/1.1 connection to an engine, parsed by ``httptools``, and the
answer read from it: the protocol under :class:`eldr.proxy.engines.client.UpstreamSession`
(which pools these connections and writes the requests; see its module docstring).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import aiohttp
import httptools
from multidict import CIMultiDict

__all__ = ["UpstreamConnectError", "UpstreamProtocolError"]

_CLOCK_SLACK = 0.001  # uvloop's loop.time() moves in milliseconds: a timer may fire that early
READ_HIGH_WATER = 256 * 1024
"""Bytes of an answer held unread before the connection stops reading the engine's socket
(it reads again once they are taken). Without it an engine streaming to a client that does
not read filled the router's memory as fast as loopback carries bytes: 100 such clients
of endless 64 KiB events took the router to 12.5 GB in seconds
(``benchmarks/bench_slow_clients.py --mode stream``)."""


class UpstreamConnectError(aiohttp.ClientConnectionError):
    """The connection to the engine could not be opened (refused, unreachable, timed out)."""


class UpstreamProtocolError(aiohttp.ClientPayloadError, ValueError):
    """The engine's answer is not valid HTTP/1.1."""


class _Body:
    """The answer's body as it arrives: ``readany``/``iter_any``/``read``, aiohttp's way."""

    __slots__ = ("_conn",)

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    async def readany(self) -> bytes:
        """What has arrived (waiting for something), or b"" at the end of the body."""
        conn = self._conn
        while not conn.chunks and not conn.complete:
            await conn.wait()
        if conn.chunks:
            return conn.take()
        return b""

    async def read(self, n: int = -1) -> bytes:
        if n >= 0:
            return await self.readany()
        return await self._conn.response.read()

    def iter_any(self):
        return self

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        data = await self.readany()
        if not data:
            raise StopAsyncIteration
        return data


class _Response:
    """One engine answer (the subset of ``aiohttp.ClientResponse`` the router reads)."""

    __slots__ = ("_conn", "content", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDict) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self.content = _Body(conn)

    @property
    def content_type(self) -> str:
        raw = self.headers.get("Content-Type")
        if not raw:
            return "application/octet-stream"
        return raw.split(";", 1)[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None

    async def read(self) -> bytes:
        """The whole body, taken as it comes (a connection holds at most
        :data:`READ_HIGH_WATER` unread bytes, then waits until they are taken)."""
        conn = self._conn
        parts = []
        while not conn.complete:
            if conn.chunks:
                parts.append(conn.take())
            await conn.wait()
        parts.append(conn.take())
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with it: a finished answer's connection is reused, an unfinished one closed."""
        self._conn.finish()

    def close(self) -> None:
        self._conn.finish()

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; one request at a time.

    ``pool`` is the deque of idle connections to its engine; when an answer ends cleanly,
    ``on_idle(connection)`` is asked to keep it there (True: pooled; False: it is closed),
    so the session decides (its idle cap, its sweep of old idle connections, whether it
    is still open). Without ``on_idle`` it goes back to ``pool`` while that has room.
    """

    def __init__(self, pool: deque, loop: asyncio.AbstractEventLoop,
                 on_idle: Callable[[_Connection], bool] | None = None) -> None:
        self.pool, self.loop = pool, loop
        self.on_idle = on_idle
        self.transport = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0  # loop time it went back to the pool
        # the connection's one timer, for the deadlines of whichever request it carries
        self._watch_handle: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.headers: CIMultiDict | None = None
        self._header_list: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self._held = 0  # bytes in chunks
        self._reading_paused = False  # the transport's reading, paused at READ_HIGH_WATER
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.response: _Response | None = None
        self.done = False  # the caller finished with this request
        self.sock_read: float | None = None
        self.received = False  # a byte of this request's answer came
        self._total_due: float | None = None  # loop time this request times out, if it does
        self._read_due = 0.0  # loop time the wait in progress times out (sock_read)

    # -- transport callbacks ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"invalid HTTP answer: {exc}"))
            self.transport.abort()
            return
        if self._held > READ_HIGH_WATER and not self._reading_paused:
            self._reading_paused = True  # the reader is behind: the engine's socket waits
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> None:
        self.closed = True  # not reusable; connection_lost follows

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.complete or self.done:
            return
        if self.headers is not None and self.response is not None \
                and self.response.content_length is None \
                and "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            self.complete = True  # a body delimited by the end of the connection
        elif self.headers is None:
            self._fail(aiohttp.ServerDisconnectedError())
        else:
            self._fail(aiohttp.ClientPayloadError("Response payload is not completed"))
        self._wake()

    # -- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.headers = CIMultiDict(self._header_list)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._held += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if not self.parser.should_keep_alive():
            self.closed = True

    # -- the caller's side -----------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def set_deadline(self, due: float) -> None:
        """This request fails with ``asyncio.TimeoutError`` at loop time ``due`` (its
        ``total`` timeout), unless it was finished before."""
        self._total_due = due
        self._watch(due)

    async def wait(self) -> None:
        """Until more of the answer arrived (or it failed, or ``sock_read`` seconds passed
        without a byte: ``ServerTimeoutError``)."""
        if self.error is not None:
            raise self.error
        waiter = self.waiter = self.loop.create_future()
        if self.sock_read is not None:
            self._read_due = self.loop.time() + self.sock_read
            self._watch(self._read_due)
        try:
            await waiter
        finally:
            self.waiter = None
        if self.error is not None:
            raise self.error

    # -- the connection's one timer --------------------------------------------------------
    # A request's deadlines (its total timeout, each wait's read timeout) move with every
    # request and every wait; arming and cancelling a timer for each was a measurable part
    # of the router's work (three per whole request, one more per streamed chunk). Instead
    # the connection keeps one timer, armed when none is or when a deadline comes before
    # it, and left armed when a request ends: when it fires it times out what is due and
    # otherwise moves itself to the next deadline, or stops when there is none (an idle
    # connection), so a busy connection arms about one timer per deadline's length.
    def _watch(self, due: float) -> None:
        """Make sure the timer fires by ``due``."""
        handle = self._watch_handle
        if handle is None or due < handle.when():
            if handle is not None:
                handle.cancel()
            self._watch_handle = self.loop.call_at(due, self._on_watch)

    def _on_watch(self) -> None:
        self._watch_handle = None
        now = self.loop.time() + _CLOCK_SLACK  # uvloop's clock moves in milliseconds
        total = self._total_due
        if total is not None and now >= total:
            self._total_timeout()
            return
        waiting = self.waiter is not None and not self.waiter.done() \
            and self.sock_read is not None
        if waiting and now >= self._read_due:
            self._read_timeout()
            return
        due = self._read_due if waiting else None
        if total is not None:
            due = total if due is None else min(due, total)
        if due is not None:
            self._watch_handle = self.loop.call_at(due, self._on_watch)

    def _read_timeout(self) -> None:
        self._fail(aiohttp.ServerTimeoutError("timeout reading the engine's answer"))
        self._abort()

    def _total_timeout(self) -> None:
        self._fail(asyncio.TimeoutError())
        self._abort()

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def take(self) -> bytes:
        chunks = self.chunks
        if not chunks:
            return b""
        self.chunks = []
        self._held = 0
        if self._reading_paused:
            self._resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _resume_reading(self) -> None:
        self._reading_paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def finish(self) -> None:
        """The caller is done: pool the connection if its answer ended cleanly, else abort."""
        if self.done:
            return
        self.done = True
        self._total_due = None  # the request is over: its deadlines with it
        if self.complete and not self.closed and self.error is None:
            if self._reading_paused:  # a body left unread: the connection reads again
                self._resume_reading()
            self._reset()
            self.idle_since = self.loop.time()
            if self.on_idle is not None:
                if self.on_idle(self):
                    return
            elif len(self.pool) < self.pool.maxlen:
                self.pool.append(self)
                return
        self._abort()
