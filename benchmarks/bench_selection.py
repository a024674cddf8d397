#!/usr/bin/env python3
"""The selection API's cost per request life, over HTTP (docs/selection-api.md).

A router (``eldr serve``'s app, in this process, policy ``eldr_cost`` without an artifact:
bound to the model's shape by the first payload) in front of two stand-in decoders that
answer only ``/health`` and ``/v1/models``; a client on one keep-alive connection runs
whole reservation lives one after the other: ``reserve`` (with a realistic eldr payload of
48 layers x 128 experts, 256 prompt tokens x top-8), ``prefill_complete``, ``release``.
Also ``select`` alone, and the same life with no input (load only). Printed: p50 / p99 of
each call in milliseconds, and the whole life's.

Client and router share the event loop and the core, so the figures are an upper bound on
what the router adds per call (one HTTP round trip on localhost included). Wall-clock
times depend on what else the machine runs; the CPU times (this process: client, router
and stand-ins together, ``time.process_time``) much less.

    python benchmarks/bench_selection.py [--lives 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

L, E, K, TOKENS = 48, 128, 8, 256
TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _marker(wall: list[float], cpu: list[float]):
    """A function appending the wall-clock and CPU time of each call to the lists."""
    def mark() -> None:
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
    return mark


def _payload(rng: np.random.Generator) -> dict:
    from eldr.capture.payload import encode_counts

    counts = np.zeros((L, E), dtype=np.int64)
    for layer in range(L):  # TOKENS tokens x top-K distinct experts, skewed
        for _ in range(TOKENS):
            counts[layer, rng.choice(E, K, replace=False, p=_SKEW)] += 1
    return {**encode_counts(counts), "tokens": TOKENS}


_SKEW = (lambda w: w / w.sum())(1.0 / np.arange(1, E + 1) ** 0.8)


async def _stand_in() -> tuple[object, str]:
    from aiohttp import web

    async def health(request):
        return web.json_response({})

    async def models(request):
        return web.json_response({"object": "list", "data": [
            {"id": "tiny", "object": "model", "max_model_len": 4096}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _main(args) -> dict[str, list[float]]:
    import aiohttp
    from aiohttp import web

    from eldr.proxy.app import Router
    from eldr.proxy.config import ServeConfig

    rng = np.random.default_rng(args.seed)
    payloads = [_payload(rng) for _ in range(16)]
    stands = [await _stand_in() for _ in range(3)]
    config = ServeConfig(prefill_urls=(stands[0][1],), decode_urls=(stands[1][1], stands[2][1]),
                         policy="eldr_cost", admin_token=TOKEN, health_interval=3600.0)
    router = Router(config)
    runner = web.AppRunner(router.make_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/eldr"
    names = ("select", "reserve", "prefill_complete", "release", "life", "life (load only)")
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async def call(method, path, body=None) -> dict:
            async with session.request(method, base + path, json=body) as resp:
                doc = await resp.json()
                if resp.status >= 400:
                    raise RuntimeError(f"{path}: {resp.status} {doc}")
                return doc

        for i in range(args.lives + 50):  # the first 50: warm-up, not counted
            warm = i < 50
            body = {"eldr": payloads[i % len(payloads)], "prompt_tokens": TOKENS}
            t, c = [], []
            mark = _marker(t, c)
            mark()
            await call("POST", "/select", body)
            mark()
            doc = await call("POST", "/reserve", body)
            mark()
            rid = doc["reservation"]["id"]
            await call("POST", f"/reservations/{rid}/prefill_complete")
            mark()
            await call("POST", f"/reservations/{rid}/release", {"outcome": "completed"})
            mark()
            doc = await call("POST", "/reserve", {})
            await call("POST", f"/reservations/{doc['reservation']['id']}/release")
            mark()
            if not warm:
                spans = ((0, 1), (1, 2), (2, 3), (3, 4), (1, 4), (4, 5))
                for name, (a, b) in zip(names, spans, strict=True):
                    times[name].append((t[b] - t[a]) * 1e3)
                    cpu[name].append((c[b] - c[a]) * 1e3)
    assert router.selection.selection.num_active() == 0
    await runner.cleanup()
    for r, _ in stands:
        await r.cleanup()
    return times, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lives", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    times, cpu = asyncio.run(_main(args))
    print(f"selection API over HTTP, {args.lives} lives, eldr_cost, payload {L}x{E} "
          f"({TOKENS} tokens x top-{K})")
    print(f"{'call':<20} {'wall p50 ms':>12} {'wall p99 ms':>12} {'CPU p50 ms':>11} "
          f"{'CPU mean ms':>12}")
    for name, xs in times.items():
        print(f"{name:<20} {np.percentile(xs, 50):12.3f} {np.percentile(xs, 99):12.3f} "
              f"{np.percentile(cpu[name], 50):11.3f} {np.mean(cpu[name]):12.3f}")


if __name__ == "__main__":
    main()
