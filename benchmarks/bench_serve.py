#!/usr/bin/env python3
"""The router's own cost, side by side: ``eldr serve`` and vLLM's ``vllm-router`` in ONE run.

What is measured. Three minimal local HTTP/1.1 backends (one prefill, two decoders) answer
canned JSON instantly: the prefill answer carries a realistic eldr payload (48 layers x
128 experts, 256 tokens x top-8). A client sends OpenAI completion requests, each with its
own prompt, either DIRECTLY through the PD protocol (prefill call, then decode call, as a
client of a PD pair would) or THROUGH a router, which makes the same two calls plus its
own work. Every difference between the paths is the router. The routers, all started
once and all pinned to the same ONE core (the client and the backends run on the others):

- ``eldr serve`` with the policies ``jsq`` (no signature work), ``eldr`` (signature band)
  and ``eldr_cost`` (expert profile), each with its own process; ``eldr_cost`` with the
  decoder profiles every artifact of ``eldr fit`` carries (``--cost-memory online``: the
  online memory that stands in without them, as this benchmark ran before 2026-12-06);
- ``eldr serve`` from another source tree (``--baseline-src DIR``, e.g. the main branch
  before a change), the same policies, for before/after in the same run;
- ``vllm-router`` (PyPI ``vllm-router``, the vLLM project's Rust PD router,
  ``--vllm-pd-disaggregation``, ``--policy power_of_two``, log level warning), when
  installed (``pip install 'eldr[bench]'``); otherwise its rows say why they are missing;
- optionally ``eldr serve --workers N`` (``--workers N``), NOT pinned (it is meant for
  more cores than one).

Per router: the added latency (p50/p99 of one request at concurrency 1, router minus the
direct PD pair, rounds interleaved across routers so drifting machine load hits all
alike), the router's CPU time per request under load (concurrency ``--concurrency``,
from /proc: user + system of the process and its children), the requests per second it
sustains on its one core (1 / CPU per request: what a fully available core does; the
measured rate is printed too, but on a small machine the Python client and backends on
the other core are its ceiling). Ratios are against vllm-router in the same run.

Also printed: the signature path in-process (payload decode, signature encode, policy
decision, the part of ``DecoderChoice.decide`` that is eldr's own work), median over many calls.

Targets (issue 15): added p50 <= vllm-router's + 0.15 ms; CPU per request <= 2x
vllm-router's; signature path <= 40 us.

``--pairs N`` (with ``--baseline-src``) measures CPU per request only, in pairs: per
policy, N times the baseline tree's router and this tree's, each a new process warmed up
and then loaded for ``--seconds``, in alternating order (base first, then this tree first):
the mean paired difference with its 95 % interval, and in how many pairs this tree was
lower. On a 2-core machine single runs of the table above vary by about ±8 µs per request;
a change of a few µs shows only in pairs.

    python benchmarks/bench_serve.py [--requests 2000] [--seconds 4] [--rounds 3]
        [--policies jsq,eldr,eldr_cost] [--baseline-src ../main/src] [--workers 2]
        [--cost-memory fitted|online] [--fresh-processes]
    python benchmarks/bench_serve.py --baseline-src ../main/src --pairs 6 --seconds 10
        --policies eldr_cost
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import ClassVar

import numpy as np

L, E, MASK = 48, 128, 16  # model fingerprint and layer-mask size of the benchmark encoder
PROMPT = ("You are a careful assistant. Answer the question about the code below.\n" * 12
          + "def f(x):\n    return x * 2\n")
_PREFILL_RE = re.compile(rb'"do_remote_decode"\s*:\s*true')
_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')
_LAYERS_RE = re.compile(rb'"eldr_layers"\s*:\s*(\[[0-9, ]*\])')
# --stream-tokens N: decoders answer a request with "stream": true by N SSE events, one every
# _STREAM["interval"] seconds, then [DONE], chunked as vLLM's server sends them
_STREAM = {"tokens": 0, "interval": 0.002}
_SSE_EVENT = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
              b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,'
              b'"stop_reason":null}]}\n\n')


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


# -- minimal backend --------------------------------------------------------------------------
def _mask_layers() -> np.ndarray:
    """(MASK,) the benchmark artifact's layer mask (the same draw as its encoder's)."""
    return np.sort(np.random.default_rng(1).choice(L, MASK, replace=False))


def parse_policy(token: str) -> tuple[str, int]:
    """(policy name, eldr_cost's layer stride) of a ``--policies`` entry: ``eldr_cost/3`` is
    ``eldr_cost`` pricing every 3rd layer (``eldr serve --cost-layer-stride 3``); a bad
    entry is a ValueError. ``bench_engine_tpot.py`` reads its entries with it too."""
    name, sep, stride = token.partition("/")
    if not sep:
        return name, 1
    if name != "eldr_cost" or not stride.isdigit() or int(stride) < 1:
        raise ValueError(f"--policies: {token!r}: only eldr_cost/S takes a layer stride, "
                         f"S an integer >= 1")
    return name, int(stride)


def _stride_rows(stride: int) -> tuple[int, ...]:
    """The rows ``eldr_cost/stride`` prices, hence asks the prefill engine for."""
    return tuple(range(0, L, stride))


def _answers(version: int = 2, strides=()) -> tuple[bytes, bytes, bytes, dict]:
    """(prefill answer, prefill answer with a layer-masked payload, decode answer, {rows:
    prefill answer with only those rows} for the band's mask and each eldr_cost stride):
    the payload is what the capture plugin sends (version 2; version 1: the dense zlib +
    base64 format before it), all L layers unless the router asked for some."""
    from eldr.capture.payload import encode_counts, encode_payload

    rng = np.random.default_rng(0)
    counts = rng.multinomial(256 * 8, np.full(E, 1 / E), size=L)  # (L, E): 256 tokens, top-8

    def prefill(layers) -> bytes:
        if version == 1:
            payload = {**encode_counts(counts), "tokens": 256}
        else:
            payload = encode_payload(counts, tokens=256, layers=layers)
        return json.dumps({
            "id": "p", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 256, "completion_tokens": 1, "total_tokens": 257},
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                   "remote_engine_id": "e0", "remote_block_ids": [1, 2, 3],
                                   "remote_host": "127.0.0.1", "remote_port": 5600,
                                   "eldr": payload}}).encode()

    decode = {"id": "d", "object": "text_completion", "model": "m",
              "choices": [{"index": 0, "text": " four words of text", "finish_reason": "length"}],
              "usage": {"prompt_tokens": 256, "completion_tokens": 4, "total_tokens": 260}}
    masked = prefill(_mask_layers())
    by_rows = {tuple(int(x) for x in _mask_layers()): masked}
    if version == 2:
        by_rows.update({_stride_rows(s): prefill(list(_stride_rows(s)))
                        for s in strides if s > 1})
    return prefill(None), masked, json.dumps(decode).encode(), by_rows


def _http_response(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Backend(asyncio.Protocol):
    """HTTP/1.1 keep-alive: the prefill answer if the body asks for a remote decode, else
    the decode answer; GET /health, /v1/models, /metrics (empty) and anything else: 200."""

    prefill_reply = decode_reply = models_reply = empty_reply = b""
    # rows asked for (eldr_layers) -> prefill reply
    layer_replies: ClassVar[dict[tuple, bytes]] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            j = head.find(b"\r\n", i)
            n = int(head[i + 15: j if j > 0 else len(head)]) if i >= 0 else 0
            if len(self.buf) < end + 4 + n:
                return
            body = self.buf[end + 4: end + 4 + n]
            self.buf = self.buf[end + 4 + n:]
            if head.startswith(b"get /v1/models"):
                self.transport.write(self.models_reply)
            elif head.startswith(b"get "):
                self.transport.write(self.empty_reply)
            elif _PREFILL_RE.search(body):  # the router may ask for some layers only
                asked = _LAYERS_RE.search(body)
                reply = self.layer_replies.get(tuple(json.loads(asked.group(1)))) \
                    if asked else None
                self.transport.write(reply or self.prefill_reply)
            elif _STREAM["tokens"] and _STREAM_RE.search(body):
                self._stream()
            else:
                self.transport.write(self.decode_reply)

    def _stream(self) -> None:
        """The decode answer as ``_STREAM["tokens"]`` SSE events spaced in time (a router
        relays each as it comes, as it does a real decoder's tokens), then [DONE]."""
        transport, loop = self.transport, asyncio.get_running_loop()
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n")
        event, end = _chunk(_SSE_EVENT), _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        start, every = loop.time(), _STREAM["interval"]

        def send(i: int) -> None:
            if transport.is_closing():
                return
            if i < _STREAM["tokens"]:
                transport.write(event)
                loop.call_at(start + (i + 2) * every, send, i + 1)
            else:
                transport.write(end)

        loop.call_at(start + every, send, 0)


# -- minimal client ---------------------------------------------------------------------------
class _Conn:
    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> _Conn:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def _send(self, path: str, body: bytes) -> bytes:
        """POST ``body`` to ``path``; the answer's head."""
        self.writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: b\r\n"
                          b"Content-Type: application/json\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body)
        return await self.reader.readuntil(b"\r\n\r\n")

    async def post(self, path: str, body: bytes) -> bytes:
        head = await self._send(path, body)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"bad answer: {head[:300]!r}")
        low = head.lower()
        i = low.find(b"content-length:")
        if i < 0:
            raise RuntimeError(f"answer without Content-Length: {head[:300]!r}")
        n = int(low[i + 15: low.find(b"\r\n", i)])
        return await self.reader.readexactly(n)

    async def post_stream(self, path: str, body: bytes) -> int:
        """POST a streamed request; the SSE events of its chunked answer, read to the end."""
        head = await self._send(path, body)
        if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
            raise RuntimeError(f"bad stream answer: {head[:300]!r}")
        events = 0
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return events
            events += (await self.reader.readexactly(size + 2)).count(b"data: ")

    def close(self) -> None:
        self.writer.close()


_counter = 0


def _bodies() -> tuple[bytes, bytes, bytes]:
    """(client body, direct prefill body, direct decode body) of a request with its own
    prompt (a counter in front: no two requests share a prompt, or a prefix block)."""
    global _counter
    _counter += 1
    prompt = f"[{_counter}] {PROMPT}"
    body = {"model": "m", "prompt": prompt, "max_tokens": 4}
    if _STREAM["tokens"]:
        body.update(max_tokens=_STREAM["tokens"], stream=True)
    raw = json.dumps(body).encode()
    pre = json.dumps({**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True}}).encode()
    return raw, pre, raw


async def _one(conn: _Conn, direct: bool) -> None:
    raw, pre, dec = _bodies()
    if direct:
        doc = json.loads(await conn.post("/v1/completions", pre))  # the PD protocol, no router
        kvp = dict(doc["kv_transfer_params"])
        kvp.pop("eldr", None)
        dec = dec[:-1] + b', "kv_transfer_params": ' + json.dumps(kvp).encode() + b"}"
    if not _STREAM["tokens"]:
        await conn.post("/v1/completions", dec if direct else raw)
        return
    events = await conn.post_stream("/v1/completions", dec if direct else raw)
    if events != _STREAM["tokens"] + 1:  # every token and [DONE]
        raise RuntimeError(f"a stream of {_STREAM['tokens']} tokens came with {events} events")


async def _latency(port: int, n: int, direct: bool) -> list[float]:
    conn = await _Conn(port).open()
    out = []
    for i in range(n + n // 10):
        t0 = time.perf_counter()
        await _one(conn, direct)
        if i >= n // 10:  # the first 10% warm up
            out.append(time.perf_counter() - t0)
    conn.close()
    return out


async def _throughput(port: int, concurrency: int, seconds: float, direct: bool
                      ) -> tuple[int, float]:
    """(requests completed, seconds) at ``concurrency`` for ``seconds``."""
    conns = [await _Conn(port).open() for _ in range(concurrency)]
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(conn: _Conn) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await _one(conn, direct)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return done, elapsed


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and of all its live children (Linux /proc)."""
    return sum(_cpu_split(pid))


def _cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and of all its live children (Linux /proc):
    system time is the kernel's work for the process (its socket writes and reads, which
    on loopback include the receiver's TCP processing), about the same for every router
    making the same calls; user time is the router's own code."""
    user = system = 0.0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11]) / os.sysconf("SC_CLK_TCK")
        system += int(fields[12]) / os.sysconf("SC_CLK_TCK")
    return user, system


def _children(pid: int) -> list[int]:
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return out
    for k in kids:
        out += [k, *_children(k)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the routers ---------------------------------------------------------------------------------
def _decoder_profiles() -> np.ndarray:
    """(2, L, E) float32 what a fitted artifact gives ``eldr_cost`` (``decoder_profiles``:
    each decoder's cluster mean ``log(1 - p)``): here the mean over 16 prompts like the
    benchmark's (256 tokens x top-8), drawn per decoder."""
    rng = np.random.default_rng(2)
    p = rng.multinomial(256 * 8, np.full(E, 1 / E), size=(2, 16, L)) / 256.0
    return np.log1p(-np.minimum(p, 1 - 1e-6)).mean(axis=1).astype(np.float32)


def _policy_options(policy: str, memory: str) -> dict:
    """Options of ``make_policy`` beyond the artifact's centroids, for a ``--policies``
    entry: ``eldr_cost`` as an artifact from ``eldr fit`` serves it (its
    ``decoder_profiles``: ``memory`` "fitted"), or with the online memory that stands in
    without them ("online": artifacts of version 1, and this benchmark before
    2026-12-06); ``eldr_cost/S`` with its layer stride."""
    name, stride = parse_policy(policy)
    options = {"layer_stride": stride} if stride != 1 else {}
    if name == "eldr_cost" and memory == "fitted":
        options["decoder_profiles"] = _decoder_profiles()
    return options


def _serve_child(ports: list[int], policy: str, port: int, workers: int,
                 memory: str = "fitted") -> None:
    """``eldr serve`` with an in-memory artifact (48 x 128, mask 16, two decoders), on the
    source tree this interpreter imports (PYTHONPATH); ``memory``: :func:`_policy_options`."""
    from eldr.fit.signature import SignatureEncoder
    from eldr.proxy.app import Router
    from eldr.proxy.config import ServeConfig
    from eldr.routing import make_policy

    try:
        from eldr.proxy.serving import serve
    except ModuleNotFoundError:  # a tree from before the serve loop moved into the proxy
        from eldr.commands.serve import serve

    try:
        from eldr.proxy.request import RoutingState
    except ModuleNotFoundError:  # a tree from before the proxy's subpackages (--baseline-src)
        from eldr.proxy.decision import RoutingState

    urls = [f"http://127.0.0.1:{p}" for p in ports]
    kwargs = {"workers": workers} if workers > 1 else {}
    name, stride = parse_policy(policy)
    if stride != 1:
        kwargs["cost_layer_stride"] = stride
    config = ServeConfig(prefill_urls=(urls[0],), decode_urls=(urls[1], urls[2]),
                         policy=name, port=port, models=("m",), health_interval=5.0,
                         **kwargs)

    def make_state():
        rng = np.random.default_rng(1)
        enc = SignatureEncoder.from_state({
            "representation": "count_idf", "num_layers": L, "num_experts": E,
            "layers": np.sort(rng.choice(L, MASK, replace=False)),  # = _mask_layers()
            "idf": rng.uniform(0.1, 2.0, (L, E))})
        cent = rng.random((2, MASK * E)).astype(np.float32)
        cent /= np.linalg.norm(cent, axis=1, keepdims=True)
        return RoutingState(policy=make_policy(name, num_workers=2, centroids=cent, tau=0.1,
                                               num_layers=L, num_experts=E,
                                               **_policy_options(policy, memory)),
                            worker_names=("d0", "d1"), encoder=enc, num_layers=L,
                            num_experts=E, tau=0.1, artifact=None, loaded_at=time.time(),
                            top_k=8)

    if workers > 1:
        from eldr.proxy.workers import run_workers

        # make_router(config, share) now, (config, row) or (config) in older trees: *_
        run_workers(config, lambda *_: Router(config, state=make_state()), serve)
        return
    router = Router(config, state=make_state())
    run_loop(serve(router))


def run_loop(main) -> None:
    """Run the coroutine ``main`` on the event loop eldr serve runs (commands.serve):
    uvloop when installed, else asyncio's."""
    try:
        import uvloop
    except ModuleNotFoundError:
        asyncio.run(main)
        return
    uvloop.run(main)


class _Router:
    """One router under test: a name, its process, its port."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None,
                 core: int | None = None) -> None:
        self.name, self.port = name, port
        preexec = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
        self.log = tempfile.TemporaryFile()  # never a pipe: a full one would stall it
        self.proc = subprocess.Popen(argv, env=env, preexec_fn=preexec,
                                     stdout=subprocess.DEVNULL, stderr=self.log,
                                     start_new_session=True)
        self.result: dict = {"lat": [], "cpu_seq": [], "cpu_load": [], "cpu_user": [],
                             "rps": []}

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {err}")
            try:
                conn = await _Conn(self.port).open()
                try:
                    await _one(conn, False)
                    return
                finally:
                    conn.close()
            except (OSError, RuntimeError, asyncio.IncompleteReadError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not ready after {timeout} s") from None
                await asyncio.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _vllm_router_argv(ports: list[int], port: int) -> list[str] | None:
    exe = shutil.which("vllm-router") or shutil.which(
        "vllm-router", path=os.path.dirname(sys.executable))
    if exe is None:
        return None
    return [exe, "--vllm-pd-disaggregation", "--prefill", f"http://127.0.0.1:{ports[0]}",
            "--decode", f"http://127.0.0.1:{ports[1]}", "--decode",
            f"http://127.0.0.1:{ports[2]}", "--policy", "power_of_two", "--host",
            "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def _eldr_router(name: str, ports: list[int], policy: str, workers: int, memory: str,
                 src: str, core: int | None) -> _Router:
    """``eldr serve`` of the tree ``src`` (its src/) as this benchmark's serve child."""
    port = _free_port()
    argv = [sys.executable, os.path.abspath(__file__), "--serve-child",
            json.dumps([ports, policy, port, workers, memory])]
    return _Router(name, argv, port, {**os.environ, "PYTHONPATH": src}, core)


async def _loaded(r: _Router, concurrency: int, seconds: float
                  ) -> tuple[float, float, int, float]:
    """(CPU seconds, of which user, requests answered, wall seconds) of router ``r`` under
    ``seconds`` of load at ``concurrency``."""
    u0, s0 = _cpu_split(r.proc.pid)
    done, secs = await _throughput(r.port, concurrency, seconds, False)
    u1, s1 = _cpu_split(r.proc.pid)
    return u1 - u0 + s1 - s0, u1 - u0, done, secs


_THIS_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _routers(args, ports: list[int], core: int | None) -> tuple[list[_Router], list[str]]:
    routers, notes = [], []
    trees = [("eldr", _THIS_SRC)]
    if args.baseline_src:
        trees.insert(0, ("eldr@base", os.path.abspath(args.baseline_src)))
    for label, src in trees:
        for policy in args.policies.split(","):
            if label != "eldr" and parse_policy(policy)[1] != 1:
                notes.append(f"{label} {policy}: not run (a layer stride needs this tree's "
                             f"eldr_cost)")
                continue
            routers.append(_eldr_router(f"{label} {policy}", ports, policy, 1,
                                        args.cost_memory, src, core))
    if args.workers > 1:
        policy = args.policies.split(",")[-1]
        routers.append(_eldr_router(f"eldr {policy} x{args.workers} (unpinned)", ports,
                                    policy, args.workers, args.cost_memory, _THIS_SRC, None))
    argv = _vllm_router_argv(ports, port := _free_port())
    if argv is None:
        notes.append("vllm-router: not installed (pip install 'eldr[bench]' installs "
                     "vllm-router==0.1.17); its rows and the ratios are missing")
    else:
        routers.append(_Router("vllm-router p2c", argv, port, None, core))
    return routers, notes


# -- the signature path, in-process ----------------------------------------------------------
def _median_us(fn, repeat: int) -> float:
    """Median microseconds of one call of ``fn`` over ``repeat`` calls, after a tenth as
    many unmeasured (first calls fill caches)."""
    for _ in range(repeat // 10):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _signature_path(prefill_answer: bytes, masked_answer: bytes, repeat: int = 2000
                    ) -> dict[str, float]:
    """Median microseconds of the signature path's parts (policy ``eldr``), on the
    benchmark's payload as the router gets it (masked: it asks for its layer mask)."""
    from eldr.capture import payload as wire
    from eldr.fit.signature import SignatureEncoder
    from eldr.proxy.request import RoutingState, read_inputs, split_kv_params
    from eldr.routing import RouteRequest, make_policy

    rng = np.random.default_rng(1)
    enc = SignatureEncoder.from_state({
        "representation": "count_idf", "num_layers": L, "num_experts": E,
        "layers": np.sort(rng.choice(L, MASK, replace=False)),
        "idf": rng.uniform(0.1, 2.0, (L, E))})
    cent = rng.random((2, MASK * E)).astype(np.float32)
    cent /= np.linalg.norm(cent, axis=1, keepdims=True)
    state = RoutingState(policy=make_policy("eldr", num_workers=2, centroids=cent, tau=0.1,
                                            num_layers=L, num_experts=E),
                         worker_names=("d0", "d1"), encoder=enc, num_layers=L,
                         num_experts=E, tau=0.1, artifact=None, loaded_at=0.0, top_k=8)
    doc = json.loads(masked_answer)
    full = json.loads(prefill_answer)["kv_transfer_params"]["eldr"]
    loads = np.zeros(2)

    def timed(fn) -> float:
        return _median_us(fn, repeat)

    _, payload = split_kv_params(doc)

    def decide():
        _, pl = split_kv_params(doc)
        r = read_inputs(doc, pl, state, 256)
        state.policy.decide(RouteRequest("x", signature=r.signature, profile=r.profile,
                                         context_tokens=r.context_tokens), loads, None)

    return {"payload decode (all layers)": timed(lambda: wire.decode_counts(
                full, num_layers=L, num_experts=E)),
            "payload decode (mask)": timed(lambda: wire.decode_counts(
                payload, num_layers=L, num_experts=E)),
            "read_inputs (decode + encode)": timed(lambda: read_inputs(doc, payload, state,
                                                                       256)),
            "whole (split + read + decide)": timed(decide)}


def _stage_state(policy: str, memory: str = "fitted"):
    """The benchmark routers' routing state for ``policy`` (as :func:`_serve_child`)."""
    from eldr.fit.signature import SignatureEncoder
    from eldr.proxy.request import RoutingState
    from eldr.routing import make_policy

    rng = np.random.default_rng(1)
    enc = SignatureEncoder.from_state({
        "representation": "count_idf", "num_layers": L, "num_experts": E,
        "layers": np.sort(rng.choice(L, MASK, replace=False)),
        "idf": rng.uniform(0.1, 2.0, (L, E))})
    cent = rng.random((2, MASK * E)).astype(np.float32)
    cent /= np.linalg.norm(cent, axis=1, keepdims=True)
    return RoutingState(policy=make_policy(parse_policy(policy)[0], num_workers=2,
                                           centroids=cent, tau=0.1, num_layers=L,
                                           num_experts=E, **_policy_options(policy, memory)),
                        worker_names=("d0", "d1"), encoder=enc, num_layers=L,
                        num_experts=E, tau=0.1, artifact=None, loaded_at=0.0, top_k=8)


def _stages(policy: str, prefill_answer: bytes, layer_answers: dict, decode_answer: bytes,
            repeat: int = 2000, in_flight: int = 32, memory: str = "fitted"
            ) -> dict[str, float]:
    """Median microseconds of each in-process stage of one request's path, by ``policy``,
    on the benchmark's bodies: what the router does besides HTTP (the sum's rest of the
    measured CPU per request is the HTTP server and client, the event loop and the relay
    of bytes). Stages a policy skips (no signature for jsq) are 0. The prefill answer is
    the one the policy's router gets: the rows it asks for (``payload_request``; answers
    by rows in ``layer_answers``), else every layer's (until 2026-12-06 every policy's
    stages read the band's masked one, which ``eldr_cost`` refuses: its rows timed its
    fallback by load)."""
    from eldr.proxy.bodies import decode_body, json_object, parse_body, prompt_token_bound
    from eldr.proxy.metrics import RouterMetrics
    from eldr.proxy.request import read_inputs, split_kv_params
    from eldr.proxy.request.containment import body_digest
    from eldr.proxy.request.decodepayload import strip_json
    from eldr.proxy.request.flow import PREFILL_KV_PARAMS, prefill_body, prompt_key
    from eldr.proxy.request.prefill import payload_request
    from eldr.routing import RouteRequest

    state = _stage_state(policy, memory)
    raw = _bodies()[0]
    body = parse_body(raw, "completions")
    asked = payload_request(state)
    answer = layer_answers[tuple(asked["eldr_layers"])] if asked else prefill_answer
    doc = json_object(answer)
    kv, payload = split_kv_params(doc)
    reading = read_inputs(doc, payload, state, 256)
    reads = state.needs_signature or state.needs_profile
    if reads and reading.problem is not None:
        raise RuntimeError(f"the {policy} stages would time a fallback: {reading.problem}")
    loads = np.zeros(2)

    class _Pool:  # what RouterMetrics reads of the pool (nothing, until a scrape)
        prefill, decode = [], []

    try:
        metrics = RouterMetrics(_Pool())
    except Exception:  # a metrics class that reads more of the pool: the stage is left out
        metrics = None
    ids = iter(range(1 << 30))

    held: collections.deque = collections.deque()  # (request id, decoder) in flight

    def decide_release():
        """One decision as under the load run: ``in_flight`` requests held, the oldest
        released as a new one is dispatched (a decision then finds both decoders' rows
        changed since the last one, as the router does under load; releasing each
        request at once left them empty, and their rows cost nothing to refresh)."""
        rid = f"r{next(ids)}"
        route = RouteRequest(rid, signature=reading.signature, profile=reading.profile,
                             context_tokens=reading.context_tokens)
        k = state.policy.decide(route, loads, None).worker
        state.policy.on_dispatch(route, k)
        loads[k] += 1
        held.append((rid, k))
        if len(held) > in_flight:
            old, d = held.popleft()
            state.policy.on_release(old, "completed")
            loads[d] -= 1

    def count():
        metrics.requests.inc(endpoint="/v1/completions", status="200")
        metrics.decisions.inc(policy=parse_policy(policy)[0], decoder="d0")
        metrics.signatures.inc(source="payload")
        metrics.route_inputs.inc(source="prefill")
        metrics.latency.observe(1e-4)

    def timed(fn) -> float:
        return _median_us(fn, repeat)

    stages = {
        "parse body": lambda: parse_body(raw, "completions"),
        "checks + digest": lambda: (body_digest(raw), prompt_token_bound(body, "completions",
                                                                         cap=16)),
        "affinity key": lambda: prompt_key(body, "completions"),
        "prefill body": lambda: prefill_body(body, "completions", PREFILL_KV_PARAMS,
                                             raw=raw),
        "prefill answer parse": lambda: json_object(answer),
        "signature/profile": (lambda: read_inputs(doc, split_kv_params(doc)[1], state, 256))
        if reads else None,
        "decide + dispatch/release": decide_release,
        "decode body": lambda: decode_body(body, raw, kv),
        "decode answer strip": lambda: strip_json(decode_answer),
        "metrics": count if metrics is not None else None,
    }
    return {k: (timed(fn) if fn is not None else 0.0) for k, fn in stages.items()}


def _cost_kernels(policy: str, prefill_answer: bytes, layer_answers: dict,
                  repeat: int = 2000) -> float | None:
    """Median microseconds of the numpy kernels alone that one ``eldr_cost`` request runs
    on the benchmark's payload (None for another policy): the digits read, the count
    check and the profile's division; at the decision, both decoders' rows refreshed (the
    ``exp`` of the log sums and their float64 sum: under load a dispatch and a release
    change both between two decisions) and the two matrix-vector products; the held
    row's ``log(1 - p)``, added at dispatch and taken away at release. No Python around
    them: what cutting the request path's interpreter work can never remove."""
    from eldr.capture.digits import decode_digits
    from eldr.proxy.bodies import json_object
    from eldr.proxy.request import split_kv_params
    from eldr.proxy.request.prefill import payload_request

    name, _ = parse_policy(policy)
    if name != "eldr_cost":
        return None
    state = _stage_state(policy)
    asked = payload_request(state)
    answer = layer_answers[tuple(asked["eldr_layers"])] if asked else prefill_answer
    payload = split_kv_params(json_object(answer))[1]
    rows = len(payload.get("layers") or range(L))
    text, width = payload["data"], payload["w"]
    rng = np.random.default_rng(5)
    log_miss = rng.uniform(-4.0, 0.0, (2, rows * E))
    miss = np.empty((2, rows * E), dtype=np.float32)
    typical = rng.random((2, rows * E)).astype(np.float32)
    one = np.float32(1.0)

    def kernels():
        values = decode_digits(text, width)
        values.max()
        p = np.divide(values, np.float32(256), dtype=np.float32)
        for d in (0, 1):
            np.exp(log_miss[d], out=miss[d], dtype=np.float32, casting="same_kind")
            miss[d].sum(dtype=np.float64)
        miss @ p
        typical @ p
        p.max()
        row = np.log(one - p)
        log_miss[0] += row
        log_miss[0] -= row

    return _median_us(kernels, repeat)


# -- the run ------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


async def _restarted(routers: list[_Router], args, ports: list[int], core: int | None,
                     results: dict[str, dict]) -> list[_Router]:
    """The same routers as new processes (``--fresh-processes``), their results carried
    over, each ready and warmed up by half a second of load. Why: a process keeps its
    memory layout, and with it a speed of its own, for as long as it runs; the same tree
    measured 782 and 933 µs per request in two runs of one process each (docs/serve.md)."""
    for r in routers:
        r.stop()
    fresh, _ = _routers(args, ports, core)
    for r in fresh:
        r.result = results[r.name]
        await r.wait_ready()
        await _throughput(r.port, args.concurrency, 0.5, False)
    return fresh


async def _paired(args, ports: list[int], core: int | None) -> dict:
    """``--pairs N``: per policy, the CPU per request (µs) of the baseline tree's router and
    this tree's, N of each, every one a new process pinned to ``core``, warmed up by half a
    second of load and then loaded for ``--seconds``; pair i runs the baseline first when
    i is even, this tree first when it is odd (drifting machine load hits both alike)."""
    from eldr.intervals import paired_interval

    trees = {"base": os.path.abspath(args.baseline_src), "this": _THIS_SRC}
    out = {}
    for policy in args.policies.split(","):
        runs: dict[str, list[float]] = {"base": [], "this": []}
        for i in range(args.pairs):
            for label in ("base", "this") if i % 2 == 0 else ("this", "base"):
                r = _eldr_router(f"eldr@{label} {policy}", ports, policy, 1,
                                 args.cost_memory, trees[label], core)
                try:
                    await r.wait_ready()
                    await _throughput(r.port, args.concurrency, 0.5, False)
                    cpu, _, done, _ = await _loaded(r, args.concurrency, args.seconds)
                finally:
                    r.stop()
                runs[label].append(cpu / max(done, 1) * 1e6)
        diff = paired_interval([t - b for b, t in zip(runs["base"], runs["this"], strict=True)])
        out[policy] = {**runs, "mean_diff_us": diff.mean, "half_width_us": diff.half_width,
                       "this_lower": sum(t < b for b, t in zip(runs["base"], runs["this"],
                                                               strict=True))}
    return out


async def _main(args) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    core = cores[0] if len(cores) > 1 else None
    if len(cores) > 1:
        os.sched_setaffinity(0, set(cores[1:]))  # client + backends off the routers' core
    strides = {parse_policy(p)[1] for p in args.policies.split(",")}
    prefill, masked, decode, by_rows = _answers(args.payload, strides)
    _Backend.prefill_reply = _http_response(prefill)
    _Backend.layer_replies = {rows: _http_response(a) for rows, a in by_rows.items()}
    _Backend.decode_reply = _http_response(decode)
    _Backend.models_reply = _http_response(b'{"object":"list","data":[{"id":"m"}]}')
    _Backend.empty_reply = _http_response(b"", b"text/plain")
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(_Backend, "127.0.0.1", 0, backlog=1024)
               for _ in range(3)]  # prefill, decode 0, decode 1
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    if args.pairs:
        try:
            return {"pairs": await _paired(args, ports, core), "seconds": args.seconds,
                    "concurrency": args.concurrency, "router_core": core,
                    "cpus": len(cores), "load_average_1min": os.getloadavg()[0]}
        finally:
            for s in servers:
                s.close()
    routers, notes = _routers(args, ports, core)
    results = {r.name: r.result for r in routers}
    direct = {"lat": [], "rps": []}
    try:
        for r in routers:
            await r.wait_ready()
        n = args.requests
        for i in range(args.rounds):  # interleaved: drifting load hits every router alike
            if i and args.fresh_processes:
                routers = await _restarted(routers, args, ports, core, results)
            direct["lat"].append(await _latency(ports[0], n, True))
            for r in routers:
                cpu0 = _cpu_seconds(r.proc.pid)
                r.result["lat"].append(await _latency(r.port, n, False))
                r.result["cpu_seq"].append((_cpu_seconds(r.proc.pid) - cpu0) / (n + n // 10))
        for _ in range(args.rounds):
            if args.fresh_processes:
                routers = await _restarted(routers, args, ports, core, results)
            done, secs = await _throughput(ports[0], args.concurrency, args.seconds, True)
            direct["rps"].append(done / secs)
            for r in routers:
                cpu, user, done, secs = await _loaded(r, args.concurrency, args.seconds)
                r.result["cpu_load"].append(cpu / max(done, 1))
                r.result["cpu_user"].append(user / max(done, 1))
                r.result["rps"].append(done / secs)
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.close()

    def added(lat_rounds, q):  # per round, router minus direct of the same round
        return statistics.median(_pct(a, q) - _pct(b, q)
                                 for a, b in zip(lat_rounds, direct["lat"], strict=True))

    rows = []
    for r in routers:
        cpu = statistics.median(r.result["cpu_load"])
        rows.append({"router": r.name, "added_p50_ms": added(r.result["lat"], 50),
                     "added_p99_ms": added(r.result["lat"], 99),
                     "cpu_us_per_request": cpu * 1e6,
                     "user_us_per_request": statistics.median(r.result["cpu_user"]) * 1e6,
                     "cpu_us_per_sequential_request":
                         statistics.median(r.result["cpu_seq"]) * 1e6,
                     "rps_per_core": 1.0 / cpu if cpu else None,
                     "rps_measured": statistics.median(r.result["rps"])})
    return {"rows": rows, "notes": notes, "router_core": core, "cpus": len(cores),
            "requests": args.requests, "rounds": args.rounds,
            "concurrency": args.concurrency,
            "direct_p50_ms": statistics.median(_pct(x, 50) for x in direct["lat"]),
            "direct_p99_ms": statistics.median(_pct(x, 99) for x in direct["lat"]),
            "direct_rps": statistics.median(direct["rps"]),
            "load_average_1min": os.getloadavg()[0],
            "payload_version": args.payload, "payload_bytes": {
                "all layers": len(prefill), "layer mask": len(masked)},
            "signature_path_us": _signature_path(prefill, masked),
            "cost_memory": args.cost_memory, "fresh_processes": args.fresh_processes,
            "stream_tokens": args.stream_tokens, "token_interval_ms": args.token_interval_ms,
            "stages_us": {p: _stages(p, prefill, by_rows, decode, in_flight=args.concurrency,
                                     memory=args.cost_memory)
                          for p in args.policies.split(",")},
            "cost_kernels_us": {p: _cost_kernels(p, prefill, by_rows)
                                for p in args.policies.split(",")
                                if parse_policy(p)[0] == "eldr_cost"}}


def _print_pairs(res: dict) -> None:
    print(f"CPU per request in pairs (routers pinned to core {res['router_core']} of "
          f"{res['cpus']}; each a new process, {res['seconds']:g} s of load at concurrency "
          f"{res['concurrency']}; base and this tree alternating):")
    for policy, r in res["pairs"].items():
        n = len(r["this"])
        print(f"  {policy:<14} base {statistics.mean(r['base']):6.1f} us, this "
              f"{statistics.mean(r['this']):6.1f} us: {r['mean_diff_us']:+.1f} "
              f"± {r['half_width_us']:.1f} us (95 %, {n} pairs), this lower in "
              f"{r['this_lower']} of {n}")
        print("    base " + " ".join(f"{x:.1f}" for x in r["base"]))
        print("    this " + " ".join(f"{x:.1f}" for x in r["this"]))
    print(f"machine: {res['cpus']} CPUs, 1-min load average {res['load_average_1min']:.1f}")


def _print(res: dict) -> None:
    if "pairs" in res:
        _print_pairs(res)
        return
    print(f"router overhead, side by side (routers pinned to core {res['router_core']} of "
          f"{res['cpus']}; {res['rounds']} rounds x {res['requests']} sequential requests; "
          f"load at concurrency {res['concurrency']}; unique prompts; 1 prefill + 2 "
          f"decoders; 48x128 payloads; eldr_cost's memory: {res.get('cost_memory', 'online')}"
          + ("; new router processes every round" if res.get("fresh_processes") else "")
          + (f"; streamed answers of {res['stream_tokens']} tokens, one every "
             f"{res['token_interval_ms']:g} ms" if res.get("stream_tokens") else "")
          + ")")
    print(f"direct PD pair: p50 {res['direct_p50_ms']:.3f} ms, p99 {res['direct_p99_ms']:.3f} "
          f"ms, {res['direct_rps']:,.0f} req/s")
    ref = next((r for r in res["rows"] if r["router"].startswith("vllm-router")), None)
    head = (f"{'router':<30}{'+p50 ms':>9}{'+p99 ms':>9}{'CPU us/req':>11}{'(user)':>8}"
            f"{'(seq)':>7}{'req/s/core':>11}{'req/s':>8}")
    if ref:
        head += f"{'p50 - vr':>10}{'CPU / vr':>9}"
    print(head)
    for r in res["rows"]:
        line = (f"{r['router']:<30}{r['added_p50_ms']:>9.3f}{r['added_p99_ms']:>9.3f}"
                f"{r['cpu_us_per_request']:>11.0f}{r.get('user_us_per_request', 0):>8.0f}"
                f"{r['cpu_us_per_sequential_request']:>7.0f}"
                f"{r['rps_per_core'] or 0:>11,.0f}{r['rps_measured']:>8,.0f}")
        if ref:
            line += (f"{r['added_p50_ms'] - ref['added_p50_ms']:>+10.3f}"
                     f"{r['cpu_us_per_request'] / ref['cpu_us_per_request']:>8.2f}x")
        print(line)
    print("CPU us/req: user + system under load, (user) its user part (the rest is the "
          "kernel's socket work), (seq) at concurrency 1")
    print("targets (issue 32): eldr_cost CPU/request <= 2x vllm-router's and +p50 within "
          "0.3 ms of it; jsq CPU/request <= 1.5x")
    print(f"payload version {res['payload_version']}: prefill answer "
          + ", ".join(f"{k} {v:,} B" for k, v in res["payload_bytes"].items()))
    print("signature path (in-process, median us): " + ", ".join(
        f"{k} {v:.1f}" for k, v in res["signature_path_us"].items()) + "  (target <= 40)")
    stages = res.get("stages_us") or {}
    if stages:
        names = list(next(iter(stages.values())))
        print("request path by stage (in-process, median us; the rest of CPU/request is HTTP "
              "server + client, event loop, relay):")
        print(f"  {'stage':<28}" + "".join(f"{p:>11}" for p in stages))
        for name in [*names, "sum"]:
            print(f"  {name:<28}" + "".join(
                f"{(sum(v.values()) if name == 'sum' else v[name]):>11.1f}"
                for v in stages.values()))
    kernels = res.get("cost_kernels_us") or {}
    if kernels:
        print("of which eldr_cost's numpy kernels alone (in-process, median us; no Python "
              "around them): " + ", ".join(f"{p} {v:.1f}" for p, v in kernels.items()))
    for note in res["notes"]:
        print("note:", note)
    print(f"machine: {res['cpus']} CPUs, 1-min load average {res['load_average_1min']:.1f} "
          f"(other work on the routers' core inflates every row alike)")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-child":
        _serve_child(*json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="jsq,eldr,eldr_cost",
                   help="eldr serve policies, comma-separated; eldr_cost/S prices every "
                        "S-th layer (--cost-layer-stride S)")
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per round")
    p.add_argument("--seconds", type=float, default=4.0, help="load run per router per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--baseline-src", metavar="DIR",
                   help="another eldr source tree (its src/) measured in the same run")
    p.add_argument("--workers", type=int, default=1,
                   help="also measure eldr serve --workers N (unpinned), N > 1")
    p.add_argument("--payload", type=int, choices=(1, 2), default=2,
                   help="payload version the prefill stub sends (2: the plugin's compact "
                        "one; 1: the dense zlib + base64 one before it)")
    p.add_argument("--cost-memory", choices=("fitted", "online"), default="fitted",
                   help="eldr_cost's future term: the decoder profiles a fitted artifact "
                        "carries (as eldr serve runs it), or the online memory that stands "
                        "in without them (this benchmark's setting before 2026-12-06)")
    p.add_argument("--fresh-processes", action="store_true",
                   help="start every router anew for each round (latency and load), so a "
                        "router's figure is the median over as many processes as rounds")
    p.add_argument("--stream-tokens", type=int, default=0, metavar="N",
                   help="stream every answer: N SSE events from the decoder, one every "
                        "--token-interval-ms (0: whole JSON answers)")
    p.add_argument("--token-interval-ms", type=float, default=2.0)
    p.add_argument("--pairs", type=int, default=0, metavar="N",
                   help="instead of the table: N paired runs of the baseline tree's router "
                        "and this tree's per policy, CPU per request only (needs "
                        "--baseline-src)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.pairs < 0 or (args.pairs and not args.baseline_src):
        p.error("--pairs N needs N >= 1 and --baseline-src")
    for policy in args.policies.split(","):
        try:  # a bad entry stops here, before any router starts
            parse_policy(policy)
        except ValueError as exc:
            p.error(str(exc))
    if args.stream_tokens < 0 or args.token_interval_ms <= 0:
        p.error("--stream-tokens must be >= 0 and --token-interval-ms > 0")
    _STREAM.update(tokens=args.stream_tokens, interval=args.token_interval_ms / 1e3)
    res = asyncio.run(_main(args))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        _print(res)


if __name__ == "__main__":
    main()
