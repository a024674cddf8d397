#!/usr/bin/env python3
"""How much of the router's CPU per request is its HTTP stack: minimal PD proxies side by
side with ``eldr serve`` and vLLM's ``vllm-router`` in ONE run.

Why. Issue 32 asks for ``eldr serve``'s CPU per request within 1.5x (``jsq``) and 2x
(``eldr_cost``) of vllm-router's, and allows replacing the HTTP server or client library
if it is the bound: "measure first". This measures it. Every proxy below does the same
PD protocol on the same canned engines as ``benchmarks/bench_serve.py`` (its backends,
client and /proc accounting): read the client's JSON, POST the prefill body, parse the
answer, drop the ``eldr`` payload, POST the decode body to one of two decoders in turn,
answer the client with the decoder's bytes. None routes, counts, checks or retries
anything: what they cost is the floor of their HTTP stack on uvloop.

- ``aiohttp + aiohttp client``: aiohttp's server and its ``ClientSession``;
- ``aiohttp + eldr client``: aiohttp's server (what ``eldr serve`` runs) and eldr's own
  engine client (:class:`eldr.proxy.engines.client.UpstreamSession`, httptools);
- ``httptools + eldr client``: an ``asyncio.Protocol`` server parsed by httptools (no
  framework) and eldr's engine client;
- ``httptools + bare client``: that server and a keep-alive client without timeouts or
  pooling rules (the least Python can do);
- ``eldr serve jsq``: the router itself (bench_serve's in-memory artifact), for the
  share of its CPU that is its own work;
- ``vllm-router p2c`` (Rust) when installed.

All are pinned to the same one core, the client and engines to the others; rounds
alternate between them. Ratios are against vllm-router in the same run.

    python benchmarks/bench_http_floor.py [--seconds 3] [--rounds 3] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve as bs  # the same backends, client and CPU accounting

_PATH = "/v1/completions"
_PROXIES = ("aiohttp + aiohttp client", "aiohttp + eldr client", "httptools + eldr client",
            "httptools + bare client")


def _prefill_body(raw: bytes) -> tuple[dict, bytes]:
    body = json.loads(raw)
    pre = {**body, "max_tokens": 1, "stream": False,
           "kv_transfer_params": {"do_remote_decode": True}}
    return body, json.dumps(pre).encode()


def _decode_body(body: dict, answer: bytes) -> bytes:
    kvp = json.loads(answer)["kv_transfer_params"]
    kvp.pop("eldr", None)
    return json.dumps({**body, "kv_transfer_params": kvp}).encode()


# -- the minimal proxies (child processes) -------------------------------------------------
def _aiohttp_server(port: int, forward) -> None:
    """aiohttp's server on ``port``: each POST's bytes go through ``forward`` (a coroutine
    function, raw body -> answer bytes), started inside the loop by ``forward.start()``."""
    import uvloop
    from aiohttp import web

    async def main() -> None:
        await forward.start()

        async def handler(request):
            return web.Response(body=await forward(await request.read()),
                                content_type="application/json")

        app = web.Application()
        app.router.add_post(_PATH, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.run(main())


class _SessionForward:
    """The PD exchange over an aiohttp-style session (``session_factory()``)."""

    def __init__(self, ports: list[int], session_factory) -> None:
        self.urls = [f"http://127.0.0.1:{p}{_PATH}" for p in ports]
        self.factory = session_factory
        self.n = 0

    async def start(self) -> None:
        import aiohttp

        self.session = self.factory()
        self.timeout = aiohttp.ClientTimeout(total=300, sock_connect=5, sock_read=300)
        self.headers = {"Content-Type": "application/json"}

    async def __call__(self, raw: bytes) -> bytes:
        body, pre = _prefill_body(raw)
        async with self.session.post(self.urls[0], data=pre, headers=self.headers,
                                     timeout=self.timeout) as resp:
            answer = await resp.read()
        self.n += 1
        async with self.session.post(self.urls[1 + self.n % 2], data=_decode_body(body, answer),
                                     headers=self.headers, timeout=self.timeout) as resp:
            return await resp.read()


class _BareConnection(asyncio.Protocol):
    """One keep-alive connection to an engine, answers parsed by httptools; one request
    at a time, no timeouts."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.chunks: list[bytes] = []
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        body, self.chunks = b"".join(self.chunks), []
        waiter.set_result(body)

    def post(self, head: bytes, body: bytes) -> asyncio.Future:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head + str(len(body)).encode() + b"\r\n\r\n" + body)
        return self.waiter


class _BareForward:
    """The PD exchange over :class:`_BareConnection` pools (idle connections reused)."""

    _HEAD = (b"POST " + _PATH.encode() + b" HTTP/1.1\r\nHost: e\r\n"
             b"Content-Type: application/json\r\nContent-Length: ")

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.idle: list[list[_BareConnection]] = [[] for _ in ports]
        self.n = 0

    async def start(self) -> None:
        pass

    async def _post(self, i: int, body: bytes) -> bytes:
        pool = self.idle[i]
        if pool:
            conn = pool.pop()
        else:
            _, conn = await asyncio.get_running_loop().create_connection(
                _BareConnection, "127.0.0.1", self.ports[i])
        answer = await conn.post(self._HEAD, body)
        pool.append(conn)
        return answer

    async def __call__(self, raw: bytes) -> bytes:
        body, pre = _prefill_body(raw)
        answer = await self._post(0, pre)
        self.n += 1
        return await self._post(1 + self.n % 2, _decode_body(body, answer))


def _httptools_server(port: int, forward) -> None:
    """An ``asyncio.Protocol`` HTTP/1.1 server parsed by httptools (keep-alive, one
    request at a time per connection, Content-Length answers)."""
    import httptools
    import uvloop

    class Server(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.chunks: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.chunks.append(body)

        def on_message_complete(self) -> None:
            body, self.chunks = b"".join(self.chunks), []
            asyncio.get_running_loop().create_task(self.answer(body))

        async def answer(self, body: bytes) -> None:
            out = await forward(body)
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: " + str(len(out)).encode() + b"\r\n\r\n"
                                 + out)

    async def main() -> None:
        await forward.start()
        await asyncio.get_running_loop().create_server(Server, "127.0.0.1", port, backlog=1024)
        await asyncio.Event().wait()

    uvloop.run(main())


def _proxy_child(kind: str, ports: list[int], port: int) -> None:
    if kind == "aiohttp + aiohttp client":
        import aiohttp

        _aiohttp_server(port, _SessionForward(ports, lambda: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0))))
    elif kind == "aiohttp + eldr client":
        import aiohttp

        from eldr.proxy.engines.client import UpstreamSession

        _aiohttp_server(port, _SessionForward(
            ports, lambda: UpstreamSession(aiohttp.ClientSession())))
    elif kind == "httptools + eldr client":
        import aiohttp

        from eldr.proxy.engines.client import UpstreamSession

        _httptools_server(port, _SessionForward(
            ports, lambda: UpstreamSession(aiohttp.ClientSession())))
    elif kind == "httptools + bare client":
        _httptools_server(port, _BareForward(ports))
    else:
        raise SystemExit(f"unknown proxy {kind!r}")


# -- the run --------------------------------------------------------------------------------
async def _main(args) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    core = cores[0] if len(cores) > 1 else None
    if len(cores) > 1:
        os.sched_setaffinity(0, set(cores[1:]))
    prefill, _, decode, by_rows = bs._answers()
    bs._Backend.prefill_reply = bs._http_response(prefill)
    bs._Backend.layer_replies = {rows: bs._http_response(a) for rows, a in by_rows.items()}
    bs._Backend.decode_reply = bs._http_response(decode)
    bs._Backend.models_reply = bs._http_response(b'{"object":"list","data":[{"id":"m"}]}')
    bs._Backend.empty_reply = bs._http_response(b"", b"text/plain")
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(bs._Backend, "127.0.0.1", 0, backlog=1024)
               for _ in range(3)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    here = os.path.abspath(__file__)
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(os.path.dirname(here)),
                                                    "src")}
    routers, notes = [], []
    for kind in _PROXIES:
        port = bs._free_port()
        routers.append(bs._Router(kind, [sys.executable, here, "--proxy-child",
                                         json.dumps([kind, ports, port])], port, env, core))
    port = bs._free_port()
    routers.append(bs._Router("eldr serve jsq", [
        sys.executable, os.path.join(os.path.dirname(here), "bench_serve.py"),
        "--serve-child", json.dumps([ports, "jsq", port, 1])], port, env, core))
    argv = bs._vllm_router_argv(ports, port := bs._free_port())
    if argv is None:
        notes.append("vllm-router: not installed (pip install 'eldr[bench]'); no ratios")
    else:
        routers.append(bs._Router("vllm-router p2c", argv, port, None, core))
    cpu: dict[str, list[float]] = {r.name: [] for r in routers}
    user: dict[str, list[float]] = {r.name: [] for r in routers}
    try:
        for r in routers:
            await r.wait_ready()
            await bs._throughput(r.port, args.concurrency, 0.5, False)  # warm
        for _ in range(args.rounds):
            for r in routers:
                u0, s0 = bs._cpu_split(r.proc.pid)
                done, _ = await bs._throughput(r.port, args.concurrency, args.seconds, False)
                u1, s1 = bs._cpu_split(r.proc.pid)
                cpu[r.name].append((u1 - u0 + s1 - s0) / max(done, 1) * 1e6)
                user[r.name].append((u1 - u0) / max(done, 1) * 1e6)
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.close()
    rows = [{"proxy": name, "cpu_us_per_request": statistics.median(v),
             "user_us_per_request": statistics.median(user[name]), "rounds": v}
            for name, v in cpu.items()]
    return {"rows": rows, "notes": notes, "concurrency": args.concurrency,
            "rounds": args.rounds, "seconds": args.seconds, "router_core": core,
            "load_average_1min": os.getloadavg()[0]}


def _print(res: dict) -> None:
    print(f"HTTP stack floor: CPU per request at concurrency {res['concurrency']}, "
          f"{res['rounds']} rounds x {res['seconds']} s, all pinned to core "
          f"{res['router_core']}; same canned engines as bench_serve")
    ref = next((r for r in res["rows"] if r["proxy"].startswith("vllm-router")), None)
    print(f"{'proxy':<28}{'CPU us/req':>11}{'(user)':>8}{'/ vr':>7}   rounds")
    for r in res["rows"]:
        ratio = f"{r['cpu_us_per_request'] / ref['cpu_us_per_request']:>6.2f}x" if ref else ""
        print(f"{r['proxy']:<28}{r['cpu_us_per_request']:>11.0f}"
              f"{r['user_us_per_request']:>8.0f}{ratio:>7}   "
              + " ".join(f"{x:.0f}" for x in r["rounds"]))
    for note in res["notes"]:
        print("note:", note)
    print(f"1-min load average {res['load_average_1min']:.1f}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--proxy-child":
        _proxy_child(*json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="load run per proxy per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = asyncio.run(_main(args))
    print(json.dumps(res, indent=1)) if args.json else _print(res)


if __name__ == "__main__":
    main()
