"""vLLM's routes that are not a PD generation, forwarded to one healthy prefill instance.

A client written for vLLM calls more than the two generation routes: ``vllm bench serve``
aligns its tokenizer with ``/tokenize``/``/detokenize`` and reads ``/v1/models``; load
balancers call ``/ping``; tools read ``/version``. The router answers each such route as
the engines would by asking one of them:

- the router's own routes keep priority (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/admin/*``); ``/admin/*`` is never forwarded;
- **generation routes** the router does not run as a PD flow (``/v1/responses``,
  ``/v1/messages``, ``/inference/v1/generate``, audio, ...) are refused (501): run on a
  prefill instance they would bypass the decode pool, and on a decoder they would find no
  transferred KV;
- **engine control routes** (``/sleep``, ``/wake_up``, ``/reset_prefix_cache``,
  ``/collective_rpc``, weight updates, LoRA loading, profiling, ``/pause``, ...) are refused
  (403): through a router they would change one arbitrary engine of the pool; an operator
  calls each engine directly;
- every other GET or POST goes to the least-busy healthy prefill instance (the next one if
  it cannot be reached), and its status, body and content type come back as they are, so a
  route the engines lack answers vLLM's own 404 (``{"detail": "Not Found"}``).

Bounds: the request body is capped by ``max_body_bytes`` (413), the answer by
``FORWARD_ANSWER_LIMIT`` (502 ``upstream_too_large``); the call by ``connect_timeout`` and
``prefill_timeout``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from eldr.proxy.bodies import json_object, read_upto
from eldr.proxy.config import ServeConfig
from eldr.proxy.engines import Instance, UpstreamPool, error_kind
from eldr.proxy.errors import ProxyError
from eldr.proxy.request.relay import report_failure

if TYPE_CHECKING:
    from eldr.proxy.metrics import RouterMetrics

__all__ = ["FORWARD_ANSWER_LIMIT", "Forwarder", "classify", "vllm_detail"]

log = logging.getLogger("eldr.serve")

FORWARD_ANSWER_LIMIT = 16 * 1024 * 1024  # bytes of a forwarded answer (a /tokenize of a long
# prompt is a few MB of JSON; nothing of vLLM's auxiliary API comes near)

# The router's own routes: never forwarded (a wrong method is a 405 here).
OWN_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                        "/metrics", "/admin/reload"})
# Generations the router does not run as a PD flow (exact paths and path prefixes).
GENERATION_ROUTES = frozenset({"/v1/responses", "/v1/messages", "/v1/chat/completions/batch",
                               "/inference/v1/generate", "/invocations", "/generative_scoring",
                               "/v1/systemone", "/cohere/v2/chat", "/v1/realtime"})
GENERATION_PREFIXES = ("/v1/responses/", "/v1/audio/")
# Routes that change an engine's state (vLLM's dev, RL, LoRA, elastic-EP and profiling APIs).
CONTROL_ROUTES = frozenset({
    "/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/reset_mm_cache",
    "/reset_encoder_cache", "/release_kv_cache_memory", "/start_profile", "/stop_profile",
    "/pause", "/resume", "/abort_requests", "/inference/v1/abort_requests",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
    "/start_weight_update", "/start_draft_weight_update", "/update_weights",
    "/finish_weight_update", "/update_weight_version", "/weight_checker",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/scale_elastic_ep",
    "/fault_tolerance/apply"})
CONTROL_PREFIXES = ("/admin/",)
FORWARD_METHODS = ("GET", "POST")
# metric labels of forwarded routes (anything else is "other": labels stay bounded)
KNOWN_ROUTES = frozenset({"/tokenize", "/detokenize", "/version", "/ping", "/load",
                          "/tokenizer_info", "/server_info", "/v1/embeddings", "/pooling",
                          "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                          "/v2/rerank", "/v1/completions/render",
                          "/v1/chat/completions/render", "/v1/messages/count_tokens"})
# request headers relayed to the engine (Authorization is handled apart)
_RELAYED = ("Content-Type", "Accept")


def classify(method: str, path: str) -> str:
    """What the router does with ``method path`` outside its own routes.

    ``"own"`` (a router route, wrong method: 405), ``"generation"`` (501), ``"control"``
    (403), ``"method"`` (not GET/POST: 405) or ``"forward"``.
    """
    if path in OWN_ROUTES:
        return "own"
    if path in CONTROL_ROUTES or path.startswith(CONTROL_PREFIXES):
        return "control"
    if path in GENERATION_ROUTES or path.startswith(GENERATION_PREFIXES):
        return "generation"
    if method not in FORWARD_METHODS:
        return "method"
    return "forward"


def vllm_detail(detail: str) -> bytes:
    """The body vLLM's server (FastAPI) gives for a route it lacks (``"Not Found"``) or a
    wrong method (``"Method Not Allowed"``)."""
    return json.dumps({"detail": detail}).encode()


def method_not_allowed(allow: str):
    """vLLM's 405 for a wrong method on a route (``allow``: the methods it takes)."""
    from aiohttp import web

    return web.Response(status=405, body=vllm_detail("Method Not Allowed"),
                        content_type="application/json", headers={"Allow": allow})


class Forwarder:
    """Forwards one request to a healthy prefill instance of ``pool`` (``new_id``: a fresh
    request id, for a client that sent none)."""

    def __init__(self, config: ServeConfig, pool: UpstreamPool, metrics: RouterMetrics,
                 new_id: Callable[[], str]) -> None:
        self.config, self.pool, self.metrics, self._new_id = config, pool, metrics, new_id

    async def forward(self, request):
        """The engine's answer to ``request`` (an aiohttp ``web.Response``)."""
        from aiohttp import web

        raw = await request.read() if request.method == "POST" else None  # max_body_bytes
        status, body, ctype, inst = await self.call(request.method, request.path_qs, raw,
                                                    request.headers)
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or self._new_id(),
                   "X-Eldr-Prefill": inst.name}
        resp = web.Response(status=status, body=bytes(body), headers=headers)
        resp.content_type = ctype or "application/octet-stream"
        return resp

    async def call(self, method: str, path_qs: str, raw: bytes | None,
                   client_headers=None) -> tuple[int, bytes, str | None, Instance]:
        """(status, body, content type, instance) of ``method path_qs`` at a prefill engine.

        Instances are tried least-busy first; one that cannot be reached (or answers 5xx)
        is reported like a failed request and the next is tried.
        """
        import aiohttp

        pool, config = self.pool, self.config
        headers = {h: client_headers[h] for h in _RELAYED
                   if client_headers is not None and h in client_headers}
        if client_headers is not None and "Authorization" in client_headers:
            headers["Authorization"] = client_headers["Authorization"]
        headers.update(pool.auth_headers())  # the engines' key replaces the client's
        timeout = aiohttp.ClientTimeout(total=config.prefill_timeout,
                                        sock_connect=config.connect_timeout)
        order = sorted((i for i in pool.prefill if i.healthy), key=lambda i: i.in_flight)
        if not order:
            raise ProxyError(503, "no healthy prefill instance", code="no_prefill")
        last = None
        for inst in order:
            pool.begin(inst)
            try:
                async with pool.session.request(method, inst.url + path_qs, data=raw,
                                                headers=headers, timeout=timeout) as resp:
                    status, ctype = resp.status, resp.headers.get("Content-Type")
                    body, whole = await read_upto(resp, FORWARD_ANSWER_LIMIT)
            except Exception as exc:  # unreachable, reset, timeout: the next instance
                report_failure(pool, self.metrics, inst, error_kind(exc), exc)
                last = f"{inst.name}: {error_kind(exc)}"
                continue
            finally:
                pool.end(inst)
            if status >= 500:
                report_failure(pool, self.metrics, inst, "http_5xx", f"status {status}")
                last = f"{inst.name}: status {status}"
                continue
            if not whole:
                self.metrics.upstream_errors.inc(role=inst.role, instance=inst.name,
                                                 kind="too_large")
                raise ProxyError(502, f"the engine's answer to {path_qs.split('?')[0]} is "
                                      f"larger than {FORWARD_ANSWER_LIMIT} bytes",
                                 code="upstream_too_large")
            return status, body, ctype, inst
        raise ProxyError(502, f"no prefill instance answered ({last})", code="upstream_failed")

    async def model_list(self) -> dict | None:
        """The engines' ``/v1/models`` document, every field of every card (None: no
        engine answered with a model list). Cards of models the router does not accept
        (``--model``) are left out."""
        try:
            status, body, _, _ = await self.call("GET", "/v1/models", None)
        except ProxyError:
            return None
        doc = json_object(body) if status == 200 else None
        data = doc.get("data") if doc is not None else None
        if not isinstance(data, list):
            return None
        accepted = self.config.models
        if accepted:
            doc["data"] = [m for m in data if isinstance(m, dict) and m.get("id") in accepted]
        return doc

    def fallback_model_list(self, known: tuple[str, ...], max_model_len: int | None) -> dict:
        """A ``/v1/models`` document in vLLM's card shape from what health checks learned
        (used when no engine answers the call itself)."""
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "vllm", "root": m,
             "parent": None, "max_model_len": max_model_len, "permission": []}
            for m in known]}
