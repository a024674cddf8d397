"""The generate routes' fast front: a connection protocol that serves the common OpenAI
request itself and hands every other one, whole, to the hardened aiohttp server.

Why. Most of what ``eldr serve`` spends per request above a bare relay is aiohttp's server
side: its request handler task, the ``web.Request`` it builds (URL parsing, lazy
properties), the application's router and middleware chain (issue 32's floor measurement,
docs/serve.md "The router's own time"). The generate routes need none of it: a POST to
``/v1/completions`` or ``/v1/chat/completions`` with a ``Content-Length`` body is parsed
here by ``httptools`` (the parser uvicorn uses; an ``eldr[serve]`` dependency), given to
the router's own handler (:meth:`Router.generate
<eldr.proxy.app.Router.generate>` under its error middleware, exactly as aiohttp calls
them) as a small request object, and the handler's answer (an aiohttp ``web.Response`` or
``web.StreamResponse``: the relay is unchanged) is written through aiohttp's own response
writer. So the answers, their headers, the errors, the metrics and the relay's write
timeouts are the same as behind aiohttp.

What is handed off. Anything else on the connection goes to aiohttp's hardened handler
(:mod:`eldr.proxy.httpserver`), with every byte the front has read of it, and the
connection stays there: other routes and methods, a request head that did not come whole
in one read, a malformed one (aiohttp's parser refuses it with the JSON errors and the log
lines the hardening gives), a head over the server's line, field or header-count limits,
a chunked body, ``Expect``, an upgrade, HTTP/1.0, a ``Content-Length`` over
``max_body_bytes`` (aiohttp answers it 413). The hardened handler then times the request
head from the hand-off on, and keeps its own idle timeout.

What the front itself keeps. A new connection's first request is due within
``header_timeout`` (none: closed, and counted in the refusal log as aiohttp's hardened
handler counts it); an idle kept-alive connection is closed after ``keepalive_timeout``.
A client that leaves cancels its request's handler (aiohttp's ``handler_cancellation``,
what ``eldr serve`` runs with). Pipelined requests are answered in order; while one runs,
the bytes of the next ones are held, at most :data:`PIPELINE_BYTES` before the connection
stops being read. On shutdown the front stops accepting, closes idle connections and lets
the requests in flight finish within the runner's shutdown timeout.
"""

from __future__ import annotations

import asyncio
import logging

import httptools
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import HttpVersion11, StreamWriter
from aiohttp.tcp_helpers import tcp_nodelay
from multidict import CIMultiDict, CIMultiDictProxy

from eldr.proxy.answer import WholeAnswer
from eldr.proxy.errors import error_body
from eldr.proxy.httpserver import HttpLimits, RefusalLog
from eldr.proxy.metrics import FRONT_HANDOFF_REASONS

__all__ = ["GENERATE_PATHS", "HANDOFF_REASONS", "PIPELINE_BYTES", "FrontConnection",
           "FrontRequest", "FrontSite", "GenerateFront", "front_site"]

log = logging.getLogger("eldr.serve")

GENERATE_PATHS = frozenset({b"/v1/completions", b"/v1/chat/completions"})
PIPELINE_BYTES = 1 << 20
"""Bytes of pipelined requests held while one runs; past them the connection is not read
until it is answered (a client that pipelines without bound cannot grow the router)."""

HANDOFF_REASONS = FRONT_HANDOFF_REASONS
"""Why a connection went to aiohttp (``eldr_http_front_handoffs_total{reason}``): another
route or method; a head that did not come whole in one read; a request the parser refused;
a request line, header line or header count over the server's limits; no, several or too
large a ``Content-Length``; chunked, ``Expect``, an upgrade, HTTP/1.0, bare-LF line ends."""

# a header the front never serves: the request goes to aiohttp whole
_HANDED_HEADERS = frozenset({"transfer-encoding", "expect", "upgrade"})


class FrontRequest(dict):
    """What the router's generate handler and aiohttp's response writer read of a request
    (the subset of ``aiohttp.web.Request`` they use); its items are the handler's own
    per-request state, as a ``web.Request``'s are."""

    __slots__ = ("_body", "_payload_writer", "content_length", "headers", "keep_alive",
                 "method", "path", "task", "transport", "version")

    def __init__(self, path: str, headers: CIMultiDictProxy, body: bytes, transport,
                 writer: StreamWriter, keep_alive: bool) -> None:
        super().__init__()
        self.method = "POST"
        self.path = path
        self.headers = headers
        self._body = body
        self.content_length = len(body)
        self.transport = transport
        self._payload_writer = writer
        self.version = HttpVersion11
        self.keep_alive = keep_alive
        self.task: asyncio.Task | None = None

    writes_whole_answers = True  # the relay answers it with a WholeAnswer (eldr.proxy.answer)

    __hash__ = object.__hash__  # keyed by identity, as aiohttp's requests are

    def __eq__(self, other) -> bool:
        return self is other

    @property
    def remote(self) -> str | None:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return peer[0] if isinstance(peer, (tuple, list)) and peer else None

    async def read(self) -> bytes:
        return self._body

    async def _prepare_hook(self, response) -> None:  # aiohttp's on_response_prepare: none
        return None


class GenerateFront:
    """The listening socket's protocol factory: one :class:`FrontConnection` per client.

    ``handler(request)``: the router's generate handler under its error middleware (an
    aiohttp response, never an exception but the client's cancellation); ``server``: the
    hardened aiohttp server connections are handed to; ``limits``: its limits (the front
    hands off a head over them); ``max_body``: the largest body the front reads (larger
    ones are aiohttp's to refuse); ``metrics``: the router's ``RouterMetrics``, counting
    what the front served and handed off."""

    def __init__(self, handler, server, *, metrics, limits: HttpLimits | None = None,
                 max_body: int, refusals: RefusalLog | None = None) -> None:
        self.handler = handler
        self.metrics = metrics  # RouterMetrics: front_requests, front_handoffs
        self.server = server
        self.limits = limits or HttpLimits()
        self.max_body = max_body
        self.refusals = refusals or getattr(server, "refusals", None) or RefusalLog(log)
        self.connections: set[FrontConnection] = set()
        self.closing = False

    def __call__(self) -> FrontConnection:
        return FrontConnection(self, asyncio.get_running_loop())

    async def shutdown(self, timeout: float) -> None:
        """Close idle connections now; let the busy ones finish within ``timeout`` s."""
        self.closing = True
        for conn in list(self.connections):
            if conn.task is None:
                conn.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.close()


class FrontConnection(BaseProtocol):
    """One client connection while the front serves it (the module doc says what it
    serves and what it hands off). A ``BaseProtocol`` for aiohttp's writer: its flow
    control (pause/resume writing, drain) is aiohttp's."""

    def __init__(self, front: GenerateFront, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.front = front
        self.task: asyncio.Task | None = None  # the request being answered
        self._buf = bytearray()  # every byte of the request being read (for a hand-off)
        self._held = bytearray()  # bytes that came while a request was answered
        self._timer: asyncio.TimerHandle | None = None
        self._gone = False  # handed off or closed
        self._parser = None
        self._reset()

    # -- connection --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        tcp_nodelay(transport, True)
        self.front.connections.add(self)
        self._arm(self.front.limits.header_timeout, first=True)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.front.connections.discard(self)
        self._gone = True
        self._disarm()
        if self.task is not None:  # the client left: its handler is cancelled
            self.task.cancel()

    def close(self) -> None:
        if self.transport is not None and not self._gone:
            self.transport.close()

    def _arm(self, seconds: float, *, first: bool = False) -> None:
        self._disarm()
        if seconds > 0:
            self._timer = self._loop.call_later(seconds, self._idle, first, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle(self, first: bool, seconds: float) -> None:
        """No request came: a new connection's first within ``header_timeout`` (counted
        as aiohttp's hardened handler counts it), or the next one within the keep-alive."""
        self._timer = None
        if self.task is not None or self._gone or self.transport is None:
            return
        if first:
            peer = self.transport.get_extra_info("peername")
            self.front.refusals.note(408, peer, f"connection closed: no request within "
                                                f"{seconds:g} s")
        self.close()

    # -- reading -----------------------------------------------------------------------
    def _reset(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._head_done = False
        self._complete: FrontRequest | None = None
        self._hand: str | None = None  # why this request goes to aiohttp (HANDOFF_REASONS)

    def data_received(self, data: bytes) -> None:
        if self._gone:
            return
        if self.task is not None:  # pipelined: held until the answer is out
            self._held += data
            if len(self._held) > PIPELINE_BYTES and self.transport is not None:
                self.transport.pause_reading()
            return
        self._disarm()
        self._buf += data
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            if self._complete is None:  # (a pipelined next one is read after the answer)
                self._hand = self._hand or "malformed"  # aiohttp refuses it
        if self._complete is not None and not self._hand:
            head = self._head_end()
            if head >= 0:
                self._start(self._complete, head)
                return
            self._hand = "framing"
        if self._hand or not self._head_done:  # a head in pieces: aiohttp times it
            self._hand_off(self._hand or "head_in_pieces")

    # httptools' callbacks: only the first request of self._buf is read
    def on_url(self, url: bytes) -> None:
        if self._complete is None:
            self._url += url
            if len(self._url) > self.front.limits.max_line_size - 16:
                self._hand = "limits"

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._complete is not None or self._hand:
            return
        limits = self.front.limits
        if len(name) + len(value) + 2 > limits.max_field_size or \
                len(self._headers) >= limits.max_headers:
            self._hand = "limits"
            return
        key = name.decode("utf-8", "surrogateescape")
        if key.lower() in _HANDED_HEADERS:
            self._hand = "framing"
            return
        self._headers.append((key, value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        if self._complete is not None:
            return
        self._head_done = True
        p = self._parser
        if self._hand:
            return
        if p.get_method() != b"POST" or self._url not in GENERATE_PATHS:
            self._hand = "route"
            return
        if p.get_http_version() != "1.1":
            self._hand = "framing"
            return
        headers = CIMultiDict(self._headers)
        declared = headers.getall("Content-Length", [])
        if len(declared) != 1 or not declared[0].isdigit() or \
                int(declared[0]) > self.front.max_body:
            self._hand = "body"
            return
        self._headers_doc = CIMultiDictProxy(headers)
        self._length = int(declared[0])
        self._keep_alive = p.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self._complete is None and not self._hand:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._complete is not None or self._hand or not self._head_done:
            return
        body = b"".join(self._body)
        if len(body) != self._length:  # pragma: no cover - httptools framed it
            self._hand = "body"
            return
        self._complete = FrontRequest(self._url.decode("ascii", "replace"), self._headers_doc,
                                      body, self.transport, StreamWriter(self, self._loop),
                                      self._keep_alive)

    # -- handing off -------------------------------------------------------------------
    def _hand_off(self, reason: str) -> None:
        """Give the connection, and every byte of its current request, to aiohttp's
        hardened handler for good (``reason``: one of :data:`HANDOFF_REASONS`)."""
        transport = self.transport
        self._gone = True
        self._disarm()
        self.front.connections.discard(self)
        self.front.metrics.front_handoffs.inc(reason=reason)
        if transport is None or transport.is_closing():
            return
        handler = self.front.server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._paused:  # the transport's flow control state goes with it
            handler.pause_writing()
        data, self._buf = bytes(self._buf), bytearray()
        if data:
            handler.data_received(data)

    # -- answering ---------------------------------------------------------------------
    def _head_end(self) -> int:
        """Where the current request's body starts in the bytes read, or -1 when its head
        did not end with CRLF CRLF (a lenient line ending: then its end is not known
        here, and aiohttp's parser reads it)."""
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0 or buf.find(b"\n\n", 0, end) >= 0 or buf.find(b"\n\r\n", 0, end + 4) != end + 1:
            return -1
        return end + 4

    def _start(self, request: FrontRequest, head: int) -> None:
        """Answer ``request``, whose body starts at ``head`` in the bytes read; what
        follows it is a pipelined request's, held."""
        self._held = bytearray(self._buf[head + request.content_length:])  # pipelined
        self._buf = bytearray()
        self.task = request.task = self._loop.create_task(self._answer(request))

    async def _answer(self, request: FrontRequest) -> None:
        keep = False
        try:
            try:
                resp = await self.front.handler(request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # outside the router's middleware: a bug of ours
                log.error("Error handling request from %s", request.remote, exc_info=exc)
                resp = web.Response(status=500, content_type="application/json",
                                    body=error_body(500, "internal error of the router; it "
                                                         "was logged"))
                resp.force_close()
            if type(resp) is WholeAnswer:  # written here, in one piece (eldr.proxy.answer)
                keep = request.keep_alive
                data = resp.serialize(keep)
                if self._gone or self.transport is None or self.transport.is_closing():
                    raise ConnectionResetError("the client's connection is closed")
                self.transport.write(data)
            else:
                await resp.prepare(request)
                await resp.write_eof()
                keep = resp.keep_alive
            keep = keep and not self.front.closing
            self.front.metrics.front_requests.inc()
        except asyncio.CancelledError:  # the client left (or the router stops)
            return
        except ConnectionError as exc:  # the client went while it was written to
            log.debug("front: the answer to %s was not written: %r", request.remote, exc)
        except Exception:  # a bug of ours: logged, the connection closed
            log.exception("front: answering %s failed", request.remote)
        finally:
            self.task = None
            if not keep:
                self.close()
        if not keep or self._gone or self.transport is None:
            return
        self._next_request()

    def _next_request(self) -> None:
        """After an answer on a kept-alive connection: read the held bytes (pipelined
        requests), else wait ``keepalive_timeout`` for the next request."""
        self._reset()
        held, self._held = bytes(self._held), bytearray()
        self.transport.resume_reading()  # a no-op unless held bytes paused it
        if held:
            self.data_received(held)
        else:
            self._arm(self.front.limits.keepalive_timeout)


def front_site(runner, router, host: str, port: int, **kwargs) -> FrontSite:
    """The site ``eldr serve`` listens on: ``router``'s generate routes through a
    :class:`GenerateFront` (its metrics counting), everything else handed to ``runner``'s
    hardened server within its limits (``kwargs``: ``TCPSite``'s, e.g. ``backlog``)."""
    def front_for(server) -> GenerateFront:
        return GenerateFront(router.serve_generate, server, metrics=router.metrics,
                             limits=getattr(runner, "limits", None),
                             max_body=router.config.max_body_bytes)

    return FrontSite(runner, host, port, front_for=front_for, **kwargs)


class FrontSite(web.TCPSite):
    """aiohttp's ``TCPSite`` listening through a :class:`GenerateFront` (the runner's
    server stays what requests are handed off to); stopping it stops the front's
    connections too."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, front_for,
                 **kwargs) -> None:
        super().__init__(runner, host, port, **kwargs)
        self._front_for = front_for  # runner.server -> GenerateFront
        self.front: GenerateFront | None = None

    async def start(self) -> None:
        self._runner._reg_site(self)
        loop = asyncio.get_running_loop()
        self.front = self._front_for(self._runner.server)
        self._server = await loop.create_server(
            self.front, self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)

    async def stop(self) -> None:
        await super().stop()
        if self.front is not None:
            await self.front.shutdown(getattr(self._runner, "_shutdown_timeout", 60.0))
