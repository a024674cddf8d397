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

from eldr.proxy.bodies import parse_body
from eldr.proxy.config import ServeConfig
from eldr.proxy.control.admin import AdminRoutes, FailedAttempts
from eldr.proxy.control.elastic import ElasticPool
from eldr.proxy.control.learn_admin import LearnAdmin
from eldr.proxy.engines.upstream import UpstreamPool, make_session
from eldr.proxy.request.containment import make_guards
from eldr.routing.loads import LoadTracker

if TYPE_CHECKING:
    from eldr.proxy.workers.sharedpool import WorkerShare
from eldr.proxy.errors import ProxyError, UpstreamReply, error_body
from eldr.proxy.metrics import RouterMetrics
from eldr.proxy.request.affinity import PrefixAffinity
from eldr.proxy.request.decision import RoutingState, build_state
from eldr.proxy.request.flow import RequestFlow
from eldr.proxy.request.forward import (
    KNOWN_ROUTES,
    OWN_ROUTES,
    Forwarder,
    classify,
    method_not_allowed,
)
from eldr.proxy.request.relay import is_stream_done

__all__ = ["Router"]

log = logging.getLogger("eldr.serve")

_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_OTHER_ROUTES = ("/v1/models", "/health", "/metrics", "/admin/reload", "/admin/decoders",
                 "/admin/learn", "/admin/learn/trace")


class Router(AdminRoutes):
    """The router's long-lived state: config, engines, routing snapshot, metrics, session.

    ``Router(config)`` loads the artifact (raising ``ValueError`` for a bad one, before any
    socket is opened); ``make_app()`` returns the aiohttp application; the HTTP client
    session and the health checks start with the app and stop with it. ``share``: what a
    worker of ``--workers N`` shares with the others (its pool's loads, its guards' memory);
    None: a router of its own.
    """

    def __init__(self, config: ServeConfig, state: RoutingState | None = None, *,
                 share: WorkerShare | None = None) -> None:
        self.config = config
        self.state: RoutingState = state if state is not None else build_state(config)
        names = list(self.state.worker_names)
        tracker = LoadTracker(len(names)) if share is None else share.tracker(len(names))
        self.pool = UpstreamPool(config, names, tracker=tracker)
        self.affinity = PrefixAffinity(
            len(config.prefill_urls), block_chars=config.affinity_block_chars,
            max_blocks=config.affinity_max_blocks, capacity=config.affinity_capacity,
            spill=config.affinity_spill)
        self.pool.on_recover = self._on_recover
        self.pool.footprints.policy_of = lambda: self.state.policy  # reloads replace it
        self.metrics = RouterMetrics(self.pool)
        guards = make_guards(config) if share is None else \
            make_guards(config, share.guards, share.row)
        self.flow = RequestFlow(self, *guards)
        self.forwarder = Forwarder(self)
        self.session = None
        self._reload_lock = asyncio.Lock()
        self._failed_tokens = FailedAttempts()  # wrong admin tokens per client address
        # (L, E) the engines' prefill payloads declared last: the served model's fingerprint
        self.engine_shape: tuple[int, int] | None = None
        self.learner = None  # eldr.proxy.control.learning.LiveLearning with eldr serve --learn
        self.elastic = ElasticPool(self)  # decoders added/removed at run time

    def _on_recover(self, inst) -> None:
        if inst.role == "prefill":  # a restarted engine has an empty prefix cache
            self.affinity.forget(inst.index)

    # -- application -----------------------------------------------------------------------
    def make_app(self):
        from aiohttp import web

        @web.middleware
        async def errors(request, handler):
            return await self._errors(request, handler)

        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[errors])
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_post("/admin/reload", self.admin_reload)
        app.router.add_route("*", "/admin/decoders", self.elastic.collection)
        app.router.add_route("*", "/admin/decoders/{name}", self.elastic.item)
        learn = LearnAdmin(self)
        app.router.add_route("*", "/admin/learn", learn.status)
        app.router.add_route("*", "/admin/learn/trace", learn.trace)
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
        if request.content_length is not None and \
                request.content_length > self.config.max_body_bytes:
            raise ProxyError(413, f"request body is larger than {self.config.max_body_bytes} "
                                  f"bytes", code="body_too_large")
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
        if isinstance(prompt, list) and len(prompt) > limit and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
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
        admin = "Authorization" in request.headers and self._is_admin(request)
        public = ("name", "healthy", "in_flight", "engine_load", "breaker", "draining")

        def show(inst, **extra) -> dict:
            doc = inst.describe()
            return {**(doc if admin else {k: doc[k] for k in public if k in doc}), **extra}

        doc = {"status": "ok" if ok and not degraded else ("degraded" if ok else "unavailable"),
               "policy": state.policy.name,
               "prefill": [show(i) for i in pool.prefill],
               "decode": [show(i, load=float(pool.tracker.loads[i.index]))
                          for i in pool.decode]}
        if admin:
            doc.update(tau=state.tau, artifact=state.artifact,
                       artifact_loaded_at=state.loaded_at)
        return web.json_response(doc, status=200 if ok else 503)

    async def metrics_page(self, request):
        from aiohttp import web

        return web.Response(text=self.metrics.registry.render(),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})
