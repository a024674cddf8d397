"""A small PD orchestrator (``eldr orchestrate``) of our own that takes every decode decision
from ``eldr serve``'s selection API (docs/selection-api.md) and sends the prefill and the
decode itself, as vLLM's PD proxy does.

One ``POST /v1/completions`` (JSON or SSE):

1. ``--select-on payload`` (default): the prefill (the request asking one token, not
   streamed, with ``kv_transfer_params = {"do_remote_decode": true, ...}``) goes to a
   prefill engine, round robin; its answer's ``kv_transfer_params`` (with the capture
   plugin's ``eldr`` payload) and ``usage.prompt_tokens`` go to ``POST /v1/eldr/reserve``;
   ``--select-on tokens``: the prompt (token ids, or text the router tokenizes with the
   tokenizer its prompt predictor was fitted with) goes to ``/v1/eldr/reserve`` BEFORE the
   prefill;
2. ``POST /v1/eldr/reservations/{id}/prefill_complete`` once the prefill answered;
3. the client's request plus the prefill's ``kv_transfer_params`` (less the payload) goes to
   the reserved decoder, whose answer is relayed as it comes (headers ``X-Eldr-Decoder``,
   ``X-Eldr-Reservation``, ``X-Eldr-Input``: what the decision was made from);
4. ``POST /v1/eldr/reservations/{id}/release`` with the outcome: ``completed``, ``failed``
   (an engine's error, a broken connection) or ``cancelled`` (the client left).

Nothing is retried: this is the API's reference client, not a second router (``eldr serve``
is the router with retries, breakers and the rest). ``GET /v1/models`` is a prefill
engine's; ``GET /health`` says whether the selection API answers.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from dataclasses import dataclass

TOKEN_ENV = "ELDR_ADMIN_TOKEN"  # where the admin token may come from instead of a file
_API = "/v1/eldr"

log = logging.getLogger("eldr.orchestrate")


@dataclass(frozen=True, slots=True)
class OrchestrateConfig:
    """What ``eldr orchestrate`` runs with (checked)."""

    router: str  # eldr serve's base URL
    prefill_urls: tuple[str, ...]  # prefill engines, round robin
    token: str  # eldr serve's admin token (the selection API's)
    select_on: str = "payload"  # "payload": after the prefill; "tokens": before it
    register: tuple[tuple[str | None, str], ...] = ()  # (name or None, url) to register
    host: str = "127.0.0.1"
    port: int = 8100
    timeout: float = 120.0  # seconds for one engine or API call

    def __post_init__(self) -> None:
        from eldr.proxy.config import check_url

        for url in (self.router, *self.prefill_urls, *(u for _, u in self.register)):
            check_url(url, "engine or router")
        if not self.prefill_urls:
            raise ValueError("give at least one --prefill URL")
        if not self.token:
            raise ValueError(f"the selection API needs eldr serve's admin token: give "
                             f"--admin-token-file PATH or set {TOKEN_ENV}")
        if self.select_on not in ("payload", "tokens"):
            raise ValueError(f"select_on must be payload or tokens, got {self.select_on!r}")
        if not (self.timeout > 0):
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")


class SelectionUnavailable(Exception):
    """The selection API refused or could not be reached: ``status`` for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class SelectionClient:
    """The selection API of one ``eldr serve`` (``base``: its URL), over ``session``."""

    def __init__(self, session, base: str, token: str, timeout: float) -> None:
        import aiohttp

        self.session, self.base = session, base.rstrip("/") + _API
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        import aiohttp

        try:
            async with self.session.request(method, self.base + path, json=body,
                                            headers=self.headers,
                                            timeout=self.timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise SelectionUnavailable(503, f"the selection API at {self.base} cannot be "
                                            f"reached: {exc or type(exc).__name__}") from None
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if status >= 400 or not isinstance(doc, dict):
            message = (doc or {}).get("error", {}).get("message") if isinstance(doc, dict) \
                else raw[:200].decode(errors="replace")
            raise SelectionUnavailable(status if status >= 400 else 502,
                                       f"selection API: {message}")
        return doc

    async def reserve(self, body: dict) -> dict:
        return await self.call("POST", "/reserve", body)

    async def prefill_complete(self, rid: str) -> dict:
        return await self.call("POST", f"/reservations/{rid}/prefill_complete", {})

    async def release(self, rid: str, outcome: str) -> None:
        try:
            await self.call("POST", f"/reservations/{rid}/release", {"outcome": outcome})
        except SelectionUnavailable as exc:  # it expires on the router then: logged
            log.warning("releasing reservation %s (%s) failed: %s", rid, outcome, exc)

    async def workers(self) -> list[dict]:
        return (await self.call("GET", "/workers"))["workers"]

    async def register(self, url: str, name: str | None) -> dict:
        return await self.call("POST", "/workers", {"url": url, **({"name": name} if name
                                                                   else {})})


async def _answer_json_errors(request, handler):
    """aiohttp's own refusals (unknown route 404, wrong method 405) in the JSON shape
    ``eldr serve`` answers them in, with the ``Allow`` header kept."""
    from aiohttp import web

    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        msg = (f"no route {request.method} {request.path}" if exc.status == 404
               else exc.reason)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        resp = _error(exc.status, msg)
        if allow:
            resp.headers.update(allow)
        return resp


def _json_errors():
    from aiohttp import web

    return web.middleware(_answer_json_errors)


def _error(status: int, message: str):
    from aiohttp import web

    from eldr.proxy.errors import error_body

    return web.Response(status=status, body=error_body(status, message),
                        content_type="application/json")


class Orchestrator:
    """The HTTP app of ``eldr orchestrate`` (:meth:`make_app`)."""

    def __init__(self, config: OrchestrateConfig) -> None:
        self.config = config
        self._prefills = itertools.cycle(config.prefill_urls)
        self.session = None
        self.api: SelectionClient | None = None
        self._background: set[asyncio.Task] = set()  # releases of cancelled requests

    def make_app(self):
        from aiohttp import web

        app = web.Application(middlewares=[_json_errors()])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=self.config.timeout))
        self.api = SelectionClient(self.session, self.config.router, self.config.token,
                                   self.config.timeout)
        if self.config.register:
            await self.register()

    async def _cleanup(self, app) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def register(self) -> list[str]:
        """Register the ``--register`` decoders the router does not have yet."""
        known = {w["url"].rstrip("/") for w in await self.api.workers()}
        added = []
        for name, url in self.config.register:
            if url.rstrip("/") not in known:
                doc = await self.api.register(url, name)
                added.append(doc["added"]["name"])
        return added

    # -- routes ----------------------------------------------------------------------------
    async def health(self, request):
        from aiohttp import web

        try:
            workers = await self.api.workers()
        except SelectionUnavailable as exc:
            return _error(503, str(exc))
        return web.json_response({"status": "ok", "workers": [w["name"] for w in workers]})

    async def models(self, request):
        from aiohttp import web

        url = self.config.prefill_urls[0] + "/v1/models"
        try:
            async with self.session.get(url) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type=resp.content_type)
        except Exception as exc:  # an engine down: the client's 502
            return _error(502, f"{url}: {exc or type(exc).__name__}")

    async def completions(self, request):
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict) or "prompt" not in body:
            return _error(400, "request body must be a JSON object with a 'prompt'")
        rid = f"orch-{uuid.uuid4().hex}"
        held: dict = {}  # "reservation", once reserved: released whatever happens next
        outcome = "failed"
        try:
            resp, outcome = await self._serve(request, body, rid, held)
            return resp
        except SelectionUnavailable as exc:
            return _error(exc.status, str(exc))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if "reservation" in held:
                release = asyncio.ensure_future(self.api.release(held["reservation"]["id"],
                                                                 outcome))
                if outcome == "cancelled":  # this task is being cancelled: in the background
                    self._background.add(release)
                    release.add_done_callback(self._background.discard)
                else:
                    await release

    async def _serve(self, request, body: dict, rid: str, held: dict):
        """(the client's response, outcome) of one completion; the reservation, once made,
        goes into ``held``."""
        from eldr.capture.payload import PAYLOAD_KEY
        from eldr.proxy.request import split_kv_params
        from eldr.proxy.request.prefill import PREFILL_KV_PARAMS, prefill_body

        prefill = next(self._prefills)
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        if self.config.select_on == "tokens":  # the router tokenizes: no extra call
            held["reservation"] = await self._reserve({"prompt": body["prompt"],
                                                       "request_id": rid})
        _status, doc, answer = await self._post(
            prefill + "/v1/completions",
            prefill_body(body, "completions", PREFILL_KV_PARAMS), headers)
        if doc is None:  # the prefill failed: nothing to decode
            return answer, "failed"
        relay, payload = split_kv_params(doc)
        if "reservation" not in held:
            ask: dict = {"request_id": rid}
            if payload is not None:
                ask[PAYLOAD_KEY] = payload
            usage = doc.get("usage")
            pt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            if isinstance(pt, int) and not isinstance(pt, bool) and pt >= 0:
                ask["prompt_tokens"] = pt
            held["reservation"] = await self._reserve(ask)
        reservation = held["reservation"]
        await self.api.prefill_complete(reservation["id"])
        decode = dict(body)
        decode.pop("kv_transfer_params", None)
        if relay is not None:
            decode["kv_transfer_params"] = relay
        resp, ok = await self._decode(request, reservation, decode, headers)
        return resp, "completed" if ok else "failed"

    async def _reserve(self, ask: dict) -> dict:
        """The reservation (with what the decision was made from, for the answer's
        ``X-Eldr-Input`` header)."""
        doc = await self.api.reserve(ask)
        return {**doc["reservation"], "input": doc["input"], "fallback": doc["fallback"]}

    async def _post(self, url: str, data: bytes, headers: dict):
        """(status, JSON object or None, the client's error answer or None) of one call."""
        import aiohttp

        try:
            async with self.session.post(url, data=data, headers=headers) as resp:
                raw = await resp.read()
                status, ctype = resp.status, resp.content_type
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return 502, None, _error(502, f"{url}: {exc or type(exc).__name__}")
        if status >= 400:
            from aiohttp import web

            return status, None, web.Response(status=status, body=raw, content_type=ctype)
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            return 502, None, _error(502, f"{url} answered something that is not a JSON "
                                          f"object")
        return status, doc, None

    async def _decode(self, request, reservation: dict, body: dict, headers: dict):
        """(the client's response, whether the decode completed) at the reserved decoder,
        relayed as it comes (SSE) or whole (JSON)."""
        import aiohttp
        from aiohttp import web

        url = reservation["url"] + "/v1/completions"
        reply = {"X-Eldr-Decoder": reservation["worker"] or "",
                 "X-Eldr-Reservation": reservation["id"],
                 "X-Eldr-Input": reservation["input"] + (
                     f"; fallback={reservation['fallback']}" if reservation["fallback"] else "")}
        stream = None
        try:
            async with self.session.post(url, data=json.dumps(body).encode(),
                                         headers=headers) as up:
                if up.status >= 400 or not body.get("stream"):
                    raw = await up.read()
                    return web.Response(status=up.status, body=raw,
                                        content_type=up.content_type,
                                        headers=reply), up.status < 400
                stream = web.StreamResponse(status=200, headers={
                    **reply, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await stream.prepare(request)
                async for chunk in up.content.iter_any():
                    await stream.write(chunk)
                await stream.write_eof()
                return stream, True
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            message = f"decode at {reservation['worker']} failed: {exc or type(exc).__name__}"
            if stream is None:
                return _error(502, message), False
            log.warning("%s (mid-stream)", message)
            return stream, False  # the client sees its stream end without [DONE]


async def serve(orchestrator: Orchestrator, *, ready=None) -> None:
    """Run until SIGINT/SIGTERM (:func:`eldr.proxy.serving.run_app`); ``ready(port)`` once
    listening."""
    from aiohttp import web

    from eldr.proxy.serving import run_app

    config = orchestrator.config

    def banner(host: str, port: int) -> str:
        return (f"eldr orchestrate: listening on http://{host}:{port} (selection API at "
                f"{config.router}, {len(config.prefill_urls)} prefill, select on "
                f"{config.select_on})")

    await run_app(web.AppRunner(orchestrator.make_app(), access_log=None), host=config.host,
                  port=config.port, banner=banner, ready=ready)
