"""Stand-in vLLM engines for the router's unit tests (aiohttp servers in the test process).

A :class:`FakeEngine` speaks just enough of vLLM's OpenAI API and PD protocol: a prefill
(``kv_transfer_params.do_remote_decode``) answers one token plus ``kv_transfer_params``
naming itself and carrying the eldr payload of the prompt's expert counts; a decode
answers the tokens ``["tok0", "tok1", ...]`` as JSON or SSE and records the
``kv_transfer_params`` it was given. ``mode`` injects failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
from aiohttp import web
from aiohttp.test_utils import TestServer

from eldr.capture.payload import encode_counts
from eldr.fit.signature import SignatureEncoder
from eldr.proxy.app import Router
from eldr.proxy.config import ServeConfig
from eldr.proxy.request.decision import RoutingState
from eldr.routing import make_policy

L, E, TOP_K = 2, 8, 4  # fingerprint of the fake model (domain_counts: 4 experts a token)
MODEL = "tiny"
MAX_MODEL_LEN = 128  # context length the fake engines report in /v1/models
MODEL_CARD = {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "vllm",
              "root": "/models/tiny", "parent": None, "max_model_len": MAX_MODEL_LEN,
              "permission": [{"id": "modelperm-1", "object": "model_permission",
                              "allow_sampling": True, "organization": "*"}]}
# a JSON document with usage, nested deeper than json.loads can recurse (RecursionError)
_DEEP_DOC = (b'{"usage": {"prompt_tokens": 1}, "x": ' + b"[" * 100_000 + b"]" * 100_000
             + b"}")


@web.middleware
async def _fastapi_errors(request, handler):
    """A route or method the fake lacks answers as vLLM's FastAPI server does."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def domain_counts(prompt: str) -> np.ndarray:
    """(L, E) counts: prompts mentioning 'code' use experts 0-3, others experts 4-7."""
    counts = np.zeros((L, E), dtype=np.int64)
    lo = 0 if "code" in prompt else 4
    counts[:, lo:lo + 4] = 1 + len(prompt) % 3
    return counts


def fake_encoder() -> SignatureEncoder:
    return SignatureEncoder.from_state({
        "representation": "count", "num_layers": L, "num_experts": E,
        "layers": np.arange(L), "idf": np.ones((L, E))})


def fake_centroids() -> np.ndarray:
    """(2, L*E): worker 0 = experts 0-3 ('code'), worker 1 = experts 4-7."""
    enc = fake_encoder()
    return np.stack([enc.transform(domain_counts("code")), enc.transform(domain_counts("law"))])


def make_state(config: ServeConfig, *, tau: float = 0.0, names=("w-code", "w-other"),
               encoder=None) -> RoutingState:
    policy = make_policy(config.policy, num_workers=len(config.decode_urls),
                         centroids=fake_centroids(), tau=tau, num_layers=L, num_experts=E,
                         random_state=0, layer_stride=config.cost_layer_stride)
    return RoutingState(policy=policy, worker_names=tuple(names),
                        encoder=encoder or fake_encoder(), num_layers=L, num_experts=E,
                        top_k=TOP_K, tau=tau, artifact=None, loaded_at=0.0)


def _prompt_of(body: dict) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


class FakeEngine:
    """One fake vLLM instance.

    ``mode``: ok | 500 | 400 | hang | drop | empty | break | slow | deep (answers, and the
    SSE usage event, nested 100,000 deep) | notjson (a 200 that is not JSON / not SSE) |
    flood (streams 64 KiB events until its client goes away) | big (a JSON answer of
    ``big_bytes``; as a prefill too) | linger (a stream that stays open 0.3 s after
    ``data: [DONE]``, as a TCP segment boundary can make any stream do) | break_dead (a
    stream cut after its first event by the engine dying: /health 503 from then on).

    Besides the completion routes it answers vLLM's ``/tokenize``, ``/detokenize``,
    ``/version`` and ``/ping`` (recorded in ``aux``), and a route it lacks or a wrong
    method as vLLM's FastAPI server does (``{"detail": "Not Found"}``).
    """

    def __init__(self, name: str, *, tokens: int = 3, payload: str = "counts",
                 report_prompt_tokens: int | None = None) -> None:
        self.name = name
        self.tokens = [f"tok{i}" for i in range(tokens)]
        self.payload = payload  # counts | blocks | routed | none | garbage
        self.report_prompt_tokens = report_prompt_tokens  # decode usage override
        self.cached_tokens = 0  # prompt tokens the prefill "found cached" (not counted)
        self.mode = "ok"
        self.healthy = True
        self.requests: list[dict] = []  # bodies received on the completion routes
        self.request_ids: list[str] = []
        self.headers: list[dict] = []  # headers of those requests
        self.aborted = 0  # decodes whose client (the router) went away mid-answer
        self.flooded = 0  # bytes of "flood" streams the router took (write() returned)
        self.big_bytes = 1 << 20  # size of a "big" answer
        self.api_key: str | None = None  # like vllm --api-key: /v1/* needs this bearer key
        self.aux: list[tuple[str, str, bytes]] = []  # (method, path_qs, body) of aux calls
        self.finished_streams = 0  # streams written to their end (incl. [DONE]) unaborted
        # a prompt containing this kills the engine: the connection drops, /health 503
        # (as vLLM's after its engine core died), until ``healthy`` is set again
        self.die_on: str | None = None
        self.hold: asyncio.Event | None = None  # completions wait for it (then answer)
        self.block_size: int | None = None  # KV block size its /metrics reports, if any
        self._open: set = set()  # transports of completions in progress (kill())
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def start(self) -> FakeEngine:
        app = web.Application(middlewares=[_fastapi_errors])
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._tokenize)
        app.router.add_get("/version", self._aux)
        app.router.add_get("/ping", self._aux)
        app.router.add_post("/ping", self._aux)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self.server = TestServer(app, port=0, handler_cancellation=True)
        await self.server.start_server()
        return self

    async def close(self) -> None:
        await self.server.close()

    async def _health(self, request):
        return web.Response(status=200 if self.healthy else 503)

    def _refused(self, request) -> bool:
        return self.api_key is not None and \
            request.headers.get("Authorization") != f"Bearer {self.api_key}"

    async def _models(self, request):
        if self._refused(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"object": "list", "data": [MODEL_CARD]})

    async def _aux(self, request):
        self.aux.append((request.method, request.path_qs, await request.read()))
        if request.path == "/version":
            return web.json_response({"version": "0.0-fake", "engine": self.name})
        return web.Response(status=200)

    async def _tokenize(self, request):
        raw = await request.read()
        self.aux.append((request.method, request.path_qs, raw))
        body = json.loads(raw)
        if request.path == "/detokenize":
            return web.json_response({"prompt": " ".join(f"t{t}" for t in body["tokens"])})
        tokens = [len(w) for w in str(body.get("prompt", "")).split()]
        return web.json_response({"count": len(tokens), "max_model_len": MAX_MODEL_LEN,
                                  "tokens": tokens, "token_strs": None})

    async def _metrics(self, request):
        info = ("" if self.block_size is None else
                f'vllm:cache_config_info{{block_size="{self.block_size}",'
                f'cache_dtype="auto"}} 1.0\n')
        return web.Response(text=info + 'vllm:num_requests_running{model_name="tiny"} 5.0\n'
                                        'vllm:num_requests_waiting{model_name="tiny"} 2.0\n')

    def kill(self) -> None:
        """Die from outside: every completion in progress loses its connection at once,
        and /health answers 503 until ``healthy`` is set again."""
        self.healthy = False
        for transport in list(self._open):
            transport.close()

    async def _complete(self, request):
        if self._refused(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = await request.json()
        self.requests.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        self.headers.append(dict(request.headers))
        if self.die_on is not None and self.die_on in _prompt_of(body):
            self.kill()
            request.transport.close()
            return web.Response()
        if self.hold is not None:
            if not self.healthy:  # killed while this request was on its way
                request.transport.close()
                return web.Response()
            self._open.add(request.transport)
            try:
                await self.hold.wait()
            finally:
                self._open.discard(request.transport)
        mode = self.mode
        if mode == "500":
            return web.json_response({"error": "boom"}, status=500)
        if mode == "400" and not (body.get("max_tokens") == 1 and set(body) <= {
                "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
                "kv_transfer_params"}):  # a one-token KV release passes
            return web.json_response({"error": {"message": "bad param"}}, status=400)
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "drop":
            request.transport.close()
            return web.Response()
        if mode == "notjson":
            return web.Response(status=200, body=b"<html>gateway page</html>",
                                content_type="text/html")
        if mode == "big":
            pad = "x" * self.big_bytes
            return web.json_response({"id": "x", "choices": [{"index": 0, "text": pad}],
                                      "kv_transfer_params": {"pad": pad}})
        if mode == "flood":
            return await self._flood(request)
        if mode == "deep" and not body.get("stream"):
            return web.Response(status=200, body=_DEEP_DOC, content_type="application/json")
        if mode == "empty":  # 200, then the stream ends before any byte
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            return resp
        prompt = _prompt_of(body)
        n_prompt = len(prompt.split())
        kvp = body.get("kv_transfer_params") or {}
        if kvp.get("do_remote_decode"):
            return web.json_response(self._prefill_answer(prompt, n_prompt, body))
        if body.get("stream"):
            return await self._stream(request, body, n_prompt)
        pt = self.report_prompt_tokens if self.report_prompt_tokens is not None else n_prompt
        text = "".join(self.tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                  if "messages" in body else {"index": 0, "text": text})
        return web.json_response({"id": "x", "choices": [choice], "usage": {
            "prompt_tokens": pt, "completion_tokens": len(self.tokens),
            "total_tokens": pt + len(self.tokens)}})

    def _prefill_answer(self, prompt: str, n_prompt: int, body: dict) -> dict:
        counts = domain_counts(prompt)
        kvp = {"do_remote_prefill": True, "do_remote_decode": False,
               "remote_engine_id": self.name, "remote_block_ids": [1, 2],
               "remote_host": "127.0.0.1", "remote_port": 1}
        choice = {"index": 0, "text": "t"}
        if self.payload == "counts":
            kvp["eldr"] = {**encode_counts(counts), "tokens": n_prompt - self.cached_tokens}
        elif self.payload == "blocks":
            kvp["eldr"] = encode_counts(np.stack([counts, counts]))
        elif self.payload == "garbage":
            kvp["eldr"] = {"v": 1, "shape": [L, E], "dtype": "uint16", "data": "!!"}
        elif self.payload == "routed":
            import base64
            import io
            ids = np.zeros((max(n_prompt, 1), L, 2), dtype=np.int32)
            lo = 0 if "code" in prompt else 4
            ids[:, :, 0], ids[:, :, 1] = lo, lo + 1
            buf = io.BytesIO()
            np.save(buf, ids)
            choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
        return {"id": "p", "choices": [choice], "kv_transfer_params": kvp,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": 1,
                          "total_tokens": n_prompt + 1}}

    async def _flood(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = b'data: {"choices": [{"index": 0, "text": "' + b"y" * 65536 + b'"}]}\n\n'
        try:
            while True:
                await resp.write(event)
                self.flooded += len(event)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise

    async def _stream(self, request, body: dict, n_prompt: int):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body
        try:
            for i, tok in enumerate(self.tokens):
                delta = {"delta": {"content": tok}} if chat else {"text": tok}
                await resp.write(b"data: " + json.dumps(
                    {"id": "x", "choices": [{"index": 0, **delta}]}).encode() + b"\n\n")
                if self.mode in ("break", "break_dead") and i == 0:
                    if self.mode == "break_dead":  # the engine dies mid-stream
                        self.healthy = False
                    request.transport.close()
                    return resp
                if self.mode == "slow":
                    await asyncio.sleep(0.05)
            opts = body.get("stream_options") or {}
            if self.mode == "deep":
                await resp.write(b"data: " + _DEEP_DOC + b"\n\n")
            if opts.get("include_usage"):
                pt = self.report_prompt_tokens if self.report_prompt_tokens is not None \
                    else n_prompt
                usage = {"prompt_tokens": pt, "completion_tokens": len(self.tokens),
                         "total_tokens": pt + len(self.tokens)}
                await resp.write(b"data: " + json.dumps(
                    {"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            if self.mode == "linger":
                await asyncio.sleep(0.3)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise
        self.finished_streams += 1
        return resp


@contextlib.asynccontextmanager
async def cluster(*, num_prefill: int = 1, num_decode: int = 2, policy: str = "eldr",
                  tau: float = 0.0, state_kw: dict | None = None, engine_kw: dict | None = None,
                  share=None, **config_kw):
    """Fake engines + a router in front; yields (router, client, prefills, decoders).
    ``share``: a :class:`~eldr.proxy.workers.sharedpool.WorkerShare` (the router is then
    one worker of ``--workers N``)."""
    from aiohttp.test_utils import TestClient

    prefills = [await FakeEngine(f"p{i}", **(engine_kw or {})).start()
                for i in range(num_prefill)]
    decoders = [await FakeEngine(f"d{k}", **(engine_kw or {})).start()
                for k in range(num_decode)]
    # the fakes' prompts are a few words: through the PD flow unless a test asks for the
    # short-prompt path (short_prompt_tokens > 0)
    settings = {"health_interval": 0.05, "health_timeout": 1.0, "unhealthy_after": 1,
                "artifact": None, "short_prompt_tokens": 0, **config_kw}
    config = ServeConfig(prefill_urls=tuple(e.url for e in prefills),
                         decode_urls=tuple(e.url for e in decoders), policy=policy,
                         **settings)
    names = tuple(["w-code", "w-other", "w-2", "w-3"][:num_decode])
    router = Router(config, state=make_state(config, tau=tau, names=names, **(state_kw or {})),
                    share=share)
    server = TestServer(router.make_app(), port=0, handler_cancellation=True)
    client = TestClient(server)
    await client.start_server()
    try:
        yield router, client, prefills, decoders
    finally:
        await client.close()
        for e in (*prefills, *decoders):
            await e.close()


def run(coro):
    return asyncio.run(coro)


async def until(predicate, what: str, timeout: float = 20.0, step: float = 0.01) -> None:
    """Wait until ``predicate()`` holds (a health round re-admitted a decoder, a job
    started...), for up to ``timeout`` s; AssertionError naming ``what`` if it never does.
    A test that waits a fixed time for such a thing fails on a loaded machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(step)


def spy_events(policy) -> list:
    """Record (event, request id, worker or outcome) of ``policy``'s dispatches and
    releases (wrapping its methods); the list fills as requests run."""
    events = []
    dispatch, release = policy.on_dispatch, policy.on_release

    def on_dispatch(request, worker):
        events.append(("dispatch", request.request_id, worker))
        dispatch(request, worker)

    def on_release(request_id, outcome):
        events.append(("release", request_id, outcome))
        release(request_id, outcome)

    policy.on_dispatch, policy.on_release = on_dispatch, on_release
    return events


@contextlib.asynccontextmanager
async def served_router(limits=None, *, front: bool = False, shutdown_timeout: float = 60.0,
                        **config_kw):
    """Fake engines (1 prefill, 2 decode) and a router on a real port, served as ``eldr
    serve`` serves it: the hardened aiohttp runner (:mod:`eldr.proxy.httpserver`, ``limits``
    an ``HttpLimits``), listening through the generate routes' fast front
    (:mod:`eldr.proxy.front`) when ``front``; yields (router, base URL, runner, decoders).
    The front is the runner's one site's ``front``."""
    from eldr.proxy.front import front_site
    from eldr.proxy.httpserver import HardenedAppRunner

    prefill = await FakeEngine("p0").start()
    decoders = [await FakeEngine(f"d{k}").start() for k in range(2)]
    settings = {"health_interval": 0.5, "health_timeout": 1.0, "unhealthy_after": 1,
                "artifact": None, **config_kw}
    config = ServeConfig(prefill_urls=(prefill.url,), decode_urls=tuple(d.url for d in decoders),
                         policy="eldr", **settings)
    router = Router(config, state=make_state(config))
    runner = HardenedAppRunner(router.make_app(), limits=limits, handler_cancellation=True,
                               access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = (front_site(runner, router, "127.0.0.1", 0) if front
            else web.TCPSite(runner, "127.0.0.1", 0))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield router, f"http://127.0.0.1:{port}", runner, decoders
    finally:
        await runner.cleanup()
        for engine in (prefill, *decoders):
            await engine.close()


@contextlib.asynccontextmanager
async def serve_task(*, http_limits=None, **config_kw):
    """``eldr serve``'s loop (:func:`eldr.proxy.serving.serve`) run in a task in front of
    one fake prefill and one fake decoder (``config_kw``: more of the ``ServeConfig``);
    yields the port it listens on, and stops it."""
    from eldr.proxy.serving import serve

    prefill = await FakeEngine("p0").start()
    decoder = await FakeEngine("d0").start()
    config = ServeConfig(prefill_urls=(prefill.url,), decode_urls=(decoder.url,),
                         artifact=None, port=0, health_interval=60, **config_kw)
    port = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(Router(config), ready=port.set_result,
                                       http_limits=http_limits))
    try:
        yield await asyncio.wait_for(port, 30)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await prefill.close()
        await decoder.close()
