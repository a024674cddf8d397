#!/usr/bin/env python3
"""What aiohttp's server costs ``eldr serve`` per request, against the least a Python server
can cost: measured before replacing it (issue 32: "replacing it ... is in scope, measure
first").

Two bare servers, each answering ``POST /v1/completions`` with a parsed JSON body and a
canned 200 JSON answer (no proxying, no routing: only the server side of one request):

- ``aiohttp``: the server as ``eldr serve`` runs it (``eldr.proxy.httpserver``'s
  ``HardenedAppRunner``, ``handler_cancellation``, no access log, one middleware, a
  ``web.Response``), the same aiohttp the router imports;
- ``raw``: an ``asyncio.Protocol`` on the same event loop with ``httptools``' request parser
  (llhttp, what the router's engine client already uses), one task per request, the answer
  written as one buffer: no request or response objects, no router, no middleware, no
  hardening (no header timeout, no error documents, no body limit). It is the floor a
  replacement written on the same loop could approach, not a replacement.

Each server runs in its own process pinned to one core, the client (the same minimal
keep-alive client as ``bench_serve.py``, ``--concurrency`` connections) on the other; CPU
time per request is read from /proc (user + system of the server process), so what else
runs on the client's core does not change it. Servers alternate, ``--rounds`` times.

    python benchmarks/bench_http_server.py [--rounds 3] [--seconds 4] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve as bs  # the client, /proc CPU time, free ports

ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": " hello" * 20, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 40, "completion_tokens": 20,
                               "total_tokens": 60}}).encode()


def _serve_aiohttp(port: int) -> None:
    from aiohttp import web

    from eldr.proxy.httpserver import HardenedAppRunner

    @web.middleware
    async def errors(request, handler):
        return await handler(request)

    async def generate(request):
        json.loads(await request.read())
        return web.Response(body=ANSWER, content_type="application/json")

    app = web.Application(middlewares=[errors])
    app.router.add_post("/v1/completions", generate)

    async def main():
        runner = HardenedAppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    bs.run_loop(main())


def _serve_raw(port: int) -> None:
    import httptools

    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(ANSWER)).encode() + b"\r\n\r\n")

    class Conn(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []
            self.tasks: set[asyncio.Task] = set()  # held until done (the loop keeps weak refs)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, chunk: bytes) -> None:
            self.body.append(chunk)

        def on_message_complete(self) -> None:
            raw, self.body = b"".join(self.body), []
            task = asyncio.ensure_future(self.handle(raw))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        async def handle(self, raw: bytes) -> None:
            json.loads(raw)
            self.transport.write(head + ANSWER)

    async def main():
        await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", port)
        await asyncio.Event().wait()

    bs.run_loop(main())


async def _load(port: int, pid: int, concurrency: int, seconds: float) -> tuple[float, float]:
    """(server CPU seconds per request, requests per second) over ``seconds``: bench_serve's
    load, each request with its own prompt."""
    cpu0 = bs._cpu_seconds(pid)
    done, secs = await bs._throughput(port, concurrency, seconds, False)
    return (bs._cpu_seconds(pid) - cpu0) / max(done, 1), done / secs


async def _main(args) -> dict[str, list[tuple[float, float]]]:
    cores = sorted(os.sched_getaffinity(0))
    server_core = cores[0] if len(cores) > 1 else None
    if server_core is not None:
        os.sched_setaffinity(0, set(cores[1:]))
    procs = {}
    for kind in ("aiohttp", "raw"):
        port = bs._free_port()
        pin = (lambda: os.sched_setaffinity(0, {server_core})) if server_core is not None \
            else None
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", kind,
                                 str(port)], preexec_fn=pin, start_new_session=True)
        procs[kind] = (proc, port)
    try:
        for kind, (proc, port) in procs.items():
            for _ in range(300):
                try:
                    c = await bs._Conn(port).open()
                    await c.post("/v1/completions", bs._bodies()[0])
                    c.close()
                    break
                except (OSError, RuntimeError):
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"the {kind} server exited ({proc.returncode})") from None
                    await asyncio.sleep(0.1)
            await _load(port, proc.pid, args.concurrency, 1.0)  # warm-up
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in procs}
        for _ in range(args.rounds):
            for kind, (proc, port) in procs.items():
                results[kind].append(await _load(port, proc.pid, args.concurrency,
                                                 args.seconds))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(10)
    return results


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        {"aiohttp": _serve_aiohttp, "raw": _serve_raw}[sys.argv[2]](int(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    res = asyncio.run(_main(args))
    print(f"bare HTTP servers, POST /v1/completions with a parsed JSON body, concurrency "
          f"{args.concurrency}, {args.rounds} rounds x {args.seconds:g} s, alternating; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'server':<10}{'CPU us/request (each round)':>34}{'median':>9}{'req/s':>9}")
    med = {}
    for kind, rows in res.items():
        cpu = [c * 1e6 for c, _ in rows]
        med[kind] = statistics.median(cpu)
        print(f"{kind:<10}{', '.join(f'{c:.0f}' for c in cpu):>34}{med[kind]:>9.0f}"
              f"{statistics.median(r for _, r in rows):>9,.0f}")
    print(f"aiohttp - raw: {med['aiohttp'] - med['raw']:.0f} us of CPU per request "
          f"(aiohttp / raw {med['aiohttp'] / med['raw']:.2f}x): the most a server of the "
          f"engine client's kind could save eldr serve per request")


if __name__ == "__main__":
    main()
