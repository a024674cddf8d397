"""What the router decides with: the routing state.

:class:`RoutingState` is an immutable snapshot (policy, signature encoder, decode worker
names, τ) built from the routing artifact. An artifact reload builds a new snapshot and
swaps one reference; requests in flight keep the snapshot they started with, so a reload
never disturbs them: each request's dispatch and release events go to the policy of its
own snapshot (a stateful policy such as ``eldr_cost`` keeps per-decoder expert footprints
keyed by request id). Loads live in the pool's ``LoadTracker``, not in the policy.

The prefill answer's routing inputs are read by :mod:`eldr.proxy.request.signatures`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from eldr.proxy.config import ServeConfig
from eldr.proxy.request.prompts import PromptRouting, PromptTokenizer, tokenizer_dir_for
from eldr.routing import (
    POLICIES,
    Policy,
    RoutingResources,
    make_policy,
    make_unbound_policy,
)

__all__ = ["LiveRouting", "RoutingState", "WorkerMismatch", "build_state"]


class WorkerMismatch(ValueError):
    """The artifact's decode workers are not the configured decoders."""


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
    # routing on the prompt: the artifact's prompt predictor and the router's tokenizer
    # (eldr.proxy.request.prompts), or None (the artifact has no prompt predictor)
    prompt: PromptRouting | None = None

    def encode(self, counts: np.ndarray) -> np.ndarray:
        """(d,) signature of (L, E) counts: ``encoder.transform_one`` (equal to
        ``transform``, the per-request fast path: only the mask's layers, no generic
        checks and copies; docs/fit-and-routing.md)."""
        return self.encoder.transform_one(counts)

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


class LiveRouting:
    """The routing snapshot new requests start with, and the config it was built from.

    One object shared by the router's parts (the flow reads ``state`` once per request and
    attempt; control reads both). Its two fields are replaced whole, together, and only by
    :meth:`eldr.proxy.app.Router.swap` (an artifact reload, a decoder added or removed):
    a holder rather than the router itself, so that each part gets what it reads and no
    more, at the cost of the one attribute lookup the router's own field would take.
    """

    __slots__ = ("config", "state")

    def __init__(self, state: RoutingState, config: ServeConfig) -> None:
        self.state = state  # the current routing snapshot
        self.config = config  # the config it was built from (its artifact and decoders)


def _load_artifact(path: str):
    from eldr.fit import artifact as artifact_mod

    return artifact_mod.load(path)


def _unbound(name: str, K: int, config: ServeConfig) -> Policy:
    """Policy ``name`` with no artifact: built before the model's (L, E) is known when it
    needs the shape (the first prefill payload binds it), else at once."""
    if POLICIES[name].needs_only_shape:
        return make_unbound_policy(name, num_workers=K, **_cost_options(config))
    return make_policy(name, num_workers=K, random_state=config.random_state)


def _cost_options(config: ServeConfig) -> dict:
    """The cost policy's deployment options; make_policy drops what a policy does not
    take."""
    return {"load_slack": config.load_slack, "layer_stride": config.cost_layer_stride}


_TOKENIZERS: dict[tuple, PromptTokenizer] = {}  # (pid, folder, template) -> loaded once


def load_tokenizer(directory: str, chat_template: str | None) -> PromptTokenizer:
    """The tokenizer of ``directory``, loaded once per process (reloads reuse it)."""
    import os

    key = (os.getpid(), str(directory), chat_template)
    tok = _TOKENIZERS.get(key)
    if tok is None:
        tok = _TOKENIZERS[key] = PromptTokenizer(directory, chat_template=chat_template)
    return tok


def prompt_routing(art, config: ServeConfig) -> PromptRouting | None:
    """Routing on the prompt for an artifact with a prompt predictor (None without one).

    The tokenizer comes from ``config.tokenizer``, else the artifact's model folder when
    known (:func:`~eldr.proxy.request.prompts.tokenizer_dir_for`); without either, only
    prompts given as token ids are predicted (logged once). ``ValueError`` when the
    tokenizer's fingerprint is not the one the predictor was fitted with: its token ids
    would mean other tokens.
    """
    predictor = getattr(art, "prompt_predictor", None)
    if predictor is None:
        return None
    theirs = str(getattr(predictor, "tokenizer_fingerprint", "") or "")
    folder = config.tokenizer or tokenizer_dir_for(getattr(art, "model", None))
    tok = None
    if folder is not None:
        tok = load_tokenizer(folder, config.chat_template)
        if theirs and tok.fingerprint != theirs:
            raise ValueError(f"the tokenizer in {folder} is not the one the artifact's prompt "
                             f"predictor was fitted with (fingerprint {tok.fingerprint[:12]} "
                             f"vs {theirs[:12]}); give the model's folder with --tokenizer")
    else:
        logging.getLogger("eldr.serve").warning(
            "the artifact has a prompt predictor but no tokenizer is known for its model "
            "%r: only prompts sent as token ids are routed on it (give --tokenizer DIR)",
            getattr(art, "model", None))
    return PromptRouting(predict=art.route_inputs_from_prompt, tokenizer=tok,
                         fingerprint=theirs)


def build_state(config: ServeConfig) -> RoutingState:
    """Load the artifact (if any) and build the policy for the configured decoders.

    Decode URLs map to artifact workers by the ids given with them (``ID=URL``) or, without
    ids, in order; the sets must match exactly. Policies that need fitted resources
    (centroids, ``PolicySpec.fitted``) need the artifact; a policy that needs only the
    model's (L, E) (``eldr_cost``) takes it from the artifact or, without one, from the
    first prefill payload (:class:`eldr.routing.lazy.LazyShapePolicy`). With
    ``config.stand_in`` (``--learn``) and no artifact, a policy that needs one runs the
    registry's stand-in (``PolicySpec.stand_in``) until an artifact is loaded. Raises
    ``ValueError`` naming a mismatch.
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
                raise WorkerMismatch(f"artifact {config.artifact} has {len(art_ids)} decode "
                                 f"workers {list(art_ids)}, but {K} --decode URLs were given")
            names = art_ids
        else:
            if set(config.decode_ids) != set(art_ids):
                raise WorkerMismatch(f"decode worker ids {sorted(config.decode_ids)} do not match "
                                 f"the artifact's {sorted(art_ids)}")
            order = [art_ids.index(w) for w in config.decode_ids]
            names = config.decode_ids
        if config.tau is not None:
            tau = config.tau
    elif spec.fitted and not (config.stand_in and spec.stand_in):
        raise ValueError(f"policy {config.policy!r} needs a routing artifact (--artifact DIR)")
    else:
        names = config.decode_ids or tuple(f"decode-{i}" for i in range(K))
    policy: Policy
    if art is None and spec.fitted:  # --learn: the registry's stand-in until one comes
        policy = _unbound(spec.stand_in, K, config)
    elif L is None and spec.needs_only_shape:
        policy = _unbound(config.policy, K, config)
    elif art is not None:  # the artifact's one bundle, decoders in the configured order
        resources = RoutingResources.from_artifact(
            art, order, random_state=config.random_state,
            **_cost_options(config)).as_kwargs()
        resources["tau"] = tau
        policy = make_policy(config.policy, num_workers=K, **resources)
    else:
        policy = make_policy(config.policy, num_workers=K, tau=0.1,
                             random_state=config.random_state,
                             **_cost_options(config))
    return RoutingState(policy=policy, worker_names=tuple(names), encoder=encoder,
                        num_layers=L, num_experts=E, top_k=k,
                        prompt=prompt_routing(art, config),
                        predictor=art if art is not None and
                        getattr(art, "profile_alpha", None) is not None else None,
                        tau=tau if "signature" in policy.inputs else None,
                        artifact=config.artifact, loaded_at=time.time())

