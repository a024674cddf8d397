"""eldr.proxy.answer: the whole JSON answers the fast front writes, as aiohttp would."""

import asyncio

import pytest

pytest.importorskip("aiohttp")

from aiohttp import web

from eldr.proxy import answer as module
from eldr.proxy.answer import WholeAnswer, http_date, json_answer

_HEADERS = {"X-Request-Id": "r-1", "X-Eldr-Prefill": "p0", "X-Eldr-Decoder": "d1",
            "X-Eldr-Attempts": "1"}


async def _aiohttp_bytes(status: int, body: bytes, close: bool) -> bytes:
    """What aiohttp's server sends for ``json_answer``'s ``web.Response``."""
    async def handler(request):
        return json_answer(request, body, status, dict(_HEADERS))

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                     + (b"Connection: close\r\n" if close else b"") + b"\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        raw = head + await reader.readexactly(len(body))
        writer.close()
        return raw
    finally:
        await runner.cleanup()


def _undated(raw: bytes) -> bytes:
    return b"\r\n".join(b"Date: <now>" if ln.startswith(b"Date: ") else ln
                        for ln in raw.split(b"\r\n"))


@pytest.mark.parametrize("status", [200, 201, 404, 503, 599])
@pytest.mark.parametrize("close", [False, True])
def test_serialize_writes_the_bytes_aiohttp_writes(status, close):
    body = b'{"id": "x", "choices": [{"text": "caf\xc3\xa9"}]}'
    want = asyncio.run(_aiohttp_bytes(status, body, close))
    got = WholeAnswer(status, dict(_HEADERS), body).serialize(keep_alive=not close)
    assert _undated(got) == _undated(want)


def test_a_request_of_the_front_gets_a_whole_answer_others_a_web_response():
    class Front(dict):
        writes_whole_answers = True

    out = json_answer(Front(), b"{}", 200, {"X-Request-Id": "a"})
    assert type(out) is WholeAnswer and out.status == 200 and out.body == b"{}"
    plain = json_answer(object(), b"{}", 200, {"X-Request-Id": "a"})
    assert isinstance(plain, web.Response) and plain.content_type == "application/json"


def test_a_header_with_a_line_break_is_refused():
    with pytest.raises(ValueError, match="line break"):
        WholeAnswer(200, {"X-Request-Id": "a\r\nSet-Cookie: x"}, b"{}").serialize(True)


def test_the_date_is_formatted_once_a_second(monkeypatch):
    monkeypatch.setattr(module, "_date", (0, ""))
    assert http_date(lambda: 1_800_000_000.2) == "Fri, 15 Jan 2027 08:00:00 GMT"
    monkeypatch.setattr(module, "formatdate", lambda *a, **k: pytest.fail("formatted again"))
    assert http_date(lambda: 1_800_000_000.9) == "Fri, 15 Jan 2027 08:00:00 GMT"
