#!/usr/bin/env python3
"""Router memory and decoder slots under clients that send a request and never read.

An ``eldr serve`` process (policy jsq) runs in front of one in-process aiohttp engine that
answers a prefill at once and a decode either as a 20 MB JSON answer or as an endless SSE
stream of 64 KiB events. ``--clients`` raw TCP clients (receive buffer 4 KiB) each send one
request and never read. Reported: the router's RSS before, its peak (``VmHWM``) and after
the write timeout dropped them, the engine's in-flight decodes then, and the router's
``eldr_slow_clients_total``.

    python benchmarks/bench_slow_clients.py [--clients 100] [--mode big|stream]
                                            [--write-timeout 5] [--max-peak-mb MB]

``--max-peak-mb MB``: exit 1, saying why, when the router's peak RSS passed MB or not
every client was dropped, the engine's decodes closed included (CI runs it so, with small
sizes: an engine client without read backpressure once let a never-reading client's
stream fill the router's memory at loopback speed, 12.5 GB at 100 clients, and nothing
ran this benchmark for six days).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def _rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


async def _engine(big_bytes: int):
    from aiohttp import web

    state = {"open": 0}
    pad = "x" * big_bytes
    event = b'data: {"choices": [{"index": 0, "text": "' + b"y" * 65536 + b'"}]}\n\n'

    async def complete(request):
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return web.json_response({"choices": [{"index": 0, "text": "t"}],
                                      "kv_transfer_params": {"remote_engine_id": "e"},
                                      "usage": {"prompt_tokens": 3}})
        state["open"] += 1
        try:
            if not body.get("stream"):
                return web.json_response({"choices": [{"index": 0, "text": pad}]})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            while True:
                await resp.write(event)
        finally:
            state["open"] -= 1

    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(text="ok"))
    app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m"}]}))
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", state


def _slow_clients(base: str) -> float:
    page = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    return next((float(ln.split()[-1]) for ln in page.splitlines()
                 if ln.startswith("eldr_slow_clients_total")), 0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--mode", choices=("big", "stream"), default="big")
    p.add_argument("--big-mb", type=int, default=20)
    p.add_argument("--write-timeout", type=float, default=5.0)
    p.add_argument("--max-peak-mb", type=float, default=None,
                   help="fail (exit 1) past this peak RSS or if a client was not dropped")
    args = p.parse_args()
    runner, url, state = await _engine(args.big_mb << 20)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "eldr", "serve", "--prefill", url,
                             "--decode", url, "--policy", "jsq", "--port", str(port),
                             "--write-timeout", str(args.write_timeout), "--log-level", "error"])
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            await asyncio.sleep(0.1)
            try:
                await asyncio.to_thread(urllib.request.urlopen, base + "/health", timeout=1)
                break
            except OSError:
                continue
        rss0, _ = _rss_kib(proc.pid)
        body = json.dumps({"prompt": "hi", "stream": args.mode == "stream"}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        loop = asyncio.get_running_loop()
        socks = []
        t0 = time.monotonic()
        for _ in range(args.clients):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", port))
            await loop.sock_sendall(s, head + body)
            socks.append(s)
        peak_open, slow = 0, 0.0
        while time.monotonic() - t0 < args.write_timeout + 120:
            await asyncio.sleep(0.5)
            peak_open = max(peak_open, state["open"])
            slow = await asyncio.to_thread(_slow_clients, base)
            if slow >= args.clients and state["open"] == 0:
                break
        elapsed = time.monotonic() - t0
        await asyncio.sleep(1.0)
        rss1, hwm = _rss_kib(proc.pid)
        still_open = state["open"]
        print(f"{args.clients} non-reading clients, mode {args.mode}"
              f"{f' ({args.big_mb} MB answers)' if args.mode == 'big' else ''}, "
              f"write timeout {args.write_timeout} s")
        print(f"router RSS before {rss0 / 1024:.0f} MB, peak {hwm / 1024:.0f} MB, after "
              f"{rss1 / 1024:.0f} MB; decodes open at the engine: peak {peak_open}, now "
              f"{state['open']}; eldr_slow_clients_total {slow:.0f} after {elapsed:.1f} s")
        for s in socks:
            s.close()
    finally:
        proc.terminate()
        proc.wait(10)
        await runner.cleanup()
    if args.max_peak_mb is None:
        return
    failures = []
    if hwm / 1024 > args.max_peak_mb:
        failures.append(f"peak RSS {hwm / 1024:.0f} MB over --max-peak-mb {args.max_peak_mb:g}")
    if slow < args.clients:
        failures.append(f"{slow:.0f} of {args.clients} clients dropped")
    if still_open:
        failures.append(f"{still_open} decodes still open at the engine")
    if failures:
        raise SystemExit("bench_slow_clients: " + "; ".join(failures))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main())
