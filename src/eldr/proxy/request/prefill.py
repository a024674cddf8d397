"""The prefill leg of one attempt (:mod:`eldr.proxy.request.flow`): its request, the
instance it goes to, and what its answer tells the decode.

- the request (:func:`prefill_body`): the client's body asking for one token, not
  streamed, with the PD ``kv_transfer_params`` (:data:`PREFILL_KV_PARAMS`, plus the
  artifact's layer mask when the policy reads only those layers, and, with decode-first,
  the held decoder's address when ``decode_kv_params`` says how);
- the instance (:meth:`PrefillLeg.send`): the prefix-affine healthy one
  (:mod:`eldr.proxy.request.affinity`, on :func:`prompt_key`'s blocks), then the others
  while they fail; each move costs the retry budget, and an instance that dies is a strike
  against the request (:mod:`eldr.proxy.request.containment`);
- the answer (:meth:`PrefillLeg.read`): the ``kv_transfer_params`` the decoder gets (the
  eldr payload stripped), the prompt's token count and the policy's inputs read off the
  payload (:mod:`eldr.proxy.request.signatures`).
"""

from __future__ import annotations

import json

import aiohttp

from eldr.capture.decode import REPORT_KEY
from eldr.proxy.bodies import is_utf8, json_object, read_upto
from eldr.proxy.config import ServeConfig
from eldr.proxy.engines import Instance, UpstreamPool, error_kind
from eldr.proxy.errors import ProxyError, UpstreamReply
from eldr.proxy.metrics import RouterMetrics
from eldr.proxy.request.affinity import PrefixAffinity
from eldr.proxy.request.containment import RequestGuards, Strikes
from eldr.proxy.request.decision import RoutingState
from eldr.proxy.request.relay import ERROR_BODY_LIMIT, report_failure
from eldr.proxy.request.signatures import (
    Reading,
    payload_request,
    payload_shape,
    read_inputs,
    split_kv_params,
)

__all__ = ["PREFILL_KV_PARAMS", "PrefillLeg", "mostly_missing", "prefill_body", "prompt_key"]

PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                     "remote_engine_id": None, "remote_block_ids": None,
                     "remote_host": None, "remote_port": None}


def _is_partial(payload: object, prompt_tokens: int | None) -> bool:
    """True if the payload counted fewer tokens than the prompt has.

    The capture plugin counts only tokens the prefill computed: blocks found in a prefix
    cache or loaded by a KV connector are not recomputed, so their experts are missing
    (the signature cache of docs/sigcache.md is the exact answer). Such a signature is still
    used; it is counted so an operator sees how often it happens.
    """
    counted = payload.get("tokens") if isinstance(payload, dict) else None
    return isinstance(counted, int) and prompt_tokens is not None and counted < prompt_tokens


def mostly_missing(payload: object, prompt_tokens: int | None) -> bool:
    """True if the payload counted fewer than half of the prompt's tokens: the counts of
    the prompt's tail, e.g. after a KV connector loaded the rest (docs/serve.md, "One
    request", has a case seen on vLLM-CPU). The prompt's prediction, when the artifact has
    one, routes such a request instead."""
    counted = payload.get("tokens") if isinstance(payload, dict) else None
    return isinstance(counted, int) and prompt_tokens is not None and \
        2 * counted < prompt_tokens


def prompt_key(body: dict, kind: str) -> bytes:
    """The bytes whose prefix blocks drive prefill affinity."""
    prompt = body.get("messages") if kind == "chat" else body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    return json.dumps(prompt, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass")


def prefill_body(body: dict, kind: str, kv_params: dict, *,
                 token_ids: bool = False, raw: bytes | None = None) -> bytes:
    """The prefill leg's request: the client's body asking for one token, not streamed,
    with the PD ``kv_transfer_params`` (the client's body is not changed). ``token_ids``:
    also ask for the prompt's token ids (vLLM's ``return_token_ids``), which a learner
    (``--learn``) keeps as the prompt predictor's hashed features; the prefill's answer
    never reaches the client.

    With the client's JSON ``raw`` (already parsed into ``body``), the fields the prefill
    changes are appended before its closing brace instead of re-serialising the whole
    body, as the decode request splices its ``kv_transfer_params``
    (:func:`eldr.proxy.bodies.decode_body`): a long prompt is never encoded again (a
    2,048-id prompt's re-encoding held the event loop ≈ 145 µs, docs/serve.md). A field
    the client also sent then appears twice and the engine reads the last: JSON leaves
    duplicate names to the parser (RFC 8259, 4), and vLLM's server parses bodies with
    Python's ``json``, which keeps the last, as ``parse_body`` did here. A field the
    prefill drops (``stream_options``, ``min_tokens``) is sent as vLLM's default for it
    (null, 0). A UTF-16 or -32 body is re-serialised (ASCII appended to it would be
    garbage), as is one whose parse is not an object with members.
    """
    if raw is not None and body and is_utf8(raw):
        end = raw.rstrip()
        if end.endswith(b"}"):
            dropped = tuple(key in body for key, _ in _DROPPED)
            return end[:-1] + _spliced(kv_params, kind, token_ids, dropped)
    # the client's keys keep their places, as assigned one by one
    pre = {**body, **_changed(kv_params, kind, token_ids)}
    for key, _ in _DROPPED:
        pre.pop(key, None)
    return json.dumps(pre).encode()


# fields the prefill request goes without, and vLLM 0.32's default for each (what a
# spliced request sends in their place): a one-token, unstreamed generation
_DROPPED = (("stream_options", None), ("min_tokens", 0))

_SPLICED_KEPT = 64  # encoded tails kept (one per routing state, kind and dropped fields)
_spliced_tails: dict[tuple, tuple[dict, bytes]] = {}


def _changed(kv_params: dict, kind: str, token_ids: bool) -> dict:
    """The fields the prefill request sets, in their order."""
    changed: dict = {"kv_transfer_params": kv_params}
    if token_ids:
        changed["return_token_ids"] = True
    changed["max_tokens"] = 1
    if kind == "chat":
        changed["max_completion_tokens"] = 1
    changed["stream"] = False
    return changed


def _spliced(kv_params: dict, kind: str, token_ids: bool, dropped: tuple[bool, ...]) -> bytes:
    """The bytes :func:`prefill_body` puts in place of the client's closing brace: the
    changed fields (and the defaults of the ``dropped`` ones the body has) and the brace.

    The same for every request of a routing state (its ``kv_params`` is one object,
    :meth:`PrefillLeg.kv_params`), so encoded once and kept, keyed by the object's id
    (the entry holds the object, so the id names no other while kept; checked by identity
    all the same): ``json.dumps`` of the changed fields was 3 µs of each request. The dict
    must not be changed after its first use."""
    key = (id(kv_params), kind, token_ids, dropped)
    kept = _spliced_tails.get(key)
    if kept is not None and kept[0] is kv_params:
        return kept[1]
    changed = _changed(kv_params, kind, token_ids)
    for (name, default), present in zip(_DROPPED, dropped, strict=True):
        if present:
            changed[name] = default
    tail = b", " + json.dumps(changed)[1:].encode()
    if len(_spliced_tails) >= _SPLICED_KEPT:
        _spliced_tails.clear()
    _spliced_tails[key] = (kv_params, tail)
    return tail


class PrefillLeg:
    """The prefill of each attempt: its request, its instance (:meth:`send`), its answer
    (:meth:`read`). ``named``: decode-first's ``kv_transfer_params`` naming each decoder
    to the prefill ({decoder name: params}, from ``decode_kv_params``)."""

    def __init__(self, config: ServeConfig, pool: UpstreamPool, affinity: PrefixAffinity,
                 metrics: RouterMetrics, guards: RequestGuards) -> None:
        self.config, self.pool, self.affinity = config, pool, affinity
        self.metrics, self.guards = metrics, guards
        self._kv_params_for: tuple | None = None  # (state, learning, shape, params) last
        self.named: dict[str, dict] = config.decoder_kv_params()
        # the same for every prefill: built once (immutable)
        self._timeout = aiohttp.ClientTimeout(total=config.prefill_timeout,
                                              sock_connect=config.connect_timeout)

    # -- the request -------------------------------------------------------------------------
    def inputs(self, body: dict, kind: str, state: RoutingState, whole: bool,
               learning: bool, raw: bytes | None = None) -> tuple[list, bytes | None]:
        """(prefix-block hashes for the prefill choice, the prefill's request body): none of
        either for a short prompt served whole. ``learning``: a learner (``--learn``) wants
        whole payloads and the prompt's token ids. ``raw``: the client's JSON ``body`` was
        parsed from (:func:`prefill_body` splices into it)."""
        try:
            # Affinity only matters with a choice of prefill instances.
            hashes = (self.affinity.hashes(prompt_key(body, kind))
                      if len(self.pool.prefill) > 1 and not whole else [])
            data = None if whole else prefill_body(body, kind, self.kv_params(state, learning),
                                                   token_ids=learning, raw=raw)
        except RecursionError:  # parsed just under the limit, deeper to re-encode
            raise ProxyError(400, "request body is not valid JSON: nested too deeply",
                             code="invalid_json") from None
        return hashes, data

    def naming(self, body: dict, kind: str, state: RoutingState, decoder: str,
               learning: bool, raw: bytes | None = None) -> bytes | None:
        """Decode-first: the prefill's request naming the held ``decoder`` in its
        ``kv_transfer_params`` when the connector needs it (``decode_kv_params``); None
        when it does not (the attempt's common request serves)."""
        named = self.named.get(decoder)
        if named is None:
            return None
        return prefill_body(body, kind, {**self.kv_params(state, learning), **named},
                            token_ids=learning, raw=raw)

    def kv_params(self, state: RoutingState, learning: bool) -> dict:
        """The prefill leg's ``kv_transfer_params``: PD flags, plus the artifact's layer mask
        when the policy reads only those layers (the engine then sends only their rows) and
        no learner needs every layer (``learning``: ``--learn`` collects whole (L, E) counts:
        a masked payload was never collected). Computed once per routing state, not per
        request."""
        cached = self._kv_params_for
        # a policy built before the model's shape was known (eldr.routing.lazy) knows the
        # layers it prices once bound: the shape is part of the key
        shape = state.shape
        if cached is not None and cached[0] is state and cached[1] == learning and \
                cached[2] == shape:
            return cached[3]
        extra = None if learning else payload_request(state)
        params = {**PREFILL_KV_PARAMS, **extra} if extra else PREFILL_KV_PARAMS
        self._kv_params_for = (state, learning, shape, params)
        return params

    # -- the instance -------------------------------------------------------------------------
    async def send(self, data: bytes, kind: str, hashes, headers,
                   faults: Strikes) -> tuple[Instance, dict]:
        """A prefill on the affine healthy instance, then on the others while they fail
        (each move costs the retry budget; an instance that dies is a strike)."""
        pool, config = self.pool, self.config
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        healthy = pool.prefill_healthy.copy()
        tried, failed = 0, None
        while True:
            try:
                i = self.affinity.pick(hashes, pool.prefill_loads, healthy)
            except LookupError:
                if tried:
                    await self.guards.check_death(*failed, faults)  # poison: raises
                    raise ProxyError(502, f"prefill failed on all {tried} healthy instance(s)",
                                     code="upstream_failed") from None
                raise ProxyError(503, "no healthy prefill instance", code="no_prefill") from None
            if failed is not None:
                await self.guards.check_death(*failed, faults)  # poison: raises
                if not self.guards.may_retry(faults, f"prefill at {failed[0].name}: {failed[1]}"):
                    raise ProxyError(502, f"prefill failed at {failed[0].name} ({failed[1]}); "
                                          f"not retried: the router's retry budget is spent",
                                     code="retry_budget")
            tried += 1
            healthy[i] = False  # not again within this prefill
            inst = pool.prefill[i]
            pool.begin(inst)
            try:
                async with pool.session.post(inst.url + path, data=data, headers=headers,
                                             timeout=self._timeout) as resp:
                    status = resp.status
                    ctype = resp.content_type
                    raw, whole = await read_upto(
                        resp, ERROR_BODY_LIMIT if status >= 400 else config.max_prefill_bytes)
            except Exception as exc:  # every transport failure → next instance
                failed = self._failed(inst, error_kind(exc), exc)
                continue
            finally:
                pool.end(inst)
            if status >= 500:
                failed = self._failed(inst, "http_5xx", f"status {status}")
                continue
            if status >= 400:
                raise UpstreamReply(status, raw, ctype)
            if not whole:
                failed = self._failed(
                    inst, "too_large", f"prefill answer over {config.max_prefill_bytes} bytes")
                continue
            doc = json_object(raw)
            if doc is None:
                failed = self._failed(inst, "protocol",
                                              "prefill answer is not a JSON object")
                continue
            pool.record_success(inst)
            self.affinity.record(hashes, i)
            return inst, doc

    def _failed(self, inst: Instance, kind: str, detail: object) -> tuple[Instance, str]:
        report_failure(self.pool, self.metrics, inst, kind, detail)
        return inst, kind

    # -- the answer ---------------------------------------------------------------------------
    def kv_of(self, doc: dict, split: tuple | None = None) -> tuple[dict, int | None]:
        """(kv_transfer_params for the decoder, the prompt's tokens) of a prefill answer;
        the engines' model shape is recorded from its payload. ``split``: the answer's
        :func:`split_kv_params` when the caller has it."""
        kv_params, payload = split if split is not None else split_kv_params(doc)
        kv_params = {**(kv_params or {}), REPORT_KEY: True}  # decoders: report the decode
        if payload is not None:
            self.pool.engine_shape = payload_shape(payload) or self.pool.engine_shape
        usage = doc.get("usage")
        pt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        pt = pt if isinstance(pt, int) and not isinstance(pt, bool) and pt >= 0 else None
        return kv_params, pt

    def read(self, state: RoutingState, doc: dict) -> tuple[dict, int | None, Reading]:
        """(kv_transfer_params for the decoder, the prompt's tokens, the routing inputs) of
        a prefill answer."""
        metrics = self.metrics
        split = split_kv_params(doc)
        kv_params, pt = self.kv_of(doc, split)
        payload = split[1]
        reading = read_inputs(doc, payload, state, pt)
        if reading.problem != "not_used":
            metrics.signatures.inc(source=reading.source)
            if reading.problem is None and _is_partial(payload, pt):
                metrics.partial.inc()
        return kv_params, pt, reading
