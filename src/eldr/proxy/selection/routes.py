"""The selection API's HTTP routes, mounted on ``eldr serve``'s app (docs/selection-api.md).

Routes (every one needs the admin token, as ``/admin/*``)::

    GET    /v1/eldr/workers                       the decoders: load, reservations, health
    POST   /v1/eldr/workers                       register a decoder {"url", "name"?}
    DELETE /v1/eldr/workers/{name}                drain it, then remove it
    POST   /v1/eldr/select                        which decoder (nothing reserved)
    POST   /v1/eldr/reserve                       select and reserve (also /select_and_reserve)
    GET    /v1/eldr/reservations/{id}             a reservation's state
    POST   /v1/eldr/reservations/{id}/prefill_complete   the decode starts {"ttl"?}
    POST   /v1/eldr/reservations/{id}/release     the request ended {"outcome"?}
    DELETE /v1/eldr/reservations/{id}[?outcome=]  the same release

Registering and removing decoders are the elastic pool's (``/admin/decoders``): the same
checks, answers and journal across ``--workers N``. Every error is the router's JSON error
document; a bad body is a 400 naming the field, an unknown reservation a 404, an ended one
409 (410 when it expired).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import numpy as np

from eldr.capture.payload import PAYLOAD_KEY
from eldr.proxy.bodies import ints_only
from eldr.proxy.errors import ProxyError
from eldr.proxy.request import method_not_allowed
from eldr.proxy.selection.service import Query, Selection

if TYPE_CHECKING:
    from eldr.proxy.control import AdminToken, ElasticPool

__all__ = ["PREFIX", "SelectionApi"]

PREFIX = "/v1/eldr"
_SELECT_FIELDS = ("token_ids", "prompt", "messages", PAYLOAD_KEY, "kv_transfer_params",
                  "prompt_tokens", "candidates")
_RESERVE_FIELDS = (*_SELECT_FIELDS, "request_id", "ttl")
_MAX_TOKEN_IDS = 1 << 20  # ids in one prompt (a body is capped by --max-body-bytes anyway)


class SelectionApi:
    """The HTTP side of :class:`~eldr.proxy.selection.service.Selection`: ``token``
    guards every route, ``elastic`` registers and removes decoders."""

    def __init__(self, selection: Selection, token: AdminToken, elastic: ElasticPool) -> None:
        self.selection, self.token, self.elastic = selection, token, elastic

    def share(self, table, row: int) -> None:
        """``eldr serve --workers N``: the reservation table every worker shares
        (:meth:`Selection.share`)."""
        self.selection.share(table, row)

    def mount(self, app) -> None:
        """Add the routes (before the router's catch-all) and the sweep's life cycle."""
        add = app.router.add_route
        add("*", f"{PREFIX}/workers", self.workers)
        add("*", f"{PREFIX}/workers/{{name}}", self.worker)
        add("*", f"{PREFIX}/select", self.select)
        add("*", f"{PREFIX}/reserve", self.reserve)
        add("*", f"{PREFIX}/select_and_reserve", self.reserve)  # Dynamo's name for it
        add("*", f"{PREFIX}/reservations/{{rid}}", self.reservation)
        add("*", f"{PREFIX}/reservations/{{rid}}/{{action}}", self.reservation_action)
        add("*", f"{PREFIX}/{{tail:.*}}", self.unknown)  # never forwarded to an engine
        app.on_startup.append(self.selection.start)
        app.on_cleanup.append(self.selection.stop)

    # -- handlers --------------------------------------------------------------------------
    async def workers(self, request):
        from aiohttp import web

        if request.method == "POST":
            return await self.elastic.collection(request)  # authorizes; 201 with the pool
        if request.method != "GET":
            return method_not_allowed("GET, POST")
        self.token.authorize(request)
        sel, pool = self.selection, self.selection.pool
        loads, available = pool.tracker.loads, pool.decode_available()
        active = sel._active_by_name()
        return web.json_response({
            "policy": sel.live.state.policy.name,
            "workers": [{"name": i.name, "url": i.url, "healthy": i.healthy,
                         "available": bool(available[i.index]), "draining": i.draining,
                         "load": float(loads[i.index]),
                         "reservations": int(active.get((i.name,), 0))}
                        for i in pool.decode]})

    async def worker(self, request):
        if request.method != "DELETE":
            return method_not_allowed("DELETE")
        return await self.elastic.item(request)  # authorizes; 202 draining, 404 unknown

    async def select(self, request):
        from aiohttp import web

        if request.method != "POST":
            return method_not_allowed("POST")
        self.token.authorize(request)
        query = parse_query(await _json_body(request, required=True), reserve=False)
        return web.json_response(self.selection.select(query))

    async def reserve(self, request):
        from aiohttp import web

        if request.method != "POST":
            return method_not_allowed("POST")
        self.token.authorize(request)
        query = parse_query(await _json_body(request, required=True), reserve=True)
        return web.json_response(self.selection.reserve(query), status=201)

    async def reservation(self, request):
        from aiohttp import web

        if request.method not in ("GET", "DELETE"):
            return method_not_allowed("GET, DELETE")
        self.token.authorize(request)
        rid = request.match_info["rid"]
        if request.method == "DELETE":  # a release, the outcome in the query
            unknown = sorted(set(request.query) - {"outcome"})
            if unknown:
                raise ProxyError(400, f"unknown query parameter(s) {unknown}; DELETE takes "
                                      f"?outcome=completed|failed|cancelled",
                                 code="invalid_request", param=unknown[0])
            return web.json_response(
                self.selection.release(rid, request.query.get("outcome", "completed")))
        return web.json_response({"reservation": self.selection.describe(rid)})

    async def reservation_action(self, request):
        from aiohttp import web

        action = request.match_info["action"]
        if action not in ("prefill_complete", "release"):
            raise ProxyError(404, f"no route {request.method} {request.path}: a reservation "
                                  f"takes prefill_complete and release",
                             code="no_route")
        if request.method != "POST":
            return method_not_allowed("POST")
        self.token.authorize(request)
        body = await _json_body(request, required=False)
        rid = request.match_info["rid"]
        if action == "prefill_complete":
            _only(body, ("ttl",))
            return web.json_response(self.selection.prefill_complete(rid, _ttl(body)))
        _only(body, ("outcome",))
        outcome = body.get("outcome", "completed")
        if not isinstance(outcome, str):
            raise ProxyError(400, "'outcome' must be a string: completed, failed or "
                                  "cancelled", code="invalid_request", param="outcome")
        return web.json_response(self.selection.release(rid, outcome))

    async def unknown(self, request):
        raise ProxyError(404, f"no route {request.method} {request.path}; the selection API "
                              f"has {PREFIX}/workers, /select, /reserve (/select_and_reserve) "
                              f"and "
                              f"/reservations/ID[/prefill_complete|/release]",
                         code="no_route")


# -- bodies --------------------------------------------------------------------------------
async def _json_body(request, *, required: bool) -> dict:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise ProxyError(400, "request body must be a JSON object", code="invalid_request")
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise ProxyError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", code="invalid_request")
    return body


def _only(body: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ProxyError(400, f"unknown field(s) {unknown}; this route takes "
                              f"{list(allowed) or 'no fields'}", code="invalid_request",
                         param=unknown[0])


def _bad(param: str, message: str) -> ProxyError:
    return ProxyError(400, f"'{param}' {message}", code="invalid_request", param=param)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ttl(body: dict) -> float | None:
    ttl = body.get("ttl")
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or ttl <= 0:
        raise _bad("ttl", f"must be a number of seconds > 0, got {ttl!r}")
    return float(ttl)


def parse_query(body: dict, *, reserve: bool) -> Query:
    """A checked :class:`Query` from a select (``reserve`` False) or reserve body;
    ``ProxyError`` 400 naming the first bad field."""
    _only(body, _RESERVE_FIELDS if reserve else _SELECT_FIELDS)
    token_ids = body.get("token_ids")
    if token_ids is not None:
        if not isinstance(token_ids, list) or not token_ids:
            raise _bad("token_ids", "must be a non-empty list of token ids (integers >= 0)")
        if len(token_ids) > _MAX_TOKEN_IDS:
            raise _bad("token_ids", f"has more than {_MAX_TOKEN_IDS} ids")
        if not (ints_only(token_ids) and min(token_ids) >= 0):
            bad = next(t for t in token_ids if not (_is_int(t) and t >= 0))
            raise _bad("token_ids", f"must hold integers >= 0, found {bad!r}")
        token_ids = np.asarray(token_ids, dtype=np.int64)
    text = None
    given = [k for k in ("token_ids", "prompt", "messages") if body.get(k) is not None]
    if len(given) > 1:
        raise _bad(given[1], f"cannot be given with '{given[0]}': one prompt at a time")
    if body.get("prompt") is not None:
        prompt = body["prompt"]
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
            raise _bad("prompt", "must be a non-empty string or a list of token ids")
        text = {"prompt": prompt}
    elif body.get("messages") is not None:
        messages = body["messages"]
        if not (isinstance(messages, list) and messages and
                all(isinstance(m, dict) for m in messages)):
            raise _bad("messages", "must be a non-empty list of chat messages (objects)")
        text = {"messages": messages}
    payload = body.get(PAYLOAD_KEY)
    kvp = body.get("kv_transfer_params")
    if kvp is not None:
        if not isinstance(kvp, dict):
            raise _bad("kv_transfer_params", "must be an object (the prefill answer's "
                                             "kv_transfer_params)")
        if payload is not None and PAYLOAD_KEY in kvp:
            raise _bad(PAYLOAD_KEY, "is given twice: alone and in kv_transfer_params")
        payload = kvp.get(PAYLOAD_KEY, payload)
    if payload is not None and not isinstance(payload, dict):
        raise _bad(PAYLOAD_KEY, "must be an object: the capture plugin's eldr payload")
    prompt_tokens = body.get("prompt_tokens")
    if prompt_tokens is not None and not (_is_int(prompt_tokens) and prompt_tokens >= 0):
        raise _bad("prompt_tokens", f"must be an integer >= 0, got {prompt_tokens!r}")
    candidates = body.get("candidates")
    if candidates is not None:
        if not isinstance(candidates, list) or not candidates or \
                not all(isinstance(c, str) and c for c in candidates):
            raise _bad("candidates", "must be a non-empty list of worker names")
        candidates = tuple(dict.fromkeys(candidates))
    request_id = body.get("request_id")
    if request_id is not None and not (isinstance(request_id, str) and
                                       0 < len(request_id) <= 256):
        raise _bad("request_id", "must be a string of 1-256 characters")
    return Query(token_ids=token_ids, text=text, payload=payload, prompt_tokens=prompt_tokens,
                 candidates=candidates, request_id=request_id, ttl=_ttl(body))
