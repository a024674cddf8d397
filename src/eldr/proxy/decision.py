"""What the router decides with: the routing state, and the signature of a prefilled request.

:class:`RoutingState` is an immutable snapshot (policy, signature encoder, decode worker
names, τ) built from the routing artifact. An artifact reload builds a new snapshot and
swaps one reference; requests in flight keep the snapshot they started with, so a reload
never disturbs them. Policies keep no load state (loads live in the pool's
``LoadTracker``), which is what makes the swap safe.

:func:`read_signature` finds the prompt's expert counts in a prefill response, in order:

1. the capture plugin's compact payload, ``kv_transfer_params["eldr"]``
   (:mod:`eldr.capture.payload`: (L, E) counts, or (B, L, E) per-block rows, summed);
2. vLLM's own ``choices[0].routed_experts`` (base64 ``.npy`` of (tokens, L, k) ids,
   from engines started with ``--enable-return-routed-experts``);
3. nothing: the request is routed without a signature (the policy's JSQ fallback).

A malformed or mismatched signature is treated like a missing one (reason recorded), never
as an error of the request: routing quality may degrade, serving must not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from eldr.proxy.config import ServeConfig
from eldr.routing import EldrPolicy, Policy, make_policy

__all__ = ["RoutingState", "SignatureResult", "build_state", "read_signature"]

PAYLOAD_KEY = "eldr"  # eldr.capture.payload.PAYLOAD_KEY, repeated to keep this import-light
_GATE_REPRESENTATIONS = ("gate_prob", "gate_logit")  # built from gate sums: counts won't do


@dataclass(frozen=True, slots=True)
class RoutingState:
    """One consistent routing configuration; replaced whole on artifact reload."""

    policy: Policy  # chooses a decode worker index k in [0, K)
    worker_names: tuple[str, ...]  # (K,) name of decode worker k (artifact worker id)
    encoder: object | None  # fitted SignatureEncoder, or None (load-only policies)
    num_layers: int | None  # L the encoder expects (artifact fingerprint), or None
    num_experts: int | None  # E the encoder expects, or None
    tau: float | None  # band width in use (eldr policies), or None
    artifact: str | None  # directory it was loaded from
    loaded_at: float  # time.time() of the load
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
        return isinstance(self.policy, EldrPolicy)

    def band_size(self, signature: np.ndarray, healthy: np.ndarray | None) -> int | None:
        """|B| for an eldr policy and this signature (None for other policies)."""
        policy = self.policy
        if not isinstance(policy, EldrPolicy):
            return None
        sim = policy.similarities(signature)
        if healthy is not None:
            sim = np.where(healthy, sim, -np.inf)
        return int(np.count_nonzero(sim >= sim.max() - policy.tau))


@dataclass(frozen=True, slots=True)
class SignatureResult:
    """The signature read from one prefill response."""

    vector: np.ndarray | None  # (d,) float32 unit row, or None (route by load)
    source: str  # "payload", "routed_experts" or "none"
    problem: str | None  # why there is no vector: "missing", "malformed", "mismatch", ...


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


def _artifact_parts(path: str):
    """(encoder, centroids (K, d), worker ids, tau, L, E) from a routing artifact."""
    from eldr.fit import artifact as artifact_mod

    art = artifact_mod.load(path)
    encoder = art.encoder
    centroids = np.asarray(art.centroids, dtype=np.float32)
    worker_ids = tuple(str(w) for w in art.worker_ids)
    return (encoder, centroids, worker_ids, float(art.tau), int(encoder.num_layers_),
            int(encoder.num_experts_))


def build_state(config: ServeConfig) -> RoutingState:
    """Load the artifact (if any) and build the policy for the configured decoders.

    Decode URLs map to artifact workers by the ids given with them (``ID=URL``) or, without
    ids, in order; the sets must match exactly. Raises ``ValueError`` naming a mismatch.
    """
    K = len(config.decode_urls)
    encoder = centroids = None
    tau = L = E = None
    if config.artifact is not None:
        encoder, centroids, art_ids, tau, L, E = _artifact_parts(config.artifact)
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
            centroids = centroids[order]
            names = config.decode_ids
        if config.tau is not None:
            tau = config.tau
    elif config.policy.startswith("eldr"):
        raise ValueError(f"policy {config.policy!r} needs a routing artifact (--artifact DIR)")
    else:
        names = config.decode_ids or tuple(f"decode-{k}" for k in range(K))
    policy = make_policy(config.policy, num_workers=K, centroids=centroids,
                         tau=0.1 if tau is None else tau, random_state=config.random_state)
    return RoutingState(policy=policy, worker_names=tuple(names), encoder=encoder,
                        num_layers=L, num_experts=E,
                        tau=tau if isinstance(policy, EldrPolicy) else None,
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


def read_signature(doc: dict, payload: object, state: RoutingState) -> SignatureResult:
    """The prompt's signature from a prefill response ``doc`` (and its eldr ``payload``)."""
    enc = state.encoder
    if enc is None:
        return SignatureResult(None, "none", "no_encoder")
    from eldr.capture import payload as wire

    L, E = state.num_layers, state.num_experts
    if payload is not None:
        source = "payload"
        shape = payload.get("shape") if isinstance(payload, dict) else None
        if isinstance(shape, list) and len(shape) in (2, 3) and shape[-2:] != [L, E]:
            _warn_once(f"prefill payloads have (layers, experts) = {shape[-2:]}, the artifact "
                       f"expects [{L}, {E}]: is it fitted for another model? Routing by load.")
            return SignatureResult(None, source, "mismatch")
        try:
            if isinstance(shape, list) and len(shape) == 3:
                counts = wire.decode_block_counts(payload, num_layers=L, num_experts=E).sum(0)
            else:
                counts = wire.decode_counts(payload, num_layers=L, num_experts=E)
        except ValueError:
            return SignatureResult(None, source, "malformed")
    else:
        routed = _routed_experts(doc)
        if routed is None:
            return SignatureResult(None, "none", "missing")
        source = "routed_experts"
        try:
            ids = wire.decode_routed_experts(routed)
            if ids.shape[1] != L:
                _warn_once(f"routed_experts have {ids.shape[1]} layers, the artifact expects "
                           f"{L}: is it fitted for another model? Routing by load.")
                return SignatureResult(None, source, "mismatch")
            counts = wire.topk_to_counts(ids, E)
        except ValueError:
            return SignatureResult(None, source, "malformed")
    if getattr(enc, "representation", "") in _GATE_REPRESENTATIONS:
        return SignatureResult(None, source, "unencodable")  # needs gate sums, not counts
    try:
        vector = state.encode(counts)
    except ValueError:
        return SignatureResult(None, source, "unencodable")
    if not np.isfinite(vector).all():
        return SignatureResult(None, source, "malformed")
    return SignatureResult(vector, source, None)


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
