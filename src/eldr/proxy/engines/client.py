"""The router's HTTP/1.1 client to the engines: keep-alive connections, httptools parsing.

Why not aiohttp's ``ClientSession`` for every call: per upstream request it builds a URL
object, a request and a response object, merges default and per-request headers, runs a
cookie jar and a tracing hook: a large share of the router's CPU per request under load
(docs/serve.md, "Overhead": ``benchmarks/bench_serve.py`` and py-spy), for two requests that
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

from eldr.proxy.engines.connection import (
    UpstreamConnectError,
    UpstreamProtocolError,
    _Connection,
    _Response,
)

__all__ = ["UpstreamConnectError", "UpstreamProtocolError", "UpstreamSession"]

_DEFAULT_TIMEOUT = aiohttp.ClientTimeout(total=300, sock_connect=30)  # aiohttp's default

MAX_IDLE = 64
"""Idle keep-alive connections kept per engine. What a burst leaves behind: each idle one
holds a file descriptor in the router and a socket in the engine, and after a burst of
1,000 concurrent requests up to that many were left, when 256 were kept per engine. A
decoder running hundreds of requests needs as many connections, but in use, and those
are never capped; between requests a connection is idle for milliseconds, so the pool
needs to cover only the swings of the number of requests in flight, and what it does not
cover costs a new connection (a local TCP handshake, well under a millisecond next to a
prefill or decode of tens of milliseconds or more)."""

_SWEEP_SLACK = 0.5
"""Seconds a sweep may come after the first idle connection expires, so one sweep closes
all those expiring close together (at most two sweeps a second)."""


class UpstreamSession:
    """Requests to the engines over pooled keep-alive connections (see the module doc).

    ``fallback`` (an ``aiohttp.ClientSession``) serves what this does not: https URLs and
    keyword arguments other than ``data``, ``json``, ``headers``, ``timeout``. It is closed
    with this session.

    Idle connections: at most ``max_idle`` per engine are kept (connections in use are
    never capped: a decode never waits for one), and one idle for longer than
    ``keepalive_expiry`` is closed by a sweep, a timer armed only while some connection is
    idle, not only when the pool is next used: after a burst, the router's file
    descriptors come back within seconds even if no request follows.
    """

    def __init__(self, fallback, *, max_idle: int = MAX_IDLE,
                 keepalive_expiry: float = 4.0) -> None:
        self.fallback = fallback
        self.max_idle = max_idle  # idle connections kept per engine
        # an idle connection older than this is closed, not reused: below uvicorn's 5 s
        # keep-alive, so the engine does not close it just as a request goes out on it
        self.keepalive_expiry = keepalive_expiry
        self._pools: dict[tuple[str, int], deque] = {}
        self._targets: dict[str, tuple | None] = {}
        self._sweep: asyncio.TimerHandle | None = None  # the next sweep of idle connections
        self._closed = False

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
        fresh = None  # the error that made the request go once more on a new connection
        while True:
            try:
                conn, reused = await self._connect(loop, host, port, timeout, deadline,
                                                   fresh is not None)
            except UpstreamConnectError:
                if fresh is not None:  # the engine may have read the request, then died:
                    raise fresh from None  # its first failure is the truth, not "connect"
                raise
            if deadline is not None:
                conn.set_deadline(deadline)
            conn.sock_read = timeout.sock_read
            try:
                conn.transport.write(payload)
                while conn.headers is None:
                    await conn.wait()
            except BaseException as exc:
                conn.done = False
                conn.complete = False
                silent = not conn.received
                conn.finish()  # aborts: the answer never started
                if reused and silent and isinstance(exc, (aiohttp.ServerDisconnectedError,
                                                          ConnectionResetError)):
                    fresh = exc  # the engine closed a kept-alive connection as it went out:
                    continue  # it read nothing of the request; once more, on a new one
                raise
            conn.response = _Response(conn, conn.parser.get_status_code(), conn.headers)
            return conn.response

    async def _connect(self, loop, host: str, port: int, timeout, deadline,
                       fresh: bool = False) -> tuple[_Connection, bool]:
        """(a connection, whether it was reused): an idle pooled one younger than
        ``keepalive_expiry`` unless ``fresh``, else a new one."""
        pool = self._pools.get((host, port))
        if pool is None:
            pool = self._pools[(host, port)] = deque(maxlen=self.max_idle)
        while pool and not fresh:
            conn = pool.pop()
            if conn.closed or conn.transport.is_closing():
                continue
            if loop.time() - conn.idle_since > self.keepalive_expiry:
                conn._abort()  # the engine may be closing it right now
                continue
            return conn, True
        limit = timeout.sock_connect or timeout.connect
        if deadline is not None:
            left = deadline - loop.time()
            limit = left if limit is None else min(limit, left)
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(pool, loop, self._idle), host,
                                       port), limit)
        except asyncio.TimeoutError:
            raise UpstreamConnectError(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn, False

    def _idle(self, conn: _Connection) -> bool:
        """``conn``'s answer ended cleanly: keep it in its pool (True) if the session is
        open and the pool has room, and make sure a sweep is due; else it is closed."""
        pool = conn.pool
        if self._closed or len(pool) >= self.max_idle:
            return False
        pool.append(conn)
        if self._sweep is None:
            self._sweep = conn.loop.call_at(
                conn.idle_since + self.keepalive_expiry + _SWEEP_SLACK, self._sweep_idle,
                conn.loop)
        return True

    def _sweep_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the idle connections older than ``keepalive_expiry`` (and those the engine
        closed); arm the next sweep for the oldest one left, if any.

        A pool takes and returns connections at its right end, so its left end holds the
        longest idle: the sweep stops at the first one that is young enough.
        """
        self._sweep = None
        now = loop.time()
        due = None
        for pool in self._pools.values():
            while pool:
                conn = pool[0]
                if conn.closed or conn.transport.is_closing() \
                        or now - conn.idle_since > self.keepalive_expiry:
                    pool.popleft()
                    conn._abort()
                    continue
                expires = conn.idle_since + self.keepalive_expiry
                due = expires if due is None else min(due, expires)
                break
        if due is not None and not self._closed:
            self._sweep = loop.call_at(due + _SWEEP_SLACK, self._sweep_idle, loop)

    def idle_connections(self) -> int:
        """Idle connections kept now, all engines together."""
        return sum(len(pool) for pool in self._pools.values())

    async def close(self) -> None:
        """Close the idle connections and the fallback session; a request still in flight
        has its connection closed when it ends (never pooled again)."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
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
