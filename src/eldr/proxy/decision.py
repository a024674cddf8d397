"""What the router decides with: the routing state, and what a prefill response tells it.

:class:`RoutingState` is an immutable snapshot (policy, signature encoder, decode worker
names, τ) built from the routing artifact. An artifact reload builds a new snapshot and
swaps one reference; requests in flight keep the snapshot they started with, so a reload
never disturbs them: each request's dispatch and release events go to the policy of its
own snapshot (a stateful policy such as ``eldr_cost`` keeps per-decoder expert footprints
keyed by request id). Loads live in the pool's ``LoadTracker``, not in the policy.

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
import time
from dataclasses import dataclass, field

import numpy as np

from eldr.proxy.config import ServeConfig
from eldr.routing import (
    POLICIES,
    Decision,
    Policy,
    PolicyBase,
    RouteRequest,
    RoutingResources,
    make_policy,
    prefill_profile,
)

__all__ = ["LazyCostPolicy", "Reading", "RoutingState", "SignatureResult", "build_state",
           "payload_shape", "read_inputs", "read_signature"]

PAYLOAD_KEY = "eldr"  # eldr.capture.payload.PAYLOAD_KEY, repeated to keep this import-light
_GATE_REPRESENTATIONS = ("gate_prob", "gate_logit")  # built from gate sums: counts won't do
_SHAPE_RESOURCES = frozenset({"num_layers", "num_experts"})


class LazyCostPolicy(PolicyBase):
    """``eldr_cost`` served without an artifact, before the model's (L, E) is known.

    The cost policy needs the model's shape at construction and nothing fitted, so the
    router builds it from the first valid prefill payload (:meth:`bind`). Until then every
    request goes to the least-loaded decoder and counts as a fallback; its dispatch and
    release events are dropped (the footprint starts empty when the policy is built, and
    releasing an id the inner policy never saw is a no-op).
    """

    def __init__(self, num_workers: int, **options) -> None:
        self.name = "eldr_cost"
        self.inputs = frozenset({"profile"})
        self._jsq = make_policy("jsq", num_workers=num_workers)
        self.num_workers = self._jsq.num_workers
        self._options = options  # context_weight, capacity: passed on to the cost policy
        self._unbound_fallbacks = 0
        self.inner: Policy | None = None  # the CostPolicy, once bound

    @property
    def num_fallbacks(self) -> int:  # type: ignore[override]
        inner = 0 if self.inner is None else self.inner.num_fallbacks
        return self._unbound_fallbacks + inner

    @property
    def shape(self) -> tuple[int, int] | None:
        """(L, E) of the bound cost policy, or None."""
        return None if self.inner is None else self.inner.shape

    @property
    def footprint(self):
        """The bound policy's :class:`~eldr.routing.ExpertFootprint`, or None."""
        return None if self.inner is None else self.inner.footprint

    def bind(self, num_layers: int, num_experts: int) -> None:
        """Build the cost policy for this (L, E); later calls change nothing."""
        if self.inner is None:
            self.inner = make_policy("eldr_cost", num_workers=self.num_workers,
                                     num_layers=num_layers, num_experts=num_experts,
                                     **self._options)
            logging.getLogger("eldr.serve").info(
                "eldr_cost: model shape L=%d E=%d learned from the first prefill payload",
                num_layers, num_experts)

    def decide(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> Decision:
        if self.inner is None:
            k = self._jsq.choose(request, loads, healthy)
            self._unbound_fallbacks += 1
            return Decision(k, fallback=True)
        return self.inner.decide(request, loads, healthy)

    def on_dispatch(self, request: RouteRequest, worker: int) -> None:
        if self.inner is not None:
            self.inner.on_dispatch(request, worker)

    def on_release(self, request_id: str, outcome) -> None:
        if self.inner is not None:
            self.inner.on_release(request_id, outcome)


@dataclass(frozen=True, slots=True)
class RoutingState:
    """One consistent routing configuration; replaced whole on artifact reload."""

    policy: Policy  # chooses a decode worker index k in [0, K)
    worker_names: tuple[str, ...]  # (K,) name of decode worker k (artifact worker id)
    encoder: object | None  # fitted SignatureEncoder, or None (load-only policies)
    num_layers: int | None  # L of the artifact's model fingerprint, or None
    num_experts: int | None  # E of the artifact's model fingerprint, or None
    tau: float | None  # band width in use (eldr policies), or None
    artifact: str | None  # directory it was loaded from
    loaded_at: float  # time.time() of the load
    top_k: int | None = None  # k of the artifact's model fingerprint, or None
    # the artifact's profile predictor (``predict_profile(counts, tokens)``), or None: the
    # raw prefill profile counts / tokens (eldr_cost without calibration)
    predictor: object | None = None
    # the encoder restricted to its layer mask; derived from ``encoder``, never passed
    masked: object | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.encoder is not None:
            object.__setattr__(self, "masked", _masked_encoder(self.encoder))

    def encode(self, counts: np.ndarray) -> np.ndarray:
        """(d,) signature of (L, E) counts; equal to ``encoder.transform(counts)``.

        Only the mask's layers are transformed (the representations are elementwise and
        the norm is taken over the mask), a third of the work for a 16-of-48-layer mask.
        """
        if self.masked is None:
            return self.encoder.transform(counts)
        return self.masked.transform(counts[self.encoder.layers_])

    @property
    def needs_signature(self) -> bool:
        return "signature" in self.policy.inputs

    @property
    def needs_profile(self) -> bool:
        return "profile" in self.policy.inputs

    def fingerprint(self) -> str:
        """The artifact's model fingerprint, as ``RoutingArtifact.fingerprint`` writes it."""
        return f"L={self.num_layers} E={self.num_experts} k={self.top_k}"

    @property
    def shape(self) -> tuple[int, int] | None:
        """(L, E) prefill counts must have: the artifact's, else a bound policy's, or None."""
        if self.num_layers is not None and self.num_experts is not None:
            return self.num_layers, self.num_experts
        return getattr(self.policy, "shape", None)


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


def _masked_encoder(encoder):
    """The same encoder over only its masked layers (None if it cannot be rebuilt)."""
    try:
        state = encoder.state()
        layers = np.asarray(state["layers"])
        state.update(num_layers=int(layers.size), layers=np.arange(layers.size),
                     idf=np.asarray(state["idf"])[layers])
        return type(encoder).from_state(state)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _load_artifact(path: str):
    from eldr.fit import artifact as artifact_mod

    return artifact_mod.load(path)


def build_state(config: ServeConfig) -> RoutingState:
    """Load the artifact (if any) and build the policy for the configured decoders.

    Decode URLs map to artifact workers by the ids given with them (``ID=URL``) or, without
    ids, in order; the sets must match exactly. Policies that need fitted resources
    (centroids) need the artifact; ``eldr_cost`` needs only the model's (L, E), which it
    takes from the artifact or, without one, from the first prefill payload
    (:class:`LazyCostPolicy`). Raises ``ValueError`` naming a mismatch.
    """
    K = len(config.decode_urls)
    encoder = art = order = None
    tau = L = E = k = None
    spec = POLICIES[config.policy]
    if config.artifact is not None:
        art = _load_artifact(config.artifact)
        encoder = art.encoder
        art_ids = tuple(str(w) for w in art.worker_ids)
        tau, L, E, k = float(art.tau), int(art.num_layers), int(art.num_experts), \
            int(art.top_k)
        if config.decode_ids is None:
            if len(art_ids) != K:
                raise ValueError(f"artifact {config.artifact} has {len(art_ids)} decode "
                                 f"workers {list(art_ids)}, but {K} --decode URLs were given")
            names = art_ids
        else:
            if set(config.decode_ids) != set(art_ids):
                raise ValueError(f"decode worker ids {sorted(config.decode_ids)} do not match "
                                 f"the artifact's {sorted(art_ids)}")
            order = [art_ids.index(w) for w in config.decode_ids]
            names = config.decode_ids
        if config.tau is not None:
            tau = config.tau
    elif spec.needs - _SHAPE_RESOURCES:
        raise ValueError(f"policy {config.policy!r} needs a routing artifact (--artifact DIR)")
    else:
        names = config.decode_ids or tuple(f"decode-{i}" for i in range(K))
    policy: Policy
    if L is None and spec.needs & _SHAPE_RESOURCES:
        policy = LazyCostPolicy(K, load_slack=config.load_slack)
    elif art is not None:  # the artifact's one bundle, decoders in the configured order
        resources = RoutingResources.from_artifact(
            art, order, random_state=config.random_state,
            load_slack=config.load_slack).as_kwargs()
        resources["tau"] = tau
        policy = make_policy(config.policy, num_workers=K, **resources)
    else:
        policy = make_policy(config.policy, num_workers=K, tau=0.1,
                             random_state=config.random_state, load_slack=config.load_slack)
    return RoutingState(policy=policy, worker_names=tuple(names), encoder=encoder,
                        num_layers=L, num_experts=E, top_k=k,
                        predictor=art if art is not None and
                        getattr(art, "profile_alpha", None) is not None else None,
                        tau=tau if "signature" in policy.inputs else None,
                        artifact=config.artifact, loaded_at=time.time())


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
    if not (isinstance(dims, list) and len(dims) in (2, 3)
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                    for x in dims[-2:])):
        return None
    return dims[-2], dims[-1]


def _read_counts(doc: dict, payload: object, shape: tuple[int, int] | None) -> _Counts:
    """The prompt's (L, E) counts from a prefill response; ``shape`` None accepts the
    payload's own (L, E) (vLLM's ``routed_experts`` ids do not say E: refused then)."""
    from eldr.capture import payload as wire

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
        try:
            if len(payload["shape"]) == 3:
                counts = wire.decode_block_counts(payload, num_layers=L, num_experts=E).sum(0)
            else:
                counts = wire.decode_counts(payload, num_layers=L, num_experts=E)
        except ValueError:
            return _Counts(None, None, None, source, "malformed")
        tokens = payload.get("tokens")
        ok = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
        return _Counts(counts, tokens if ok else None, None, source, None)
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
    return _signature(_read_counts(doc, payload, (state.num_layers, state.num_experts)),
                      state)


def read_inputs(doc: dict, payload: object, state: RoutingState,
                prompt_tokens: int | None) -> Reading:
    """The routing inputs ``state.policy`` declares, from one prefill response.

    The profile (``eldr_cost``) is ``prefill_profile(counts, tokens, k)`` over the tokens
    the counts cover (the payload's ``tokens``, else the counts' row sum / k, else the
    prompt): a prefill that found part of the prompt in its prefix cache counted only the
    rest, and dividing by the whole prompt would shrink every probability. The context is
    the whole prompt (``usage.prompt_tokens``), whose KV the decoder reads every step. A
    :class:`LazyCostPolicy` is bound to the first valid payload's (L, E) here.
    """
    want_sig, want_profile = state.needs_signature, state.needs_profile
    if not (want_sig or want_profile):
        return Reading(None, None, prompt_tokens or 0, "none", "not_used")
    if want_sig and state.encoder is None:
        return Reading(None, None, prompt_tokens or 0, "none", "no_encoder")
    counts = _read_counts(doc, payload, state.shape)
    signature = profile = None
    problem = counts.problem
    if want_sig:
        sig = _signature(counts, state)
        signature, problem = sig.vector, sig.problem
    tokens = _counted_tokens(counts, state.top_k, prompt_tokens)
    context = prompt_tokens if prompt_tokens is not None else (tokens or 0)
    if want_profile and counts.counts is not None:
        bind = getattr(state.policy, "bind", None)
        if bind is not None:
            bind(*counts.counts.shape)
        if state.predictor is not None and counts.counts.shape == state.shape:
            profile = state.predictor.predict_profile(counts.counts, tokens or 0)
        else:
            profile = prefill_profile(counts.counts, tokens or 0,
                                      counts.top_k or state.top_k)
    return Reading(signature, profile, int(context), counts.source, problem)


def _counted_tokens(counts: _Counts, top_k: int | None, prompt_tokens: int | None
                    ) -> int | None:
    if counts.tokens is not None:
        return counts.tokens
    k = counts.top_k or top_k
    if counts.counts is not None and k:
        return round(float(counts.counts.sum(axis=1).max()) / k)
    return prompt_tokens


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
