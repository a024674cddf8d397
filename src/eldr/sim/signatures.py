"""Signatures as the router sees them when prefill workers cache prefixes.

With prefix caching, a prefix-hit request's prefill only computes its uncached tokens, so
the expert counts its prefill worker observes are incomplete (docs/sigcache.md).
``SimConfig.signature_source`` chooses what the decode router gets:

- ``"trace"`` (default): the signature of the request's full prompt counts, precomputed
  (``simulate(signatures=...)``) — what an exact signature cache gives;
- ``"fresh"``: counts of the freshly computed tokens only — ELDR WITHOUT the signature
  cache (the naive capture under prefix caching);
- ``"sigcache"``: counts through a real :class:`eldr.cache.sigcache.SignatureCache` per prefill
  worker (cached block rows + fresh blocks + partial tail), as a deployment computes them.

The last two need the trace's per-token ``prefill_topk`` and ``prompt_token_ids`` and the
fitted encoder. The simulator records, per request, whether the routed signature equals
the exact one (``requests["signature_exact"]``): always for ``sigcache``, only for
requests without a prefix hit for ``fresh``.

Routing BEFORE prefill: :func:`prompt_inputs` gives every request the signature and the
cost policy's profile predicted from its prompt token ids alone by a fitted
:class:`eldr.fit.prompt.PromptPredictor` (what ``RoutingArtifact.route_inputs_from_prompt``
returns), to pass to ``simulate(signatures=..., profiles=...)`` in place of the prefill
ones (``benchmarks/bench_prompt_predictor.py --simulate`` compares the two).
"""

from __future__ import annotations

import numpy as np

from eldr.cache.sigcache import SignatureCache
from eldr.fit.predictor import shrink
from eldr.traces.trace import Trace

__all__ = ["SIGNATURE_SOURCES", "OnlineSignatures", "prompt_inputs"]

SIGNATURE_SOURCES = ("trace", "fresh", "sigcache")


class OnlineSignatures:
    """Per-request signatures computed at prefill completion (``fresh`` / ``sigcache``)."""

    def __init__(self, trace: Trace, source: str, encoder, num_prefill: int,
                 cache_blocks: int) -> None:
        if source not in ("fresh", "sigcache"):
            raise ValueError(f"signature source must be 'fresh' or 'sigcache', got {source!r}")
        if trace.prefill_topk is None or trace.prompt_token_ids is None:
            raise ValueError(f"signature_source={source!r} needs a trace with prefill_topk and "
                             "prompt_token_ids (generate it with keep_topk=True)")
        if encoder is None:
            raise ValueError(f"signature_source={source!r} needs the fitted encoder")
        self.trace, self.source, self.encoder = trace, source, encoder
        m = trace.meta
        self.L, self.E, self.block_size = m.num_layers, m.num_experts, m.block_size
        self.layers = np.asarray(encoder.layers_, dtype=np.int64)
        self.offsets = trace.prefill_offsets
        self.caches = None
        if source == "sigcache":
            self.caches = [SignatureCache(cache_blocks, self.block_size, self.L, self.E,
                                          layers=self.layers) for _ in range(num_prefill)]

    def _topk(self, r: int, start: int) -> np.ndarray:
        return self.trace.prefill_topk[self.offsets[r] + start:self.offsets[r + 1]]

    def signature(self, worker: int, r: int, cached_tokens: int, hashes: list) -> np.ndarray:
        """(d,) float32 signature of trace request ``r`` prefilled on ``worker`` with
        ``cached_tokens`` prefix-cache hits; ``hashes``: its full-block hashes."""
        counts = np.zeros((self.L, self.E), dtype=np.int64)
        if self.source == "fresh":
            topk = self._topk(r, cached_tokens).astype(np.int64)
            flat = (np.arange(self.L)[None, :, None] * self.E + topk).ravel()
            counts = np.bincount(flat, minlength=self.L * self.E).reshape(self.L, self.E)
        else:
            cache = self.caches[worker]
            num_hit = min(cache.lookup(hashes), cached_tokens // self.block_size)
            start = num_hit * self.block_size
            counts[self.layers] = cache.request_counts(hashes, self._topk(r, start),
                                                       num_cached_tokens=start)
        return self.encoder.transform(counts)


def prompt_inputs(trace: Trace, encoder, predictor, *, profile_alpha: float | None = None,
                  profile_mean: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Routing inputs of every request of ``trace`` predicted from its prompt alone.

    Returns ``signatures`` (R, d) float32 (the fitted ``encoder`` applied to the predicted
    prefill profile) and ``profiles`` (R, L, E) float32 (its shrinkage by ``profile_alpha``
    toward ``profile_mean``, as the artifact's ``predict_profile`` does for real counts).
    A request with an empty prompt has nothing to predict from: an all-zero signature (the
    eldr policies' "no information", routed by load) and a uniform profile.
    """
    if trace.prompt_token_ids is None:
        raise ValueError(f"trace ({trace.meta.source}) has no prompt_token_ids: it cannot be "
                         "routed on prompt predictions")
    m = trace.meta
    if (predictor.num_layers, predictor.num_experts, predictor.top_k) != (
            m.num_layers, m.num_experts, m.top_k):
        raise ValueError("prompt predictor and trace are for different models")
    pre = np.full((trace.num_requests, m.num_layers, m.num_experts),
                  m.top_k / m.num_experts, dtype=np.float32)
    has_prompt = trace.prompt_lens > 0
    for r in np.flatnonzero(has_prompt):
        pre[r] = predictor.predict(trace.prompt_tokens(int(r)))
    signatures = encoder.transform(pre)
    signatures[~has_prompt] = 0.0
    profiles = shrink(pre, profile_alpha or 0.0, profile_mean)
    return np.ascontiguousarray(signatures, dtype=np.float32), profiles.astype(np.float32)
