"""The server side of ``eldr serve`` hardened for untrusted clients: malformed HTTP refused
quietly, request heads that never finish closed, idle keep-alive connections closed.

What aiohttp's server (3.14) does on its own, and why the router needs more:

- **Malformed HTTP** (a header line over 8 KB, too many headers, a control character or a
  bare CR in a header, a request line that is not HTTP): aiohttp answers a plain-text 400
  naming its parser's internals and logs ``Error handling request`` at ERROR with a
  multi-line traceback, once per request: anyone who can reach the port can fill the log.
  Here: vLLM's JSON error document (:func:`eldr.proxy.errors.error_body`), 431 for a header
  line over ``max_field_size`` or more than ``max_headers`` headers, 414 for a request
  line over ``max_line_size``, 400 for the rest, ``Connection: close``; one log line per
  refusal with no traceback, at most one line per ``log_interval`` seconds (the lines
  left out are counted on the next one).
- **Request heads that never finish** (slowloris: a few bytes, then silence): aiohttp has
  no timeout for the request line and headers, only its keep-alive timeout (3,630 s when
  the app runs in an ``AppRunner``, as here), so each such connection holds a file
  descriptor for an hour. Here a request's line and headers must arrive within
  ``header_timeout`` seconds of the connection (or of the request's first byte on a
  kept-alive connection); past it a request that had begun gets a 408 JSON answer, and the
  connection is closed.
- **Idle keep-alive connections** between requests: closed after ``keepalive_timeout``
  (see :data:`KEEPALIVE_TIMEOUT`).

The seam: aiohttp builds one ``RequestHandler`` (``aiohttp.web_protocol``) per connection
from its ``web.Server`` (``Server.__call__``, the protocol factory of the listening
socket). :class:`HardenedAppRunner` serves the app through a :class:`HardenedServer`, whose
connections are :class:`HardenedRequestHandler`: it overrides ``handle_error`` (which
aiohttp calls with its parser's exception for every request it could not parse) and times
the request head in ``connection_made``/``data_received``. ``RequestHandler`` is not public
API: if the installed aiohttp lacks what this uses, the server logs one warning and runs
with aiohttp's own handler (``tests/test_proxy_httpserver.py`` then fails, saying so).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)

from eldr.proxy.errors import error_body

try:
    from aiohttp.web_protocol import RequestHandler
except ImportError:  # pragma: no cover - a future aiohttp may move it
    RequestHandler = None

__all__ = ["HEADER_TIMEOUT", "KEEPALIVE_TIMEOUT", "HardenedAppRunner", "HardenedRequestHandler",
           "HardenedServer", "HttpLimits", "RefusalLog", "classify", "seam_missing"]

log = logging.getLogger("eldr.serve")

HEADER_TIMEOUT = 10.0
"""Seconds a client has to send a request's line and headers, from the moment it connects
(or, on a kept-alive connection, from the request's first byte). A real client sends its
whole head in one write, within milliseconds even over a slow link; 10 s leaves room for a
congested one while a connection that stalls mid-head (a slowloris client, a half-open
socket) gives its file descriptor back within seconds, not the hour of aiohttp's
keep-alive timeout."""

KEEPALIVE_TIMEOUT = 75.0
"""Seconds an idle kept-alive client connection is kept between two requests (aiohttp
3.14's own default in an ``AppRunner`` is 3,630 s). Not shorter, because whoever closes an
idle connection should be the client: a server that closes first races the client's next
request on it, which then fails (for a POST, without a retry). The common client pools
let theirs go sooner (httpx and the openai package 5 s, aiohttp 15 s, Node 4 s), and a
reverse proxy in front of the router keeps its upstream connections up to 60 s by default
(nginx's ``keepalive_timeout``, AWS ALB's idle timeout): 75 s is above all of them, as
nginx's own default is. Not longer, because the router faces clients it does not trust:
an abandoned connection gives its file descriptor back within a minute and a quarter.
Connections that send part of a request and stall are closed by :data:`HEADER_TIMEOUT`."""

LOG_INTERVAL = 10.0
"""Seconds between two log lines about refused requests or connections closed for a late
head: a scanner or a broken client sending thousands of them costs a few lines a minute."""


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The limits of the router's HTTP server (the module doc says why each)."""

    header_timeout: float = HEADER_TIMEOUT
    keepalive_timeout: float = KEEPALIVE_TIMEOUT
    max_line_size: int = 8190  # request line (aiohttp's default)
    max_field_size: int = 8190  # one header line, name and value (aiohttp's default)
    max_headers: int = 128  # header lines (aiohttp 3.14's default; 3.9's was 32768)
    log_interval: float = LOG_INTERVAL

    def handler_kwargs(self) -> dict:
        """What aiohttp's ``RequestHandler`` takes of these (through the runner)."""
        return {"keepalive_timeout": self.keepalive_timeout,
                "max_line_size": self.max_line_size, "max_field_size": self.max_field_size,
                "max_headers": self.max_headers}


class RefusalLog:
    """One log line per refused request or closed connection, at most one per ``interval``
    seconds; the ones in between are counted (``counts``, by status) and the next line
    says how many were left out. One per server, shared by its connections."""

    def __init__(self, logger: logging.Logger = log, interval: float = LOG_INTERVAL,
                 clock=time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self.counts: Counter = Counter()  # status (408 for a late head) → count
        self._next = float("-inf")
        self._left_out = 0

    def note(self, status: int, peer, what: str) -> None:
        self.counts[status] += 1
        now = self.clock()
        if now < self._next:
            self._left_out += 1
            return
        self._next = now + self.interval
        more = ""
        if self._left_out:
            more = f" ({self._left_out} more since the last line, not logged)"
            self._left_out = 0
        self.logger.warning("client %s: %d, %s%s", _peer(peer), status, what, more)


def _peer(peer) -> str:
    if isinstance(peer, (tuple, list)) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) if peer else "?"


def _reason(exc: HttpProcessingError) -> str:
    """The first line of the parser's message, printable ASCII, short: llhttp's reason
    ("Invalid header value char") without the bytes it quotes after it."""
    text = str(getattr(exc, "message", "") or "").strip().splitlines()
    first = text[0].rstrip(": ") if text else ""
    first = "".join(c if " " <= c < "\x7f" else "?" for c in first)
    return first[:120] or "malformed request"


def classify(exc: HttpProcessingError, limits: HttpLimits, line_length: int | None = None,
             head_bytes: int = 0) -> tuple[int, str]:
    """(status, message) for a request aiohttp's parser refused with ``exc``.

    ``line_length``: where the request's first line ended (None: not seen), ``head_bytes``:
    bytes of the request seen, to tell a request line over the limit (414) from a header
    line over it (431); both parsers raise the same ``LineTooLong`` for either.
    """
    if isinstance(exc, LineTooLong):
        if (line_length is None and head_bytes > limits.max_line_size) \
                or (line_length is not None and line_length > limits.max_line_size):
            return 414, f"URI too long: the request line is over {limits.max_line_size} bytes"
        return 431, (f"Request header fields too large: a header line is over "
                     f"{limits.max_field_size} bytes")
    reason = _reason(exc)
    if reason.startswith(("Too many headers", "Too many trailers")):
        return 431, (f"Request header fields too large: more than {limits.max_headers} "
                     f"header lines")
    if isinstance(exc, BadHttpMethod):
        if "HTTPS" in reason:
            return 400, "Invalid HTTP request: TLS (https) sent to the router's http port"
        return 400, "Invalid HTTP request: the request line has no valid method"
    if isinstance(exc, BadStatusLine):
        return 400, "Invalid HTTP request: malformed request line"
    if isinstance(exc, InvalidURLError):
        return 400, "Invalid HTTP request: malformed request target"
    if isinstance(exc, InvalidHeader):  # its message quotes the client's bytes
        return 400, "Invalid HTTP request: malformed header"
    return 400, f"Invalid HTTP request: {reason}"


def _json_response(status: int, message: str) -> web.Response:
    resp = web.Response(status=status, body=error_body(status, message),
                        content_type="application/json", headers={"Connection": "close"})
    resp.force_close()
    return resp


def _raw_answer(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 answer, for a connection with no request object to answer on."""
    from http import HTTPStatus

    body = error_body(status, message)
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode("latin-1") + body


# what HardenedRequestHandler uses of aiohttp's RequestHandler (methods, slots)
_USED = ("handle_error", "connection_made", "connection_lost", "data_received",
         "force_close", "log_exception", "peername", "transport", "_loop", "_messages",
         "_waiter", "_force_close", "_close")


def seam_missing() -> list[str]:
    """What :class:`HardenedRequestHandler` needs of aiohttp's ``RequestHandler`` but the
    installed aiohttp lacks (empty: the hardening is in place)."""
    if RequestHandler is None:
        return ["aiohttp.web_protocol.RequestHandler"]
    return [name for name in _USED if not hasattr(RequestHandler, name)]


if RequestHandler is not None:
    class HardenedRequestHandler(RequestHandler):
        """aiohttp's per-connection protocol, with JSON refusals and a request-head timer
        (the module doc)."""

        __slots__ = ("_head_bytes", "_head_line", "_head_timer", "_limits", "_refusals")

        def __init__(self, manager, *, limits: HttpLimits, refusals: RefusalLog,
                     **kwargs) -> None:
            super().__init__(manager, **kwargs)
            self._limits = limits
            self._refusals = refusals
            self._head_timer = None  # armed while a request's head is awaited
            self._head_bytes = 0  # bytes of that head received so far
            self._head_line = None  # where its first line ended (None: not yet)

        # -- the request head's timer ------------------------------------------------------
        def _reset_head(self) -> None:
            self._head_bytes = 0
            self._head_line = None

        def _arm_head_timer(self):
            self._head_timer = self._loop.call_later(self._limits.header_timeout,
                                                     self._head_timed_out)
            return self._head_timer

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if self.transport is not None and self._limits.header_timeout > 0:
                self._reset_head()
                self._arm_head_timer()  # the first request is due

        def data_received(self, data: bytes) -> None:
            timer = self._head_timer
            begins = False  # a new request's first bytes on a kept-alive connection
            if timer is None and data and self._limits.header_timeout > 0 \
                    and not self._messages and not (self._force_close or self._close):
                waiter = self._waiter
                if waiter is not None and not waiter.done():  # idle: a new request begins
                    begins = True
                    self._reset_head()
            if (begins or timer is not None) and data:
                if self._head_line is None:
                    end = data.find(b"\n")
                    if end >= 0:
                        self._head_line = self._head_bytes + end
                self._head_bytes += len(data)
            super().data_received(data)
            if timer is not None and self._messages:  # parsed (or refused): on time
                timer.cancel()
                if self._head_timer is timer:
                    self._head_timer = None
            elif begins and not self._messages and self.transport is not None \
                    and not (self._force_close or self._close):
                # its head did not come whole in these bytes: it is due within the timeout
                # from now (a head that did, nearly every one, never costs a timer)
                self._arm_head_timer()

        def _head_timed_out(self) -> None:
            self._head_timer = None
            transport = self.transport
            if transport is None or self._force_close:
                return
            limit = f"{self._limits.header_timeout:g} s"
            if self._head_bytes:
                # a request had begun: say why it ends (RFC 9110: 408)
                message = f"Request timeout: the request line and headers took over {limit}"
                transport.write(_raw_answer(408, message))
                self._refusals.note(408, self.peername, message)
            else:
                self._refusals.note(408, self.peername,
                                    f"connection closed: no request within {limit}")
            self.force_close()  # closes the transport once the answer is written

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        # -- refusals ----------------------------------------------------------------------
        def handle_error(self, request, status: int = 500, exc=None, message=None):
            """aiohttp's error answer, as vLLM's JSON document, logged in one line.

            aiohttp calls this for a request its parser refused (``exc`` an
            ``HttpProcessingError``, ``status`` 400), for a handler's exception the app's
            middleware did not answer (500: a bug, logged with its traceback as aiohttp
            does) and for a handler's ``asyncio.TimeoutError`` (504).
            """
            writer = getattr(request, "writer", None)
            if writer is not None and getattr(writer, "output_size", 0) > 0:
                raise ConnectionError("Response is sent already, cannot send another "
                                      "response with the error message")  # as aiohttp
            if isinstance(exc, HttpProcessingError):
                status, text = classify(exc, self._limits, self._head_line, self._head_bytes)
                self._refusals.note(status, self.peername, text)
            elif status == 504:
                text = "Gateway timeout"
            else:
                self.log_exception("Error handling request from %s", request.remote,
                                   exc_info=exc)
                text = "internal error of the router; it was logged"
            return _json_response(status, text)
else:  # pragma: no cover
    HardenedRequestHandler = None


class HardenedServer(web.Server):
    """aiohttp's low-level server, whose connections are :class:`HardenedRequestHandler`
    (aiohttp's own handler, with one warning, if the installed aiohttp lacks the seam)."""

    def __init__(self, handler, *, limits: HttpLimits | None = None, **kwargs) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits or HttpLimits()
        self.refusals = RefusalLog(log, self.limits.log_interval)
        self.hardened = not seam_missing() and hasattr(self, "_loop") \
            and hasattr(self, "_kwargs")
        if not self.hardened:
            log.warning("aiohttp %s lacks what the router's HTTP hardening uses (%s): "
                        "malformed requests get aiohttp's own answers and no request-head "
                        "timeout applies", _aiohttp_version(),
                        ", ".join(seam_missing()) or "Server._loop, Server._kwargs")

    def __call__(self):
        if not self.hardened:
            return super().__call__()
        return HardenedRequestHandler(self, loop=self._loop, limits=self.limits,
                                      refusals=self.refusals, **self._kwargs)


class HardenedAppRunner(web.AppRunner):
    """``web.AppRunner`` serving the app through a :class:`HardenedServer` with ``limits``
    (their keep-alive timeout and parser limits go to aiohttp's handler as well)."""

    __slots__ = ("limits",)

    def __init__(self, app: web.Application, *, limits: HttpLimits | None = None,
                 **kwargs) -> None:
        self.limits = limits or HttpLimits()
        super().__init__(app, **{**self.limits.handler_kwargs(), **kwargs})

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app started, its aiohttp Server
        try:
            return HardenedServer(server.request_handler,
                                  request_factory=server.request_factory,
                                  handler_cancellation=server.handler_cancellation,
                                  loop=server._loop, limits=self.limits, **server._kwargs)
        except (AttributeError, TypeError) as exc:  # pragma: no cover - a future aiohttp
            log.warning("aiohttp %s: the router's HTTP hardening is off (%s)",
                        _aiohttp_version(), exc)
            return server


def _aiohttp_version() -> str:
    import aiohttp

    return aiohttp.__version__
