#!/usr/bin/env python3
"""A pass-through HTTP hop between the routers and the engines, for
``benchmarks/bench_engine_tpot.py --gate``: it times every generation request on the wire
and, when armed, releases a wave's decodes together.

Why a hop outside the router: the bench's question is WHEN each request reached its
decoder under each policy (the arrival spread), and the answer must not depend on code
the router runs only for some policies. The hop sees every router's requests the same way:

- per ``POST /v1/...`` (a prefill or a decode; the router sends both with the attempt's
  ``X-Request-Id``), the wall-clock times (``time.time()``, the clock the bench's client
  uses on the same machine) it arrived here (``t_in``), was sent on (``t_up``: later than
  ``t_in`` only while held), the engine's answer headers (``t_hdr``), its first body
  bytes (``t_first``) and its end (``t_end``), with the prompt's key (a hash of its
  ``prompt`` or ``messages``: the bench joins its client's requests to them by it);
- everything else (``/metrics`` scrapes, ``/health``, ``/eldr/steps``) passes untimed.

Armed with ``n`` (``POST /gate/arm?n=N&timeout=S`` on the control port), the decode
engines' hops hold every decode request until ``n`` have arrived (or ``timeout`` seconds
passed since the first: then all held ones go, and the release is marked late), then send
them on together: every decoder receives its wave at one moment, whatever the policy.
``POST /gate/disarm`` turns holding off; ``GET /gate/records`` returns the records so far
and clears them.

    python benchmarks/engine_gate.py --control PORT --engine decode-0=PORT=URL ...

One process, one event loop, one port per engine (a name starting with ``decode`` is a
decode engine): the barrier spans all decoders.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

GENERATE = ("/v1/completions", "/v1/chat/completions")
# hop-by-hop or length headers: the hop frames its own messages
_DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def prompt_key(body: bytes) -> str | None:
    """The key of a generation request's prompt: the first 16 hex digits of the SHA-1 of
    its ``prompt`` (a string) or its ``messages`` (canonical JSON); None when the body has
    neither. The bench computes the same key from what its client sent."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    prompt = doc.get("prompt", doc.get("messages"))
    if prompt is None:
        return None
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class Barrier:
    """Holds decode requests until ``n`` have arrived (armed), else lets them pass."""

    def __init__(self) -> None:
        self.n: int | None = None  # armed: release when this many are held
        self.timeout = 60.0
        self.held: list[asyncio.Future] = []
        self.timer: asyncio.TimerHandle | None = None
        self.late = 0  # releases forced by the timeout (a wave that never completed)

    def arm(self, n: int, timeout: float) -> None:
        if n < 1 or timeout <= 0:
            raise ValueError(f"arm: n must be >= 1 and timeout > 0, got n={n}, "
                             f"timeout={timeout}")
        self._release(late=False)  # whatever an earlier wave left
        self.n, self.timeout = n, timeout

    def disarm(self) -> None:
        self._release(late=False)
        self.n = None

    async def wait(self) -> bool:
        """Held until released; True if this request was held at all."""
        if self.n is None:
            return False
        fut = asyncio.get_running_loop().create_future()
        self.held.append(fut)
        if len(self.held) >= self.n:
            self._release(late=False)
            self.n = None  # one wave per arming
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(
                self.timeout, self._release, True)
        await fut
        return True

    def _release(self, late: bool) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if late and self.held:
            self.late += 1
            self.n = None
        held, self.held = self.held, []
        for fut in held:
            if not fut.done():
                fut.set_result(None)


class Gate:
    """The hops (one aiohttp app per engine) and their shared records and barrier."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.barrier = Barrier()
        self.session: ClientSession | None = None

    async def start_session(self) -> None:
        self.session = ClientSession(connector=TCPConnector(limit=0),
                                     timeout=ClientTimeout(total=None))

    def engine_app(self, name: str, upstream: str) -> web.Application:
        decode = name.startswith("decode")

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            timed = request.method == "POST" and request.path in GENERATE
            rec = None
            if timed:
                rec = {"engine": name, "rid": request.headers.get("X-Request-Id"),
                       "key": prompt_key(body), "t_in": time.time(), "held": False}
                if decode:
                    rec["held"] = await self.barrier.wait()
                rec["t_up"] = time.time()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
            async with self.session.request(request.method, upstream + request.path_qs,
                                            data=body or None, headers=headers) as resp:
                if rec is not None:
                    rec["t_hdr"] = time.time()
                    rec["status"] = resp.status
                out = web.StreamResponse(status=resp.status, headers={
                    k: v for k, v in resp.headers.items() if k.lower() not in _DROP})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    if rec is not None and "t_first" not in rec:
                        rec["t_first"] = time.time()
                    await out.write(chunk)
                await out.write_eof()
            if rec is not None:
                rec["t_end"] = time.time()
                self.records.append(rec)
            return out

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    def control_app(self) -> web.Application:
        async def arm(request: web.Request) -> web.Response:
            try:
                self.barrier.arm(int(request.query["n"]),
                                 float(request.query.get("timeout", "60")))
            except (KeyError, ValueError) as exc:
                return web.json_response({"error": f"arm needs n (and timeout): {exc}"},
                                         status=400)
            return web.json_response({"armed": self.barrier.n})

        async def disarm(_: web.Request) -> web.Response:
            self.barrier.disarm()
            return web.json_response({"armed": None})

        async def records(_: web.Request) -> web.Response:
            out, self.records = self.records, []
            return web.json_response({"records": out, "late_releases": self.barrier.late})

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/gate/arm", arm)
        app.router.add_post("/gate/disarm", disarm)
        app.router.add_get("/gate/records", records)
        app.router.add_get("/health", health)
        return app


async def serve(control: int, engines: list[tuple[str, int, str]], host: str) -> None:
    gate = Gate()
    await gate.start_session()
    runners = []
    for app, port in [(gate.control_app(), control),
                      *((gate.engine_app(n, u), p) for n, p, u in engines)]:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    print(f"engine gate: control on {control}, "
          + ", ".join(f"{n} {p} -> {u}" for n, p, u in engines), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        await gate.session.close()


def parse_engine(text: str) -> tuple[str, int, str]:
    """``NAME=PORT=URL`` of one engine's hop."""
    parts = text.split("=", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].startswith("http"):
        raise argparse.ArgumentTypeError(f"--engine {text!r}: expected NAME=PORT=URL")
    return parts[0], int(parts[1]), parts[2].rstrip("/")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--control", type=int, required=True, help="control port")
    p.add_argument("--engine", type=parse_engine, action="append", required=True,
                   help="NAME=PORT=URL, one per engine (decode engines: NAME decode*)")
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    try:
        asyncio.run(serve(args.control, args.engine, args.host))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
