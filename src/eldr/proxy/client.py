"""The router's HTTP/1.1 client to the engines: keep-alive connections, httptools parsing.

Why not aiohttp's ``ClientSession`` for every call: per upstream request it builds a URL
object, a request and a response object, merges default and per-request headers, runs a
cookie jar and a tracing hook; measured under load (``benchmarks/bench_serve.py``,
py-spy) that was about a third of the router's CPU per request, for two requests that
are always the same shape (a POST of a JSON body to a known engine, a JSON or SSE answer).
:class:`UpstreamSession` does only that: one pool of idle keep-alive connections per
engine, a request written as one buffer, the answer parsed by ``httptools`` (llhttp, the
parser of Node.js and uvicorn: chunked bodies, keep-alive rules).

It offers exactly the subset of ``aiohttp.ClientSession`` the router uses, with the same
meaning, so the request flow is unchanged: ``post``/``get``/``request(method, url,
data=|json=, headers=, timeout=aiohttp.ClientTimeout)`` usable as ``async with`` or
awaited; a response with ``status``, ``headers``, ``content_type``, ``content_length``, ``read()``,
``content.readany()``/``iter_any()``, ``release()`` and ``close()`` (which aborts an
unfinished answer: the engine sees the connection close and stops). Errors are aiohttp's
kinds (``asyncio.TimeoutError`` for every timeout, ``aiohttp.ServerDisconnectedError``,
``aiohttp.ClientPayloadError``) plus :class:`UpstreamConnectError` (the connection could
not be opened: no byte reached the engine) and :class:`UpstreamProtocolError`. Anything
else (https, other keyword arguments) goes to the aiohttp session it wraps.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections import deque
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict

__all__ = ["UpstreamConnectError", "UpstreamProtocolError", "UpstreamSession"]

_DEFAULT_TIMEOUT = aiohttp.ClientTimeout(total=300, sock_connect=30)  # aiohttp's default


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
        conn = self._conn
        while not conn.complete:
            await conn.wait()
        return conn.take()

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
    """One keep-alive connection to an engine; one request at a time."""

    def __init__(self, pool: deque, loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.loop = pool, loop
        self.transport = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.headers: CIMultiDict | None = None
        self._header_list: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.response: _Response | None = None
        self.done = False  # the caller finished with this request
        self.sock_read: float | None = None
        self.timer: asyncio.TimerHandle | None = None  # the total deadline

    # -- transport callbacks ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"invalid HTTP answer: {exc}"))
            self.transport.abort()
            return
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

    async def wait(self) -> None:
        """Until more of the answer arrived (or it failed, or a timeout)."""
        if self.error is not None:
            raise self.error
        waiter = self.waiter = self.loop.create_future()
        handle = None if self.sock_read is None else self.loop.call_later(
            self.sock_read, self._read_timeout)
        try:
            await waiter
        finally:
            self.waiter = None
            if handle is not None:
                handle.cancel()
        if self.error is not None:
            raise self.error

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
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def finish(self) -> None:
        """The caller is done: pool the connection if its answer ended cleanly, else abort."""
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        if self.complete and not self.closed and self.error is None \
                and len(self.pool) < self.pool.maxlen:
            self._reset()
            self.pool.append(self)
        else:
            self._abort()


class UpstreamSession:
    """Requests to the engines over pooled keep-alive connections (see the module doc).

    ``fallback`` (an ``aiohttp.ClientSession``) serves what this does not: https URLs and
    keyword arguments other than ``data``, ``json``, ``headers``, ``timeout``. It is closed
    with this session.
    """

    def __init__(self, fallback, *, max_idle: int = 256) -> None:
        self.fallback = fallback
        self.max_idle = max_idle  # idle connections kept per engine
        self._pools: dict[tuple[str, int], deque] = {}
        self._targets: dict[str, tuple | None] = {}

    def _target(self, url: str) -> tuple | None:
        """(host, port, path, head prefix) of an http URL, or None (use the fallback)."""
        try:
            return self._targets[url]
        except KeyError:
            pass
        parts = urlsplit(url)
        target = None
        if parts.scheme == "http" and parts.hostname and not parts.username \
                and not parts.fragment:
            port = parts.port or 80
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
            hostport = host if port == 80 else f"{host}:{port}"
            target = (parts.hostname, port, path, hostport)
        if len(self._targets) < 4096:  # the engines' handful of URLs; never unbounded
            self._targets[url] = target
        return target

    def post(self, url: str, *, data=None, json=None, headers=None, timeout=None, **kw):
        return self._request("POST", url, data, json, headers, timeout, kw)

    def get(self, url: str, *, headers=None, timeout=None, **kw):
        return self._request("GET", url, None, None, headers, timeout, kw)

    def request(self, method: str, url: str, *, data=None, json=None, headers=None,
                timeout=None, **kw):
        """Any method; GET and POST take the fast path, the rest (HEAD...) aiohttp."""
        if method not in ("GET", "POST"):
            return self.fallback.request(method, url, data=data, json=json, headers=headers,
                                         timeout=timeout, **kw)
        return self._request(method, url, data, json, headers, timeout, kw)

    def _request(self, method, url, data, json, headers, timeout, kw):
        target = None if kw else self._target(url)
        if target is None or not (data is None or isinstance(data, (bytes, bytearray))):
            return self.fallback.request(method, url, data=data, json=json, headers=headers,
                                         timeout=timeout, **kw)
        if json is not None:
            data = jsonlib.dumps(json).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        return _RequestContext(self._send(method, target, data, headers,
                                          timeout or _DEFAULT_TIMEOUT))

    async def _send(self, method: str, target: tuple, data, headers, timeout) -> _Response:
        host, port, path, hostport = target
        head = [f"{method} {path} HTTP/1.1\r\nHost: {hostport}\r\n"]
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} contains a line break")
            head.append(f"{name}: {value}\r\n")
        if data is not None or method == "POST":
            head.append(f"Content-Length: {len(data) if data is not None else 0}\r\n")
        head.append("\r\n")
        payload = "".join(head).encode("latin-1")
        if data:
            payload += data
        loop = asyncio.get_running_loop()
        deadline = None if timeout.total is None else loop.time() + timeout.total
        conn = await self._connect(loop, host, port, timeout, deadline)
        if deadline is not None:
            conn.timer = loop.call_at(deadline, conn._total_timeout)
        conn.sock_read = timeout.sock_read
        try:
            conn.transport.write(payload)
            while conn.headers is None:
                await conn.wait()
        except BaseException:
            conn.done = False
            conn.complete = False
            conn.finish()  # aborts: the answer never started
            raise
        conn.response = _Response(conn, conn.parser.get_status_code(), conn.headers)
        return conn.response

    async def _connect(self, loop, host: str, port: int, timeout, deadline) -> _Connection:
        pool = self._pools.get((host, port))
        if pool is None:
            pool = self._pools[(host, port)] = deque(maxlen=self.max_idle)
        while pool:
            conn = pool.pop()
            if not conn.closed and not conn.transport.is_closing():
                return conn
        limit = timeout.sock_connect or timeout.connect
        if deadline is not None:
            left = deadline - loop.time()
            limit = left if limit is None else min(limit, left)
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(pool, loop), host, port), limit)
        except asyncio.TimeoutError:
            raise UpstreamConnectError(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    async def close(self) -> None:
        for pool in self._pools.values():
            while pool:
                conn = pool.pop()
                if conn.transport is not None:
                    conn.transport.close()
        self._pools.clear()
        await self.fallback.close()


class _RequestContext:
    """``await session.post(...)`` or ``async with session.post(...) as resp``."""

    __slots__ = ("_coro", "_resp")

    def __init__(self, coro) -> None:
        self._coro = coro
        self._resp = None

    def __await__(self):
        return self._coro.__await__()

    async def __aenter__(self) -> _Response:
        self._resp = await self._coro
        return self._resp

    async def __aexit__(self, *exc) -> None:
        self._resp.release()
