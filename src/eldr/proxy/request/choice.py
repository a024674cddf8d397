"""Which decoder an attempt goes to (:mod:`eldr.proxy.request.flow`): the policy's choice
among the healthy decoders the request has not failed on, on the inputs it declares.

The inputs come from the prefill's answer (:meth:`PrefillLeg.read
<eldr.proxy.request.prefill.PrefillLeg.read>`); when it has none the policy can use (no
payload, a damaged one, counts of less than half the prompt) or no prefill ran (a short
prompt served whole, decode-first), from the prompt's prediction
(:mod:`eldr.proxy.request.offload`, bounded: a full queue or a late job routes by load);
else the policy routes by load. Decode-first holds the chosen decoder (:meth:`hold`:
dispatched, counted in its load and breaker) while the prefill runs, and gives it back
(:meth:`unhold`) when the decode will not be sent. The metrics count each decision, what
it was made from and why it fell back.
"""

from __future__ import annotations

import dataclasses
import time

from eldr.proxy.engines import Instance, UpstreamPool
from eldr.proxy.errors import ProxyError
from eldr.proxy.metrics import RouterMetrics
from eldr.proxy.request.containment import Strikes
from eldr.proxy.request.decision import LiveRouting, RoutingState
from eldr.proxy.request.offload import PromptOffload
from eldr.proxy.request.prefill import PrefillLeg, mostly_missing
from eldr.proxy.request.prompts import RequestPrompt
from eldr.proxy.request.relay import DecodeTarget
from eldr.proxy.request.signatures import Reading, split_kv_params
from eldr.routing import NoHealthyWorkerError, RouteRequest

__all__ = ["DecoderChoice"]


class DecoderChoice:
    """The decoder of each attempt (:meth:`route`; decode-first: :meth:`hold`), on the
    live routing snapshot ``live``, the engines' health and loads (``pool``), the prompt's
    prediction (``prompts``) and the prefill's answer (``prefill``)."""

    def __init__(self, live: LiveRouting, pool: UpstreamPool, metrics: RouterMetrics,
                 prompts: PromptOffload, prefill: PrefillLeg) -> None:
        self.live, self.pool, self.metrics = live, pool, metrics
        self.prompts, self.prefill = prompts, prefill

    def current(self, state: RoutingState) -> RoutingState:
        """The request's snapshot, or the live one when the decoder set changed since
        (eldr.proxy.control.elastic): indices of the old set would name other decoders."""
        live = self.live.state
        return live if state.worker_names != live.worker_names else state

    async def route(self, state: RoutingState, attempt_id: str, doc: dict | None,
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
            reading, _ = await self.predict(state, prompt)
            if reading is None:
                reading = Reading(None, None, 0, "none", "short_prompt")
        else:
            kv_params, pt, reading = self.prefill.read(state, doc)
            if (reading.problem is not None and reading.problem != "not_used") or (
                    reading.problem is None and state.prompt is not None
                    and mostly_missing(split_kv_params(doc)[1], pt)):
                predicted, _ = await self.predict(state, prompt)
                if predicted is not None:  # the prompt stands in for the missing signature
                    reading = Reading(predicted.signature, predicted.profile,
                                      pt if pt is not None else predicted.context_tokens,
                                      "prompt", None)
        if state is not self.live.state:  # the decoder set changed while it predicted
            state = self.current(state)
        try:
            return self.decide(state, attempt_id, reading, kv_params, pt, excluded, faults,
                                t0)
        except ProxyError:
            if not whole:
                self.metrics.abandoned.inc(reason="no_decoder")
            raise

    async def predict(self, state: RoutingState,
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

    def decide(self, state: RoutingState, request_id: str, reading: Reading,
                kv_params: dict | None, pt: int | None, excluded: list[Instance],
                faults: Strikes | None, t0: float) -> DecodeTarget:
        """The policy's choice among the healthy decoders not yet tried by this request,
        on ``reading``'s inputs; metrics count the decision and what it was made from."""
        metrics = self.metrics
        tracker = self.pool.tracker
        healthy = None  # every decoder (the common case: no mask built)
        if excluded or self.pool.decode_refusing():
            healthy = self.pool.decode_available()
            if excluded:
                mask = healthy.copy()
                mask[[i.index for i in excluded if not i.removed]] = False
                if mask.any():  # else: retry on a decoder that failed rather than on none
                    healthy = mask
            if healthy.all():
                healthy = None
        route = RouteRequest(request_id, signature=reading.signature, profile=reading.profile,
                             context_tokens=reading.context_tokens)
        try:
            decided = state.policy.decide(route, tracker.loads, healthy)
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
    async def hold(self, state: RoutingState, attempt_id: str, prompt: RequestPrompt,
                    excluded: list[Instance], faults: Strikes) -> tuple[DecodeTarget, Instance]:
        """Decode-first: the attempt's decoder, chosen on the prompt's prediction (by load
        without one) before any prefill, and held: dispatched to the policy, its breaker
        and its load, exactly as a decode in flight, until the decode takes it over or
        :meth:`unhold` gives it back. The decoder is returned as itself: a removal of
        another decoder during the prefill moves indices, never the held one (its request
        in flight keeps it in the pool)."""
        t0 = time.perf_counter()
        reading, _ = await self.predict(state, prompt)
        if reading is None:
            reading = Reading(None, None, 0, "none", "decode_first")
        state = self.current(state)  # the decoder set may have changed while it predicted
        decision = self.decide(state, attempt_id, reading, None, None, excluded, faults, t0)
        decoder = self.pool.decode[decision.worker]
        state.policy.on_dispatch(decision.request, decision.worker)
        decoder.breaker.on_dispatch()
        self.pool.begin(decoder)
        return decision, decoder

    def unhold(self, state: RoutingState, decision: DecodeTarget, decoder: Instance) -> None:
        """Give back a held decoder whose decode will not be sent (its prefill failed, the
        client left): released ``cancelled``, the decoder not blamed."""
        self.pool.end(decoder)
        state.policy.on_release(decision.request.request_id, "cancelled")
        decoder.breaker.on_abandon()

    def held(self, held: DecodeTarget, holder: Instance, doc: dict) -> DecodeTarget:
        """Decode-first: the held decision completed by its prefill's answer (``doc``):
        the decoder's current index (it may have moved: a removal during the prefill), the
        ``kv_transfer_params`` for it and the prompt's tokens."""
        kv_params, pt = self.prefill.kv_of(doc)
        return dataclasses.replace(held, worker=holder.index, kv_params=kv_params,
                                   prompt_tokens=pt)
