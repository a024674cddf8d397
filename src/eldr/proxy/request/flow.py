"""The prefill → route → decode flow of one OpenAI request, with retries and SSE relay.

Per attempt (vLLM's PD proxy protocol; docs/method.md#request-path-with-vllm):

1. prefill: the request with ``max_tokens`` 1 (and ``max_completion_tokens`` 1 for chat),
   ``stream`` false and ``kv_transfer_params = {"do_remote_decode": true, ...}`` goes to a
   prefill instance chosen by prefix affinity with load spill, with the attempt's own
   ``X-Request-Id`` (never the client's, which may be shared: engines key requests by it)
   (:mod:`eldr.proxy.request.prefill`);
2. route: the inputs the policy declares (``policy.inputs``: a signature, an expert
   profile) are read off the prefill response (else predicted from the prompt's token ids
   when the artifact has a prompt predictor: :mod:`eldr.proxy.request.prompts`) and the
   policy picks a healthy decoder on the live loads (:mod:`eldr.proxy.request.choice`);
   ``policy.on_dispatch`` tells it the request went there;
3. decode: the ORIGINAL request plus the prefill's ``kv_transfer_params`` (relayed
   verbatim, minus the eldr payload) goes to that decoder; its answer is streamed back
   (:mod:`eldr.proxy.request.relay`).

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
import itertools
import json
import logging
import uuid
from typing import Protocol

import aiohttp

from eldr.proxy.bodies import ByteBudget, prompt_token_bound, read_upto
from eldr.proxy.config import ServeConfig
from eldr.proxy.engines import Instance, UpstreamPool
from eldr.proxy.errors import ProxyError, UpstreamReply
from eldr.proxy.metrics import RouterMetrics
from eldr.proxy.request.affinity import PrefixAffinity
from eldr.proxy.request.choice import DecoderChoice
from eldr.proxy.request.containment import RequestGuards, Strikes, body_digest
from eldr.proxy.request.decision import LiveRouting, RoutingState
from eldr.proxy.request.decodepayload import decode_report
from eldr.proxy.request.offload import PromptOffload
from eldr.proxy.request.prefill import PREFILL_KV_PARAMS, PrefillLeg, prefill_body, prompt_key
from eldr.proxy.request.prompts import RequestPrompt
from eldr.proxy.request.relay import (
    ERROR_BODY_LIMIT,
    DecodeAttempt,
    DecodeRelay,
    DecodeTarget,
    RetryDecode,
    is_stream_done,
)
from eldr.routing import Outcome

__all__ = ["PREFILL_KV_PARAMS", "LearnerHook", "RequestFlow", "prefill_body", "prompt_key"]

log = logging.getLogger("eldr.serve")

DEFAULT_SHORT_PROMPT_TOKENS = 16  # vLLM's default KV block on GPUs, when engines say none

class LearnerHook(Protocol):
    """What the flow tells a learner (``eldr serve --learn``): each completed request."""

    def on_request_done(self, doc: dict, decoder: str, resp=None, decode=None) -> None: ...


class RequestFlow:
    """Runs the PD flow of each request (:meth:`run`).

    ``live``: the routing snapshot requests start with; ``pool``: the engines (health,
    load, the HTTP session); ``affinity``: the prefill choice; ``guards``: the poison list
    and retry budget. Each attempt's prefill is its :class:`PrefillLeg`'s, its decoder
    :class:`DecoderChoice`'s and its decode its :class:`DecodeRelay`'s; this class runs
    the attempts, their retries and the dispatch/release contract. A learner
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
        self.prefill = PrefillLeg(config, pool, affinity, metrics, guards)
        self.relay = DecodeRelay(config, pool, metrics, guards, self.budget, self._background)
        self.prompts = PromptOffload(config, metrics)  # tokenization and prediction, off the loop
        if live.state.prompt is not None:  # its kernel and tokenizer ready before a request
            self.prompts.prepare(live.state.prompt.tokenizer, live.state.prompt.predict)
        self.choice = DecoderChoice(live, pool, metrics, self.prompts, self.prefill)
        self._id_prefix = f"eldr-{uuid.uuid4().hex[:12]}-"  # unique per router process
        self._id_count = itertools.count()
        # the same for every KV release: built once (immutable)
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
        hashes, prefill_data = self.prefill.inputs(body, kind, state, whole,
                                                   self.learner is not None, raw)
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
                    state = self.choice.current(state)
                    held, holder = await self.choice.hold(state, attempt_id, prompt, excluded,
                                                          faults)
                    prefill, doc = await self._prefill_for(
                        state, held, holder, body, kind, prefill_data, hashes, headers, faults,
                        raw)
                elif not whole:
                    prefill, doc = await self.prefill.send(prefill_data, kind, hashes,
                                                           headers, faults)
            else:  # the last decoder was never reached: its KV is still there to read
                (prefill, doc, attempt_id), unread = unread, None
                headers["X-Request-Id"] = attempt_id
            if held is None:
                state = self.choice.current(state)
                decision = await self.choice.route(state, attempt_id, doc, excluded, faults,
                                                   whole, prompt)
            else:  # the held decoder, with what its prefill answered
                decision = self.choice.held(held, holder, doc)
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
        named = held and decoder.name in self.prefill.named
        if exc.kind == "connect" and not whole and not named:
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

    def _upstream_headers(self, request) -> dict:
        """Headers to the engines: JSON, the client's ``Authorization`` unless the engines
        have a key of their own (it replaces the client's)."""
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        headers.update(self.pool.auth_headers())
        return headers

    async def _prefill_for(self, state: RoutingState, held: DecodeTarget, decoder: Instance,
                           body: dict, kind: str, data: bytes | None, hashes, headers,
                           faults: Strikes, raw: bytes | None = None) -> tuple[Instance, dict]:
        """Decode-first: the prefill of an attempt whose decoder is held, naming that
        decoder in its ``kv_transfer_params`` when the connector needs it
        (``decode_kv_params``); the decoder is given back if the prefill fails."""
        try:
            named = self.prefill.naming(body, kind, state, decoder.name,
                                        self.learner is not None, raw)
            return await self.prefill.send(named if named is not None else data, kind,
                                           hashes, headers, faults)
        except BaseException:  # failed, poison, or the client left: nothing to decode
            self.choice.unhold(state, held, decoder)
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
        if self.pool.decode_refusing() == len(self.pool.decode):  # none (or none at all)
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
        router stops; the tokenizer processes are waited for, off the loop and bounded
        (:meth:`~eldr.proxy.request.offload.PromptOffload.aclose`: a pool left running
        can print an EBADF traceback at exit on CPython 3.11)."""
        await self.prompts.aclose()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
