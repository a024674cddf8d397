"""The generate routes' fast front (eldr.proxy.front), over real sockets: what it answers
itself, what it hands to the hardened aiohttp server (and that those answers are the
hardened ones), pipelining, timeouts, a client that leaves, shutdown.

Timing: limits are small (fractions of a second) but every wait polls against a generous
deadline, so a loaded 2-core machine slows these tests down without failing them.
"""

import asyncio
import contextlib
import json

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("httptools")

from _proxy_fakes import serve_task, served_router
from eldr.proxy.config import ServeConfig
from eldr.proxy.httpserver import HttpLimits


def _post(path: str, doc: dict, *, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    body = json.dumps(doc).encode()
    return (b"POST " + path.encode() + b" HTTP/" + version + b"\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n" + extra + b"Content-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _completion(prompt: str, *, extra: bytes = b"", **kw) -> bytes:
    return _post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3, **kw},
                 extra=extra)


@contextlib.asynccontextmanager
async def front_router(limits: HttpLimits | None = None, **config_kw):
    """The router listening through the front as ``eldr serve`` runs it (fake engines: 1
    prefill, 2 decode); yields (router, port, front, decoders)."""
    async with served_router(limits, front=True, shutdown_timeout=2.0, **config_kw) as (
            router, base, runner, decoders):
        (site,) = runner.sites
        yield router, int(base.rsplit(":", 1)[1]), site.front, decoders


def _served(router) -> float:
    """Requests the front answered itself (``eldr_http_front_requests_total``)."""
    return router.metrics.front_requests.get()


def _handed(router) -> float:
    """Connections the front handed to aiohttp (``eldr_http_front_handoffs_total``)."""
    return sum(router.metrics.front_handoffs.values.values())


class Conn:
    """A raw keep-alive client: write bytes, read whole answers (Content-Length or
    chunked)."""

    async def open(self, port: int) -> "Conn":
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        return self

    def send(self, raw: bytes) -> None:
        self.writer.write(raw)

    async def answer(self, timeout: float = 20.0) -> tuple[int, dict, bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:] if ln)}
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        else:  # chunked
            body = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                body += chunk[:-2]
        return status, headers, body

    async def closed(self, timeout: float = 20.0) -> bool:
        """The server closed the connection (EOF) within ``timeout`` s."""
        try:
            return await asyncio.wait_for(self.reader.read(), timeout) == b""
        except (asyncio.TimeoutError, ConnectionError):
            return False

    def close(self) -> None:
        self.writer.close()


def test_generate_requests_on_one_connection_are_answered_by_the_front():
    async def go():
        async with front_router() as (router, port, _front, _):
            conn = await Conn().open(port)
            answers = []
            for prompt in ("write code now", "a poem about rain", "more code please"):
                conn.send(_completion(prompt))
                answers.append(await conn.answer())
            conn.close()
            return (answers, _served(router), _handed(router), router.metrics.requests.values,
                    router.metrics.front_requests.get())

    answers, served, handed, requests, counted = asyncio.run(go())
    for status, headers, body in answers:
        assert status == 200, body
        assert headers["x-eldr-decoder"] in ("w-code", "w-other")
        assert headers["content-type"].startswith("application/json")
        assert json.loads(body)["choices"]
    assert served == 3 and handed == 0 and counted == 3  # eldr_http_front_requests_total
    assert requests[("completions", "200")] == 3  # counted as behind aiohttp


async def _raw_answer(conn: Conn, timeout: float = 20.0) -> bytes:
    """One whole answer's bytes as they came (head and Content-Length body)."""
    head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), timeout)
    size = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:"))
    return head + await conn.reader.readexactly(size)


def _undated(raw: bytes) -> bytes:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = [b"Date: <now>" if ln.startswith(b"Date: ") else ln for ln in head.split(b"\r\n")]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def test_the_fronts_whole_answers_are_the_bytes_aiohttp_sends():
    """An answer the front writes itself (eldr.proxy.answer.WholeAnswer) is byte for byte
    the one aiohttp writes for the same request, ``Date`` aside: a kept-alive one, and one
    to a client that said ``Connection: close``."""
    requests = [_completion("write code now", extra=b"X-Request-Id: fixed-1\r\n"),
                _completion("a poem about rain", extra=b"X-Request-Id: fixed-2\r\n"
                                                      b"Connection: close\r\n")]

    async def answers(front: bool) -> list[bytes]:
        async with served_router(front=front, shutdown_timeout=2.0) as (_, base, _r, _d):
            port = int(base.rsplit(":", 1)[1])
            out = []
            for raw in requests:
                conn = await Conn().open(port)
                conn.send(raw)
                out.append(_undated(await _raw_answer(conn)))
                conn.close()
            return out

    fast, plain = asyncio.run(answers(True)), asyncio.run(answers(False))
    assert fast == plain
    assert b"Connection: close\r\n" in fast[1] and b"Connection" not in fast[0]
    assert fast[0].startswith(b"HTTP/1.1 200 OK\r\nX-Request-Id: fixed-1\r\n")


def test_pipelined_requests_are_answered_in_order():
    async def go():
        async with front_router() as (router, port, _front, _):
            conn = await Conn().open(port)
            conn.send(_completion("first, code") + _completion("second", max_tokens=2)
                      + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            out = [await conn.answer() for _ in range(3)]
            conn.close()
            return out, _served(router), _handed(router)

    out, served, handed = asyncio.run(go())
    assert [s for s, _, _ in out] == [200, 200, 200]
    texts = [json.loads(b)["choices"][0]["text"] for _, _, b in out[:2]]
    assert len(texts) == 2
    assert json.loads(out[2][2])["status"] in ("ok", "degraded")  # /health, from aiohttp
    assert served == 2 and handed == 1  # the third went to aiohttp, with the connection


@pytest.mark.parametrize("raw, why", [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", "route"),
    (_completion("code", stream=False, extra=b"Expect: 100-continue\r\n"), "framing"),
    (_post("/v1/completions", {"model": "tiny", "prompt": "code"}, version=b"1.0"),
     "framing"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"20\r\n" + json.dumps({"model": "tiny", "prompt": "code now"})[:32].encode()
     + b"\r\n" + b"%x\r\n" % len(json.dumps({"model": "tiny", "prompt": "code now"})[32:])
     + json.dumps({"model": "tiny", "prompt": "code now"})[32:].encode()
     + b"\r\n0\r\n\r\n", "framing"),
], ids=["route", "expect", "http10", "chunked"])
def test_requests_the_front_does_not_serve_are_answered_by_aiohttp(raw, why):
    async def go():
        async with front_router() as (router, port, _front, _):
            conn = await Conn().open(port)
            conn.send(raw)
            if b"Expect" in raw:  # aiohttp says 100 Continue first
                head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 20)
                assert head.startswith(b"HTTP/1.1 100")
            answer = await conn.answer()
            conn.close()
            return answer, _served(router), _handed(router), router.metrics.front_handoffs.values

    (status, _, body), served, handed, reasons = asyncio.run(go())
    assert status == 200, (why, body)
    assert served == 0 and handed == 1, why
    assert reasons == {(why,): 1}  # eldr_http_front_handoffs_total{reason}


@pytest.mark.parametrize("raw, status, words", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n"
     b"Content-Length: 2\r\n\r\n{}", 431, "header line is over 8190 bytes"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-C: a\x01b\r\nContent-Length: 2\r\n\r\n{}",
     400, "Invalid HTTP request"),
    (b"\x00\x01garbage nonsense\r\n\r\n", 400, "Invalid HTTP request"),
    # bare LF line ends, a body holding CRLF CRLF: the front must not read its head's end
    (b"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 20\n\n"
     b'{"prompt": "a\r\n\r\nb"}', 400, "Invalid HTTP request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n\r\n{", 413,
     "larger than 1024 bytes"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{nope", 400,
     "JSON decode error"),
], ids=["long-header", "control-char", "garbage", "lf-only", "too-large", "bad-json"])
def test_malformed_or_oversized_requests_get_the_routers_json_errors(raw, status, words):
    async def go():
        async with front_router(max_body_bytes=1024) as (_, port, _front, _):
            conn = await Conn().open(port)
            conn.send(raw)
            answer = await conn.answer()
            conn.close()
            return answer

    got, _, body = asyncio.run(go())
    assert got == status, body
    doc = json.loads(body)
    assert words in doc["error"]["message"], doc


def test_idle_connections_and_heads_in_pieces_are_timed():
    # keep-alive longer than the head timeout: aiohttp's own keep-alive timer runs from a
    # handed-off connection's start too, and would close the late head silently first
    limits = HttpLimits(header_timeout=0.3, keepalive_timeout=0.8)

    async def go():
        async with front_router(limits=limits) as (_, port, front, _):
            silent = await Conn().open(port)  # never sends a byte
            piece = await Conn().open(port)
            piece.send(b"POST /v1/comp")  # a head that never ends: aiohttp times it
            kept = await Conn().open(port)
            kept.send(_completion("code, then silence"))
            first = await kept.answer()
            out = (await silent.closed(), await piece.answer(), first, await kept.closed())
            for c in (silent, piece, kept):
                c.close()
            return out, front.refusals.counts

    (silent_closed, late, first, kept_closed), refusals = asyncio.run(go())
    assert silent_closed and kept_closed
    assert late[0] == 408 and "took over 0.3 s" in json.loads(late[2])["error"]["message"]
    assert first[0] == 200
    assert refusals[408] >= 2  # the silent connection and the late head


def test_a_client_that_leaves_cancels_its_request_and_frees_the_decoder():
    async def go():
        async with front_router() as (router, port, _front, decoders):
            for d in decoders:
                d.mode = "hang"
            conn = await Conn().open(port)
            conn.send(_completion("code for a client that leaves"))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while not any(d.in_flight for d in router.pool.decode):
                assert loop.time() < deadline, "the decode never started"
                await asyncio.sleep(0.02)
            conn.writer.transport.abort()  # the client is gone
            while any(d.in_flight for d in router.pool.decode):
                assert loop.time() < deadline, "the decode was not cancelled"
                await asyncio.sleep(0.02)
            return router.metrics.client_disconnects.get()

    assert asyncio.run(go()) == 1


def test_streamed_answers_pass_through_the_front():
    async def go():
        async with front_router() as (router, port, _front, _):
            conn = await Conn().open(port)
            conn.send(_completion("stream some code", stream=True))
            answer = await conn.answer()
            conn.close()
            return answer, _served(router)

    (status, headers, body), served = asyncio.run(go())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body.rstrip().endswith(b"data: [DONE]") and served == 1


def test_shutdown_closes_idle_connections_and_lets_answers_finish():
    async def go():
        async with front_router() as (_, port, front, decoders):
            idle = await Conn().open(port)
            idle.send(_completion("code"))
            assert (await idle.answer())[0] == 200
            for d in decoders:
                d.mode = "slow"  # a token every 50 ms
            busy = await Conn().open(port)
            busy.send(_completion("code, slowly", stream=True))
            await asyncio.sleep(0.2)
            stopping = asyncio.ensure_future(front.shutdown(10.0))
            idle_closed = await idle.closed(5)
            answer = await busy.answer()
            await stopping
            return idle_closed, answer, await busy.closed(5)

    idle_closed, (status, _, body), busy_closed = asyncio.run(go())
    assert idle_closed and busy_closed
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")


def test_serve_listens_through_the_front_unless_told_otherwise(monkeypatch):
    from eldr.proxy import front as front_mod

    made = []
    real = front_mod.GenerateFront.__call__

    def counting(self):
        made.append(self)
        return real(self)

    monkeypatch.setattr(front_mod.GenerateFront, "__call__", counting)

    async def one(http_front: str):
        async with serve_task(policy="jsq", http_front=http_front) as port:
            conn = await Conn().open(port)
            conn.send(_completion("code"))
            status = (await conn.answer())[0]
            conn.close()
        return status

    assert asyncio.run(one("fast")) == 200 and len(made) == 1
    assert asyncio.run(one("aiohttp")) == 200 and len(made) == 1
    with pytest.raises(ValueError, match="http_front"):
        ServeConfig(prefill_urls=("http://p",), decode_urls=("http://d",), http_front="h2")
