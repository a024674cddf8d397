"""The aiohttp application of ``eldr serve``: an OpenAI-compatible PD router.

Routes::

    POST /v1/completions         the PD flow (eldr.proxy.request.flow), JSON or SSE
    POST /v1/chat/completions    the same for chat
    GET  /v1/models              the engines' model list, every field (relayed)
    GET  /health                 200 while >= 1 prefill and >= 1 decode instance are healthy
                                 (URLs, artifact path, last errors: admin token only)
    GET  /metrics                Prometheus text (eldr.proxy.metrics.RouterMetrics)
    POST /admin/reload           re-read the routing artifact (bearer token required)
    GET|POST /admin/decoders     list or add decoders at run time (control.elastic; token)
    DELETE /admin/decoders/NAME  drain a decoder, then remove it (token)
    GET /admin/learn[/trace]     the learner's state, its buffer as a trace (token; --learn)
    * /v1/eldr/*                 the decode-selection API (eldr.proxy.selection; token)
    GET|POST anything else       vLLM's auxiliary routes (/tokenize, /version, ...), forwarded
                                 to a healthy prefill instance (eldr.proxy.request.forward)

Every error is an OpenAI-style JSON document (:mod:`eldr.proxy.errors`): malformed JSON or
a non-object body → 400, an unknown model → 404, a route neither the router nor the
engines have → vLLM's own 404, a body over ``max_body_bytes`` → 413,
no healthy engine → 503, engines failing on every attempt → 502; anything unexpected is
logged with its traceback and answered as a JSON 500 that names no internals. The app runs with
aiohttp's handler cancellation on, so a client that disconnects cancels its handler and
with it the upstream requests (the engines see the connection close and abort).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from eldr.proxy.bodies import ints_only, parse_body
from eldr.proxy.config import ServeConfig
from eldr.proxy.control import (
    AdminToken,
    ElasticPool,
    ForwardLearning,
    JournalLink,
    LearnAdmin,
    LiveLearning,
    Reloader,
)
from eldr.proxy.engines import Instance, UpstreamPool, make_session
from eldr.proxy.errors import ProxyError, UpstreamReply, error_body
from eldr.proxy.metrics import RouterMetrics
from eldr.proxy.request import (
    KNOWN_ROUTES,
    OWN_ROUTES,
    Forwarder,
    LearnerHook,
    LiveRouting,
    PrefixAffinity,
    RequestFlow,
    RequestGuards,
    RoutingState,
    build_state,
    classify,
    is_stream_done,
    make_guards,
    method_not_allowed,
)
from eldr.proxy.selection import Selection, SelectionApi
from eldr.routing.loads import LoadTracker

if TYPE_CHECKING:
    from eldr.learn.config import LearnConfig
    from eldr.proxy.workers import WorkerShare

__all__ = ["Router"]

log = logging.getLogger("eldr.serve")

_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_OTHER_ROUTES = ("/v1/models", "/health", "/metrics", "/admin/reload", "/admin/decoders",
                 "/admin/learn", "/admin/learn/trace")


class Router:
    """The router: its parts wired together, and the HTTP routes that lead to them.

    ``Router(config)`` loads the artifact (raising ``ValueError`` for a bad one, before any
    socket is opened) and builds the parts, each given what it uses: the engines' pool,
    the request flow, the forwarder of vLLM's other routes, and the control side (admin
    token, reloads, the elastic pool, the learner). ``make_app()`` returns the aiohttp
    application; the HTTP client session and the health checks start with the app and
    stop with it. ``share``: what a worker of ``--workers N`` shares with the others (its
    pool's loads, its guards' memory); None: a router of its own.

    The routing snapshot and the config it was built from live in ``live``, which every
    part reads; only :meth:`swap` replaces them.
    """

    def __init__(self, config: ServeConfig, state: RoutingState | None = None, *,
                 share: WorkerShare | None = None) -> None:
        state = state if state is not None else build_state(config)
        self.live = LiveRouting(state, config)
        names = list(state.worker_names)
        tracker = LoadTracker(len(names)) if share is None else share.tracker(len(names))
        self.pool = UpstreamPool(config, names, tracker=tracker)
        self.affinity = PrefixAffinity(
            len(config.prefill_urls), block_chars=config.affinity_block_chars,
            max_blocks=config.affinity_max_blocks, capacity=config.affinity_capacity,
            spill=config.affinity_spill)
        self.pool.on_recover = self._on_recover
        self.pool.footprints.policy_of = lambda: self.live.state.policy  # swaps replace it
        self.metrics = RouterMetrics(self.pool)
        poison, budget = make_guards(config) if share is None else \
            make_guards(config, share.guards, share.row)
        guards = RequestGuards(poison, budget, pool=self.pool, metrics=self.metrics,
                               poison_ttl=config.poison_ttl)
        self.flow = RequestFlow(config, self.live, self.pool, self.affinity, self.metrics,
                                guards)
        self.forwarder = Forwarder(config, self.pool, self.metrics, self.flow.new_id)
        self.token = AdminToken(config.admin_token)
        changes = asyncio.Lock()  # reloads and pool changes: one at a time
        self.reloader = Reloader(self.live, self.swap, self.pool, self.metrics, self.token,
                                 changes)
        self.elastic = ElasticPool(self.live, self.swap, self.pool, self.metrics, self.token,
                                   changes, on_change=self._pool_changed)
        self.learn_admin = LearnAdmin(self.live, self.token)
        self.selection = SelectionApi(Selection(self.live, self.pool, self.metrics), self.token,
                                      self.elastic)  # /v1/eldr/*: docs/selection-api.md
        self.learner = None  # LiveLearning / ForwardLearning with eldr serve --learn
        self.session = None  # the HTTP client to the engines, while the app runs

    @property
    def state(self) -> RoutingState:
        """The routing snapshot new requests start with."""
        return self.live.state

    @property
    def config(self) -> ServeConfig:
        """The config the routing snapshot was built from (its artifact, its decoders)."""
        return self.live.config

    def swap(self, state: RoutingState, config: ServeConfig | None = None) -> None:
        """Replace the routing snapshot (and the config it was built from): an artifact
        reload, a decoder added or removed. Requests in flight keep the one they started
        with; the next ones take this."""
        self.live.state = state
        if config is not None:
            self.live.config = config
        if state.prompt is not None:  # its tokenizer's processes started before a request
            self.flow.prompts.prepare(state.prompt.tokenizer, state.prompt.predict)

    async def reload(self, artifact: str | None = None) -> RoutingState:
        """Reload the artifact (``POST /admin/reload`` and SIGHUP call this; with
        ``--workers N`` it goes through the pool journal to every worker)."""
        return await self.reloader.reload(artifact)

    # -- wiring after construction ---------------------------------------------------------
    def attach_learner(self, learner: LearnerHook) -> None:
        """Give the router its learner: the flow reports completed requests to it, the
        ``/admin/learn`` routes show it, pool changes are told to it."""
        self.learner = self.flow.learner = self.learn_admin.learner = learner

    def learn(self, config: LearnConfig, *, forward: bool = False) -> None:
        """``eldr serve --learn``: learn from the completed requests here, or, with
        ``forward`` (workers of ``--workers N`` but the first), send them to the worker
        that learns."""
        registry = self.metrics.registry
        self.attach_learner(ForwardLearning(self.live, registry) if forward else LiveLearning(
            config, live=self.live, pool=self.pool, registry=registry, reload=self.reload))

    def attach_link(self, link: JournalLink) -> None:
        """``--workers N``: pool changes and reloads go through the worker's link to the
        pool journal, and so do the learner's records."""
        self.elastic.link = self.reloader.link = link
        connect = getattr(self.learner, "connect", None)
        if connect is not None:
            connect(link)

    def _pool_changed(self, names: tuple[str, ...]) -> None:
        tell = getattr(self.learner, "on_pool_change", None)
        if tell is not None:
            tell(tuple(names))

    def _on_recover(self, inst: Instance) -> None:
        if inst.role == "prefill":  # a restarted engine has an empty prefix cache
            self.affinity.forget(inst.index)

    # -- application -----------------------------------------------------------------------
    def make_app(self):
        from aiohttp import web

        @web.middleware
        async def errors(request, handler):
            return await self._errors(request, handler)

        app = web.Application(client_max_size=self.live.config.max_body_bytes,
                              middlewares=[errors])
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_post("/admin/reload", self.reloader.route)
        app.router.add_route("*", "/admin/decoders", self.elastic.collection)
        app.router.add_route("*", "/admin/decoders/{name}", self.elastic.item)
        app.router.add_route("*", "/admin/learn", self.learn_admin.status)
        app.router.add_route("*", "/admin/learn/trace", self.learn_admin.trace)
        self.selection.mount(app)
        app.router.add_route("*", "/{tail:.*}", self.other_route)  # last: ours win
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app) -> None:
        import aiohttp

        # idle connections closed after 4 s: below the engines' (uvicorn) 5 s keep-alive,
        # as eldr.proxy.engines.client's own pool (docs/failures.md, idle sockets)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4, ttl_dns_cache=300)
        # No Accept-Encoding: engines answer uncompressed, and bytes are relayed as they come.
        self.session = make_session(aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar()))
        await self.pool.start(self.session)
        if self.learner is not None:
            await self.learner.start()

    async def _cleanup(self, app) -> None:
        if self.learner is not None:
            await self.learner.stop()
        await self.elastic.stop()
        await self.flow.stop()
        await self.pool.stop()
        if self.session is not None:
            await self.session.close()

    async def serve_generate(self, request):
        """A generate request (``/v1/completions``, ``/v1/chat/completions``) as the app
        serves it, error middleware included: what :mod:`eldr.proxy.front` calls."""
        return await self._errors(request, self.generate)

    async def _errors(self, request, handler):
        """Middleware: turn every error into an OpenAI-style answer; count requests."""
        from aiohttp import web

        try:
            resp = await handler(request)
        except ProxyError as exc:
            resp = web.Response(status=exc.status, body=exc.body(),
                                content_type="application/json")
        except UpstreamReply as exc:
            resp = web.Response(status=exc.status, body=exc.body,
                                content_type=exc.content_type or "application/json")
        except web.HTTPException as exc:  # aiohttp's own: unknown route, 405, 413
            if exc.status == 413:
                msg = f"request body is larger than {self.config.max_body_bytes} bytes"
            elif exc.status == 404:
                msg = f"no route {request.method} {request.path}"
            else:
                msg = exc.reason
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            resp = web.Response(status=exc.status, body=error_body(exc.status, msg),
                                content_type="application/json", headers=allow)
        except asyncio.CancelledError:
            if is_stream_done(request):  # closed right after [DONE]: a completed request
                self._count(request, 200)
                log.debug("%s %s completed; the client closed after [DONE]",
                          request.method, request.path)
            else:
                self.metrics.client_disconnects.inc()
                log.debug("%s %s: the client left before the end of its answer",
                          request.method, request.path)
            raise
        except Exception:  # a bug of ours: logged in full, answered without internals
            log.exception("unexpected error on %s %s", request.method, request.path)
            resp = web.Response(status=500, body=error_body(
                500, "internal error of the router; it was logged", code="internal_error"),
                content_type="application/json")
        self._count(request, resp.status)
        return resp

    def _count(self, request, status: int) -> None:
        path = request.path
        if path.startswith("/admin/decoders/"):
            path = "/admin/decoders"  # one series for every decoder name
        endpoint = _ENDPOINTS.get(path) or (
            path if path in _OTHER_ROUTES or path in KNOWN_ROUTES else "other")
        self.metrics.requests.inc(endpoint=endpoint, status=str(status))

    # -- handlers --------------------------------------------------------------------------
    async def generate(self, request):
        kind = _ENDPOINTS[request.path]
        limit = self.live.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ProxyError(413, f"request body is larger than {limit} bytes",
                             code="body_too_large")
        raw = await request.read()
        body = parse_body(raw, kind)
        self._check_model(body)
        self._check_context(body, kind)
        return await self.flow.run(request, body, kind, raw)

    def _check_context(self, body: dict, kind: str) -> None:
        """400 before the prefill for what the engines are sure to refuse after it, with
        vLLM 0.32's own messages: an output budget over the context
        (``max_tokens > max_model_len``) or a prompt of token ids longer than the context.
        A prompt plus ``max_tokens`` over the context is NOT refused: vLLM clamps
        ``max_tokens`` to what is left, and so must the router accept it."""
        limit = self.pool.max_model_len()
        if limit is None:
            return
        keys = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
        key = next((k for k in keys if body.get(k) is not None), None)
        value = body.get(key) if key else None
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise ProxyError(400, f"{key}={value} cannot be greater than max_model_len={limit}. "
                                  f"Please request fewer output tokens. (parameter={key}, "
                                  f"value={value})", param=key, code="context_exceeded")
        prompt = body.get("prompt") if kind == "completions" else None
        if isinstance(prompt, list) and len(prompt) > limit and ints_only(prompt):
            n = len(prompt)
            raise ProxyError(400, f"This model's maximum context length is {limit} tokens. "
                                  f"However, your prompt contains {n} input tokens, which "
                                  f"exceeds this limit even without any output tokens. Please "
                                  f"reduce the length of the input prompt. (parameter="
                                  f"input_tokens, value={n})", param="input_tokens",
                             code="context_exceeded")

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            return  # vLLM serves its default model
        known = self.pool.models()
        if not isinstance(model, str):
            raise ProxyError(400, "'model' must be a string", param="model")
        if known and model not in known:
            raise ProxyError(404, f"The model `{model}` does not exist.",
                             code="model_not_found", param="model")

    async def models(self, request):
        """The engines' own ``/v1/models`` (every field: ``root``, ``max_model_len``,
        ``permission``, ...), from a healthy prefill instance; when none answers, cards in
        vLLM's shape built from what the health checks learned."""
        from aiohttp import web

        doc = await self.forwarder.model_list()
        if doc is None:
            known = self.pool.models()
            if not known:
                raise ProxyError(503, "no model list yet: no engine has answered /v1/models",
                                 code="no_models")
            doc = self.forwarder.fallback_model_list(known, self.pool.max_model_len())
        return web.json_response(doc)

    async def other_route(self, request):
        """Every path but the router's own: vLLM's auxiliary routes are forwarded to a
        prefill instance; generations outside the PD flow and engine control routes are
        refused (:mod:`eldr.proxy.request.forward` says which and why)."""

        what = classify(request.method, request.path)
        if what == "forward":
            return await self.forwarder.forward(request)
        if what == "control":
            raise ProxyError(403, f"{request.path} changes an engine's state and is not "
                                  f"forwarded by the router: call the engine directly",
                             code="engine_control_route")
        if what == "generation":
            raise ProxyError(501, f"{request.path} is not routed: eldr serve runs the PD flow "
                                  f"for /v1/completions and /v1/chat/completions only",
                             code="route_not_routed")
        allow = (("POST" if request.path not in ("/v1/models", "/health", "/metrics")
                  else "GET") if request.path in OWN_ROUTES else "GET, POST")
        return method_not_allowed(allow)

    async def health(self, request):
        """Status and per-instance health; internals only for the admin token.

        The public answer names instances by worker id and says whether each takes
        requests and how busy it is; upstream URLs, the artifact's path and the last
        errors (which can carry hostnames and engine messages) need the admin token.
        """
        from aiohttp import web

        pool, state = self.pool, self.state
        ok = any(i.healthy for i in pool.prefill) and any(i.healthy for i in pool.decode)
        degraded = not all(i.healthy for i in (*pool.prefill, *pool.decode))
        admin = "Authorization" in request.headers and self.token.is_admin(request)
        public = ("name", "healthy", "in_flight", "engine_load", "breaker", "draining")

        def show(inst, **extra) -> dict:
            doc = inst.describe()
            return {**(doc if admin else {k: doc[k] for k in public if k in doc}), **extra}

        doc = {"status": "ok" if ok and not degraded else ("degraded" if ok else "unavailable"),
               "policy": state.policy.name,
               "prefill": [show(i) for i in pool.prefill],
               "decode": [show(i, load=float(pool.tracker.loads[i.index]))
                          for i in pool.decode]}
        if state.prompt is not None:  # routing on the prompt: its kernel and tokenizer
            doc["prompt_routing"] = "warming" if self.flow.prompts.warming() else "ready"
        if admin:
            doc.update(tau=state.tau, artifact=state.artifact,
                       artifact_loaded_at=state.loaded_at)
        return web.json_response(doc, status=200 if ok else 503)

    async def metrics_page(self, request):
        from aiohttp import web

        return web.Response(text=self.metrics.registry.render(),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})
