"""The relay's whole JSON answers, as the fast front writes them itself.

Why. Nearly every non-streamed answer is small (the relay sends one under
:data:`~eldr.proxy.bodies.SMALL_ANSWER` in one piece). Behind aiohttp it is a
``web.Response``, whose construction and ``prepare`` (header merging, the writer's state
machine) took about 5 µs of each request in a py-spy profile of ``eldr serve``
(docs/serve.md, "The router's own time"). A request the fast front
(:mod:`eldr.proxy.front`) serves gets a :class:`WholeAnswer` instead: status, headers and
body, written in one piece with the headers aiohttp would add, in aiohttp's order
(``Content-Type``, ``Content-Length``, ``Date``, ``Server``, and ``Connection: close`` when
the connection ends with it): the same bytes on the wire
(``tests/test_proxy_front.py`` compares them with aiohttp's own). A request aiohttp
serves gets the ``web.Response`` as before.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

__all__ = ["WholeAnswer", "http_date", "json_answer"]

_REASONS = {s.value: s.phrase for s in HTTPStatus}


class WholeAnswer:
    """A whole JSON answer (``status``, the handler's ``headers``, ``body`` bytes) that the
    front writes itself (:meth:`serialize`); read as a ``web.Response`` is by the router's
    middleware and its learner (``status``, ``headers``, ``body``)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def serialize(self, keep_alive: bool) -> bytes:
        """The answer's bytes on the wire, as aiohttp's writer sends a ``web.Response``
        of this status, headers, JSON body (HTTP/1.1); ``keep_alive`` False adds
        ``Connection: close``. ValueError for a header with a line break (aiohttp's
        refusal too)."""
        headers = self.headers
        if any("\r" in v or "\n" in v for v in headers.values()):
            raise ValueError(f"a header of the answer holds a line break: {headers!r}")
        lines = [f"HTTP/1.1 {self.status} {_REASONS.get(self.status, '')}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append(f"Content-Type: application/json\r\nContent-Length: {len(self.body)}"
                     f"\r\nDate: {http_date()}\r\nServer: {SERVER_SOFTWARE}")
        if not keep_alive:
            lines.append("Connection: close")
        lines.append("\r\n")
        return "\r\n".join(lines).encode("latin-1") + self.body


_date: tuple[int, str] = (0, "")


def http_date(clock=time.time) -> str:
    """The ``Date`` header's value now (RFC 9110's IMF-fixdate), formatted once a second."""
    global _date
    now = int(clock())
    if now != _date[0]:
        _date = (now, formatdate(now, usegmt=True))
    return _date[1]


def json_answer(request, body: bytes, status: int, headers: dict[str, str]):
    """The whole JSON answer ``body`` to ``request``: a :class:`WholeAnswer` when the fast
    front serves it (its request class says ``writes_whole_answers``), else the
    ``web.Response`` aiohttp writes."""
    if getattr(type(request), "writes_whole_answers", False):
        return WholeAnswer(status, headers, body)
    return web.Response(body=body, status=status, headers=headers,
                        content_type="application/json")
