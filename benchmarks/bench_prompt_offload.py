#!/usr/bin/env python3
"""What a stream of long text prompts costs OTHER requests' relay (docs/serve.md, "Off the
event loop").

``eldr serve`` (policy ``eldr_cost``, routing on the prompt: stock prefills that answer no
expert counts, the tiny MoE's tokenizer, a 2**16 x rank-32 prompt predictor on a 48 x 128
model) in a child process, in front of bench_serve's instant stand-in engines. A client
sends requests whose prompts are 16 token ids (predicted, no tokenizer) one after another
and times each; meanwhile another sends ``--rate`` text prompts per second of about 2,048
tokens each (tokenized and predicted by the router). Printed: the token-id requests' p50 /
p99 latency without the stream, with it and ``--prompt-processes 1`` (the default: text
tokenized in a worker process), and with it and ``--prompt-processes 0`` (the prompt
threads tokenize: the ``tokenizers`` library holds the GIL while it encodes).

    python benchmarks/bench_prompt_offload.py [--requests 1500] [--rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve as bs  # the stand-in engines and the client

L, E = 48, 128
TEXT = "The quick brown fox jumps over the lazy dog while the router relays bytes. " * 66


def _child(ports: list[int], port: int, processes: int) -> None:
    """The router: eldr_cost, a prompt predictor and the tiny MoE's tokenizer."""
    import dataclasses

    from bench_prompt_predictor import _random_predictor
    from eldr.capture import tiny_moe_dir
    from eldr.proxy.app import Router
    from eldr.proxy.config import ServeConfig
    from eldr.proxy.request.prompts import PromptRouting, PromptTokenizer
    from eldr.proxy.serving import serve

    state = bs._stage_state("eldr_cost")
    tok = PromptTokenizer(tiny_moe_dir())
    pred = _random_predictor(16, 32, L, E, 8, tok.vocab_size, np.random.default_rng(0))
    pred.weighting_ = "token"
    unit = np.full(16 * E, (16 * E) ** -0.5, dtype=np.float32)

    def predict(ids):
        return unit, pred.predict(ids)

    state = dataclasses.replace(state, prompt=PromptRouting(predict=predict, tokenizer=tok,
                                                            fingerprint=""))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = ServeConfig(prefill_urls=(urls[0],), decode_urls=(urls[1], urls[2]),
                         policy="eldr_cost", port=port, models=("m",), health_interval=5.0,
                         prompt_processes=processes)
    router = Router(config, state=state)
    asyncio.run(serve(router))


def _prediction_results(port: int) -> dict[str, float]:
    """The router's eldr_prompt_predictions_total by result."""
    import re
    import urllib.request

    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {m[0]: float(m[1]) for m in re.findall(
        r'eldr_prompt_predictions_total\{result="(\w+)"\} (\S+)', page.decode())}


async def _timed_ids(conn, n: int) -> list[float]:
    body = json.dumps({"model": "m", "prompt": list(range(100, 116)),
                       "max_tokens": 4}).encode()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await conn.post("/v1/completions", body)
        out.append(time.perf_counter() - t0)
    return out


async def _stream(port: int, rate: float, stop: asyncio.Event) -> int:
    conn = await bs._Conn(port).open()
    sent = 0
    body = json.dumps({"model": "m", "prompt": TEXT, "max_tokens": 4}).encode()
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            await conn.post("/v1/completions", body)
            sent += 1
            await asyncio.sleep(max(0.0, 1.0 / rate - (time.perf_counter() - t0)))
    finally:
        conn.close()
    return sent


async def _run(args) -> None:
    prefill, _, decode = bs._answers(2)
    doc = json.loads(prefill)
    doc["kv_transfer_params"].pop("eldr", None)  # a stock prefill: no expert counts
    stock = bs._http_response(json.dumps(doc).encode())
    bs._Backend.prefill_reply = bs._Backend.masked_reply = stock
    bs._Backend.decode_reply = bs._http_response(decode)
    bs._Backend.models_reply = bs._http_response(b'{"object":"list","data":[{"id":"m"}]}')
    bs._Backend.empty_reply = bs._http_response(b"", b"text/plain")
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(bs._Backend, "127.0.0.1", 0) for _ in range(3)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    rows = []
    for processes, stream in ((1, False), (1, True), (0, True)):
        port = bs._free_port()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                 json.dumps([ports, port, processes])])
        try:
            for _ in range(600):
                try:
                    c = await bs._Conn(port).open()
                    await _timed_ids(c, 5)
                    c.close()
                    break
                except OSError:
                    await asyncio.sleep(0.1)
            await asyncio.sleep(3.0)  # the tokenizer process and the kernel ready
            stop = asyncio.Event()
            feeder = asyncio.ensure_future(_stream(port, args.rate, stop)) if stream else None
            conn = await bs._Conn(port).open()
            lat = await _timed_ids(conn, args.requests)
            conn.close()
            stop.set()
            sent = await feeder if feeder is not None else 0
            results = _prediction_results(port)
        finally:
            proc.terminate()
            proc.wait(10)
        ms = np.asarray(lat) * 1e3
        rows.append((processes, stream, float(np.percentile(ms, 50)),
                     float(np.percentile(ms, 99)), sent, results))
    for s in servers:
        s.close()
    print(f"token-id requests ({args.requests}, one at a time) beside a stream of "
          f"~2,048-token text prompts at {args.rate:g}/s; eldr_cost on the prompt, stock "
          f"prefills; load average {os.getloadavg()[0]:.1f}")
    print(f"{'setting':<40}{'p50 ms':>9}{'p99 ms':>9}{'text sent':>11}  predictions")
    for processes, stream, p50, p99, sent, results in rows:
        name = ("no stream" if not stream else
                f"stream, --prompt-processes {processes}")
        told = ", ".join(f"{k} {v:g}" for k, v in results.items() if v)
        print(f"{name:<40}{p50:>9.3f}{p99:>9.3f}{sent:>11}  {told}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(*json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--rate", type=float, default=20.0, help="text prompts per second")
    asyncio.run(_run(p.parse_args()))


if __name__ == "__main__":
    main()
