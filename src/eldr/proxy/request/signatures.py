"""Reading a prefill response: the eldr payload, vLLM's ``routed_experts``, and what a
policy's declared inputs (signature, profile) are computed from them.

What a policy reads is declared by ``policy.inputs`` (``"signature"``, ``"profile"``);
:func:`read_inputs` computes exactly those from the prompt's expert counts, found in a
prefill response in order:

1. the capture plugin's compact payload, ``kv_transfer_params["eldr"]``
   (:mod:`eldr.capture.payload`: (L, E) counts, or (B, L, E) per-block rows, summed);
2. vLLM's own ``choices[0].routed_experts`` (base64 ``.npy`` of (tokens, L, k) ids,
   from engines started with ``--enable-return-routed-experts``);
3. nothing: the request is routed by load (the policy's fallback).

A malformed or mismatched payload is treated like a missing one (reason recorded), never
as an error of the request: routing quality may degrade, serving must not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from eldr.capture import payload as wire
from eldr.capture.payload import PAYLOAD_KEY
from eldr.routing import prefill_profile

if TYPE_CHECKING:
    from eldr.proxy.request.decision import RoutingState

__all__ = ["LAYERS_KEY", "PAYLOAD_KEY", "Reading", "SignatureResult", "payload_request",
           "payload_shape", "read_counts", "read_inputs", "read_signature", "split_kv_params"]

LAYERS_KEY = "eldr_layers"  # eldr.capture.payload.LAYERS_KEY: the mask asked of the engine
_GATE_REPRESENTATIONS = ("gate_prob", "gate_logit")  # built from gate sums: counts won't do


@dataclass(frozen=True, slots=True)
class SignatureResult:
    """The signature read from one prefill response."""

    vector: np.ndarray | None  # (d,) float32 unit row, or None (route by load)
    source: str  # "payload", "routed_experts" or "none"
    problem: str | None  # why there is no vector: "missing", "malformed", "mismatch", ...


@dataclass(frozen=True, slots=True)
class Reading:
    """What one prefill response gives the policy (the fields its ``inputs`` name)."""

    signature: np.ndarray | None  # (d,) float32 unit row, or None
    profile: np.ndarray | None  # (L, E) float32 per-token expert inclusion, or None
    context_tokens: int  # prompt tokens the decoder reads KV of (0 when unknown)
    source: str  # where the counts came from: "payload", "routed_experts", "none"
    problem: str | None  # why a needed input is missing ("missing", "mismatch", ...)


@dataclass(frozen=True, slots=True)
class _Counts:
    counts: np.ndarray | None  # (L, E) int32 prompt expert counts, or None
    tokens: int | None  # tokens the counts cover (payload "tokens", routed_experts rows)
    top_k: int | None  # k, when the counts say it (routed_experts)
    source: str
    problem: str | None
    layers: np.ndarray | None = None  # rows a layer-masked payload holds; None: all
    rows_counts: np.ndarray | None = None  # (|layers|, E) those rows as sent; None: all
    count_bound: int | None = None  # every count is at most this (checked), or None


def split_kv_params(doc: dict) -> tuple[dict | None, object]:
    """(kv_transfer_params to relay to the decoder, the eldr payload or None).

    The payload is removed from what is relayed: the decoder has no use for it. Nothing is
    relayed when the payload was all there was (a connector that returns no parameters,
    e.g. vLLM's ExampleConnector, with the capture plugin adding the payload).
    """
    kvp = doc.get("kv_transfer_params")
    if not isinstance(kvp, dict):
        return None, None
    if PAYLOAD_KEY not in kvp:
        return kvp, None
    relay = {k: v for k, v in kvp.items() if k != PAYLOAD_KEY}
    return relay or None, kvp[PAYLOAD_KEY]


def payload_shape(payload: object) -> tuple[int, int] | None:
    """The (L, E) an eldr payload declares (its shape's last two), or None if malformed.

    Cheap (no decoding): the router records it from every prefill answer as the engines'
    model fingerprint, which an artifact reload must match.
    """
    dims = payload.get("shape") if isinstance(payload, dict) else None
    if not (isinstance(dims, list) and len(dims) in (2, 3)):
        return None
    layers, experts = dims[-2], dims[-1]
    if isinstance(layers, bool) or isinstance(experts, bool) or not (
            isinstance(layers, int) and isinstance(experts, int) and layers > 0 and experts > 0):
        return None
    return layers, experts


def read_counts(doc: dict, payload: object, shape: tuple[int, int] | None) -> _Counts:
    """The prompt's (L, E) counts from a prefill response; ``shape`` None accepts the
    payload's own (L, E) (vLLM's ``routed_experts`` ids do not say E: refused then)."""
    if payload is not None:
        source = "payload"
        theirs = payload_shape(payload)
        if theirs is None:
            return _Counts(None, None, None, source, "malformed")
        if shape is not None and theirs != tuple(shape):
            _warn_once(f"prefill payloads have (layers, experts) = {list(theirs)}, the router "
                       f"expects {list(shape)}: is the artifact fitted for another model? "
                       f"Routing by load.")
            return _Counts(None, None, None, source, "mismatch")
        L, E = theirs
        try:  # versions 1 and 2, fully validated; anything wrong is a ValueError
            got = wire.decode_payload(payload, num_layers=L, num_experts=E)
        except ValueError:
            return _Counts(None, None, None, source, "malformed")
        return _Counts(got.counts, got.tokens, None, source, None, got.layers,
                       got.rows_counts, got.count_bound)
    routed = _routed_experts(doc)
    if routed is None:
        return _Counts(None, None, None, "none", "missing")
    source = "routed_experts"
    if shape is None:
        return _Counts(None, None, None, source, "unknown_shape")
    try:
        ids = wire.decode_routed_experts(routed)
        if ids.shape[1] != shape[0]:
            _warn_once(f"routed_experts have {ids.shape[1]} layers, the router expects "
                       f"{shape[0]}: is the artifact fitted for another model? Routing by "
                       f"load.")
            return _Counts(None, None, None, source, "mismatch")
        counts = wire.topk_to_counts(ids, shape[1])
    except ValueError:
        return _Counts(None, None, None, source, "malformed")
    return _Counts(counts, int(ids.shape[0]), int(ids.shape[2]), source, None)


def _signature(counts: _Counts, state: RoutingState) -> SignatureResult:
    if counts.counts is None:
        return SignatureResult(None, counts.source, counts.problem)
    if counts.layers is not None and not _covers(counts.layers, state.encoder):
        return SignatureResult(None, counts.source, "mismatch")  # another mask than ours
    if getattr(state.encoder, "representation", "") in _GATE_REPRESENTATIONS:
        return SignatureResult(None, counts.source, "unencodable")  # needs gate sums
    try:
        vector = state.encode(counts.counts)
    except ValueError:
        return SignatureResult(None, counts.source, "unencodable")
    if not np.isfinite(vector).all():
        return SignatureResult(None, counts.source, "malformed")
    return SignatureResult(vector, counts.source, None)


def read_signature(doc: dict, payload: object, state: RoutingState) -> SignatureResult:
    """The prompt's signature from a prefill response ``doc`` (and its eldr ``payload``)."""
    if state.encoder is None:
        return SignatureResult(None, "none", "no_encoder")
    return _signature(read_counts(doc, payload, (state.num_layers, state.num_experts)),
                      state)


def read_inputs(doc: dict, payload: object, state: RoutingState,
                prompt_tokens: int | None) -> Reading:
    """The routing inputs ``state.policy`` declares, from one prefill response.

    The profile (``eldr_cost``) is ``prefill_profile(counts, tokens, k)`` over the tokens
    the counts cover (the payload's ``tokens``, else the counts' row sum / k, else the
    prompt): a prefill that found part of the prompt in its prefix cache counted only the
    rest, and dividing by the whole prompt would shrink every probability. The context is
    the whole prompt (``usage.prompt_tokens``), whose KV the decoder reads every step. A
    policy built before the model's shape was known (``eldr.routing.lazy``) is bound to
    the first valid payload's (L, E) here.
    """
    want_sig, want_profile = state.needs_signature, state.needs_profile
    if not (want_sig or want_profile):
        return Reading(None, None, prompt_tokens or 0, "none", "not_used")
    if want_sig and state.encoder is None:
        return Reading(None, None, prompt_tokens or 0, "none", "no_encoder")
    counts = read_counts(doc, payload, state.shape)
    signature = profile = None
    problem = counts.problem
    if want_sig:
        sig = _signature(counts, state)
        signature, problem = sig.vector, sig.problem
    # counted tokens: only the profile, or a response without usage, needs them
    tokens = (_counted_tokens(counts, state.top_k, prompt_tokens)
              if want_profile or prompt_tokens is None else None)
    context = prompt_tokens if prompt_tokens is not None else (tokens or 0)
    priced = getattr(state.policy, "priced_layers", None) if want_profile else None
    covers, same = (False, False) if priced is None or counts.layers is None else \
        _row_match(priced, counts.layers)
    if want_profile and counts.layers is not None and not covers:
        problem = problem or "mismatch"  # a profile needs every layer the policy prices
    elif want_profile and counts.counts is not None:
        bind = getattr(state.policy, "bind", None)
        if bind is not None:
            bind(*counts.counts.shape)
            priced = getattr(state.policy, "priced_layers", None)
        if state.predictor is not None and counts.counts.shape == state.shape:
            profile = state.predictor.predict_profile(counts.counts, tokens or 0)
        else:  # only the rows the policy prices, when it prices a subset (it takes both)
            c = counts.counts if priced is None else \
                counts.rows_counts if same else counts.counts[priced]
            profile = prefill_profile(c, tokens or 0, counts.top_k or state.top_k,
                                      max_count=counts.count_bound)
    return Reading(signature, profile, int(context), counts.source, problem)


def _counted_tokens(counts: _Counts, top_k: int | None, prompt_tokens: int | None
                    ) -> int | None:
    if counts.tokens is not None:
        return counts.tokens
    k = counts.top_k or top_k
    if counts.counts is not None and k:
        return round(float(counts.counts.sum(axis=1).max()) / k)
    return prompt_tokens


# (rows wanted, payload layers) -> (the payload holds every wanted row, exactly those)
_COVERS: dict[tuple[bytes, bytes], tuple[bool, bool]] = {}


def _covers(layers: np.ndarray, encoder) -> bool:
    """Whether a masked payload's rows include every layer the encoder reads."""
    wanted = getattr(encoder, "layers_", None)
    return wanted is not None and _row_match(wanted, layers)[0]


def _row_match(wanted: np.ndarray, layers: np.ndarray) -> tuple[bool, bool]:
    """(whether a masked payload's rows ``layers`` include every row of ``wanted``,
    whether they are exactly ``wanted``).

    Every payload of one deployment carries the same layer list, so the answer is
    memoised on the two lists' bytes (a lookup instead of an ``np.isin`` per request;
    docs/serve.md, "Overhead", has what the check cost before)."""
    key = (np.asarray(wanted, dtype=np.int64).tobytes(),
           np.asarray(layers, dtype=np.int64).tobytes())
    hit = _COVERS.get(key)
    if hit is None:
        if len(_COVERS) >= 256:  # bounded: untrusted payloads may carry any list
            _COVERS.clear()
        hit = _COVERS[key] = (bool(np.isin(wanted, layers).all()), key[0] == key[1])
    return hit


def payload_request(state: RoutingState) -> dict | None:
    """What to add to the prefill request's ``kv_transfer_params`` so the engine sends
    only the layers the policy reads (``{"eldr_layers": [...]}``), or None (all layers).

    A policy that reads a signature and no profile (``eldr``) reads the artifact's layer
    mask; one that reads a profile and no signature, the layers it prices
    (``eldr_cost --cost-layer-stride``: ``priced_layers``; a policy that prices every
    layer needs them all). The plugin sends all layers when the mask is invalid for its
    model; a payload whose rows do not cover what the policy reads is refused as a
    ``mismatch`` fallback.
    """
    if state.needs_profile:
        layers = None if state.needs_signature else \
            getattr(state.policy, "priced_layers", None)
    else:
        layers = getattr(state.encoder, "layers_", None) if state.needs_signature else None
    if layers is None:
        return None
    return {LAYERS_KEY: [int(x) for x in layers]}


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log a configuration problem once per process, not once per request."""
    if message not in _warned:
        _warned.add(message)
        logging.getLogger("eldr.serve").warning(message)


def _routed_experts(doc: dict) -> object:
    choices = doc.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("routed_experts")
    return None
