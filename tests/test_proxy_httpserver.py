"""The router's hardened HTTP server (eldr.proxy.httpserver), over real sockets: malformed
requests, request heads that never finish, idle connections, file descriptors after a burst.

Timing: limits are small (fractions of a second) but every wait polls against a generous
deadline, so a loaded 2-core machine slows these tests down without failing them.
"""

import asyncio
import json
import logging
import os

import aiohttp
import pytest
from aiohttp import web

from _proxy_fakes import serve_task, served_router
from eldr.proxy import httpserver
from eldr.proxy.httpserver import HardenedAppRunner, HttpLimits, RefusalLog, classify

CODE = {"model": "tiny", "prompt": "write code now"}

# (name, raw request, status, words of the message)
MALFORMED = [
    ("header over 8 KB", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000
     + b"\r\n\r\n", 431, "header line is over 8190 bytes"),
    ("too many headers", b"GET /health HTTP/1.1\r\nHost: x\r\n"
     + b"".join(b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n", 431,
     "more than 128 header lines"),
    ("control character", b"GET /health HTTP/1.1\r\nHost: x\r\nX-C: a\x01b\r\n\r\n", 400,
     "Invalid HTTP request"),
    ("bare CR", b"GET /health HTTP/1.1\r\nHost: x\r\nX-C: a\rb\r\n\r\n", 400,
     "Invalid HTTP request"),
    ("garbage request line", b"\x00\x01garbage nonsense\r\n\r\n", 400,
     "Invalid HTTP request"),
    ("request line over 8 KB", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414,
     "request line is over 8190 bytes"),
]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _until(predicate, timeout: float = 20.0, step: float = 0.02) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(step)
    return True


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


async def _exchange(port: int, raw: bytes, timeout: float = 20.0) -> bytes:
    """Send ``raw`` on a new connection; everything read until the router closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def _parse(answer: bytes) -> tuple[int, dict, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def _check_json_error(answer: bytes, status: int, words: str) -> dict:
    got, headers, body = _parse(answer)
    assert got == status, answer[:300]
    assert headers["content-type"].startswith("application/json")
    assert headers["connection"].lower() == "close"
    doc = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == status and words in doc["error"]["message"]
    return doc


def test_the_hardening_seam_is_in_place():
    """If this fails, the installed aiohttp changed what HardenedRequestHandler overrides:
    malformed requests get aiohttp's text answers and heads are not timed (module doc)."""
    assert httpserver.seam_missing() == []

    async def go():
        async with served_router() as (_, _base, runner, _d):
            return type(runner.server), type(runner.server())

    server_cls, handler_cls = asyncio.run(go())
    assert server_cls is httpserver.HardenedServer
    assert handler_cls is httpserver.HardenedRequestHandler


@pytest.mark.parametrize("name, raw, status, words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_http_gets_vllms_json_error_and_one_log_line(caplog, name, raw, status,
                                                              words):
    caplog.set_level(logging.DEBUG)

    async def go():
        async with served_router(health_interval=60) as (_, base, runner, _d):
            caplog.clear()
            answer = await _exchange(_port(base), raw)
            records = list(caplog.records)
            async with aiohttp.ClientSession() as s:  # the router serves on
                async with s.get(base + "/health") as r:
                    ok = r.status
            return answer, records, ok, runner.server.refusals.counts

    answer, records, ok, counts = asyncio.run(go())
    _check_json_error(answer, status, words)
    assert [r for r in records if r.exc_info or "Traceback" in r.getMessage()] == []
    lines = [r for r in records if r.levelno >= logging.INFO]
    assert len(lines) == 1 and f": {status}, " in lines[0].getMessage()
    assert "\n" not in lines[0].getMessage()
    assert counts == {status: 1} and ok == 200


def test_refusal_log_lines_are_rate_limited_and_count_the_ones_left_out():
    now = [100.0]
    logger = logging.getLogger("test.refusals")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        refusals = RefusalLog(logger, interval=10.0, clock=lambda: now[0])
        for _ in range(20):
            refusals.note(431, ("10.0.0.1", 5), "too large")
        now[0] += 10.5
        refusals.note(400, ("10.0.0.2", 6), "bad")
    finally:
        logger.removeHandler(handler)
    assert seen == ["client 10.0.0.1:5: 431, too large",
                    "client 10.0.0.2:6: 400, bad (19 more since the last line, not logged)"]
    assert refusals.counts == {431: 20, 400: 1}


def test_many_malformed_requests_log_one_line():
    async def go():
        async with served_router(health_interval=60) as (_, base, runner, _d):
            answers = await asyncio.gather(*[_exchange(_port(base), MALFORMED[0][1])
                                             for _ in range(30)])
            return answers, runner.server.refusals

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    keep = Keep(logging.INFO)
    logging.getLogger("eldr.serve").addHandler(keep)
    try:
        answers, refusals = asyncio.run(go())
    finally:
        logging.getLogger("eldr.serve").removeHandler(keep)
    assert all(_parse(a)[0] == 431 for a in answers)
    assert refusals.counts == {431: 30}
    assert len(records) == 1  # 30 in well under LOG_INTERVAL (10 s)


@pytest.mark.parametrize("parser", ["c", "py"])
@pytest.mark.parametrize("name, raw, status, words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_both_aiohttp_parsers_errors_are_classified_alike(parser, name, raw, status, words):
    """aiohttp parses with llhttp (C) unless AIOHTTP_NO_EXTENSIONS; their exceptions'
    messages differ, their classes and our statuses do not."""
    from aiohttp import http_parser

    cls = http_parser.HttpRequestParserPy if parser == "py" \
        else getattr(http_parser, "HttpRequestParserC", None)
    if cls is None:
        pytest.skip("aiohttp's C parser is not built here")

    async def go():
        loop = asyncio.get_running_loop()
        p = cls(None, loop, 2 ** 16, max_line_size=8190, max_field_size=8190, max_headers=128)
        try:
            p.feed_data(raw)
        except Exception as exc:
            return exc
        return None

    exc = asyncio.run(go())
    if exc is None:  # the pure-Python parser waits for the rest of a request line
        assert parser == "py" and b"\n" not in raw
        return
    end = raw.find(b"\n")
    got, message = classify(exc, HttpLimits(), None if end < 0 else end, len(raw))
    assert got == status and words in message


def test_request_heads_that_never_finish_are_closed_while_good_requests_flow():
    limits = HttpLimits(header_timeout=0.5)

    async def go():
        async with served_router(limits) as (_, base, runner, _d):
            loop = asyncio.get_running_loop()
            port = _port(base)
            opened = loop.time()
            stalled = [await asyncio.open_connection("127.0.0.1", port) for _ in range(50)]
            for _, writer in stalled:
                writer.write(b"GET /heal")  # half a request line, never the rest
            silent = await asyncio.open_connection("127.0.0.1", port)  # never a byte
            closes = [asyncio.ensure_future(r.read()) for r, _ in (*stalled, silent)]
            async with aiohttp.ClientSession() as s:
                good = []
                for _ in range(3):
                    rs = await asyncio.gather(*[s.post(base + "/v1/completions", json=CODE)
                                                for _ in range(5)])
                    good += [r.status for r in rs]
                    for r in rs:
                        r.release()
            done, pending = await asyncio.wait(closes, timeout=30)
            elapsed = loop.time() - opened
            for _, writer in (*stalled, silent):
                writer.close()
            return good, [c.result() for c in closes if c in done], len(pending), elapsed, \
                runner.server.refusals.counts

    good, answers, pending, elapsed, counts = asyncio.run(go())
    assert good == [200] * 15
    assert pending == 0 and elapsed >= 0.45  # all closed, none before the timeout
    for answer in answers[:50]:  # a request had begun: told why
        _check_json_error(answer, 408, "request line and headers took over 0.5 s")
    assert answers[50] == b""  # nothing was asked: closed without a word
    assert counts[408] == 51


def test_a_head_sent_in_pieces_within_the_timeout_is_served():
    async def go():
        async with served_router(HttpLimits(header_timeout=5.0)) as (_, base, _r, _d):
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(base))
            for piece in (b"GET /hea", b"lth HTTP/1.1\r\nHo", b"st: x\r\n", b"\r\n"):
                writer.write(piece)
                await asyncio.sleep(0.1)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
            writer.close()
            return head

    assert asyncio.run(go()).startswith(b"HTTP/1.1 200")


def test_kept_alive_connections_idle_or_stalled_between_requests_are_closed():
    """Idle after an answer: closed after keepalive_timeout. A second request begun and
    stalled: closed after header_timeout from its first byte, with a 408."""
    limits = HttpLimits(header_timeout=0.5, keepalive_timeout=2.0)
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

    async def go():
        async with served_router(limits) as (_, base, _r, _d):
            loop = asyncio.get_running_loop()
            out = []
            for second in (b"", b"GET /hea"):
                reader, writer = await asyncio.open_connection("127.0.0.1", _port(base))
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
                n = int(_parse(head + b"")[1]["content-length"])
                await asyncio.wait_for(reader.readexactly(n), 20)
                t0 = loop.time()
                if second:
                    await asyncio.sleep(0.2)  # idle a little, then half a request
                    writer.write(second)
                rest = await asyncio.wait_for(reader.read(), 30)
                out.append((head.split(b"\r\n")[0], rest, loop.time() - t0))
                writer.close()
            return out

    (first, rest1, idle), (_, rest2, stalled) = asyncio.run(go())
    assert first.startswith(b"HTTP/1.1 200")
    assert rest1 == b"" and idle >= 1.0  # the keep-alive timeout (2 s): closed, no answer
    _check_json_error(rest2, 408, "took over 0.5 s")  # not the keep-alive's silent close
    assert stalled >= 0.6  # 0.2 s idle + 0.5 s from the second request's first byte


def test_file_descriptors_come_back_after_a_burst_and_the_idle_expiry():
    """A burst of concurrent requests through the router opens connections on every
    side (in this one process: client, router, engines); once the client has gone and the
    router's idle upstream connections are older than their expiry, the process holds no
    more file descriptors than before the burst (a few of slack). No health check runs
    meanwhile: a pool in use drops its expired connections itself, the sweep is for idle
    pools."""
    async def go():
        async with served_router(health_interval=60) as (router, base, _r, _d):
            router.session.keepalive_expiry = 0.3
            await asyncio.sleep(0.5)
            before = _fds()
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as s:
                async def one():
                    async with s.post(base + "/v1/completions", json=CODE) as r:
                        await r.read()
                        return r.status

                statuses = await asyncio.gather(*[one() for _ in range(200)])
                peak = _fds()
                idle_after_burst = router.session.idle_connections()
            back = await _until(lambda: _fds() <= before + 8, timeout=30)
            return statuses, before, peak, idle_after_burst, back, _fds(), \
                router.session.idle_connections()

    statuses, before, peak, idle_after_burst, back, after, idle_now = asyncio.run(go())
    assert statuses == [200] * 200
    assert peak > before + 100  # the burst did open connections
    assert idle_after_burst <= 3 * 64  # the idle cap per engine (3 engines)
    assert back, (before, peak, after)
    assert idle_now <= 3


def test_serve_runs_the_hardened_server(capsys):
    """eldr serve (and each --workers N worker, which runs serve()) uses the hardening."""
    async def go():
        async with serve_task(policy="eldr_cost",
                              http_limits=HttpLimits(header_timeout=0.3)) as p:
            return await _exchange(p, MALFORMED[0][1]), await _exchange(p, b"POST /v1/comp")

    refused, late = asyncio.run(go())
    _check_json_error(refused, 431, "header line is over")
    _check_json_error(late, 408, "took over 0.3 s")


def test_an_error_outside_the_apps_middleware_is_a_json_500_with_its_traceback(caplog):
    """A bug is still logged with its traceback; only the answer changes (JSON)."""
    async def boom(request):
        raise RuntimeError("a bug")

    async def go():
        app = web.Application()
        app.router.add_get("/", boom)
        runner = HardenedAppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            return await _exchange(runner.addresses[0][1],
                                   b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        finally:
            await runner.cleanup()

    answer = asyncio.run(go())
    doc = _check_json_error(answer, 500, "internal error")
    assert "a bug" not in json.dumps(doc)
    assert any(r.exc_info for r in caplog.records)
