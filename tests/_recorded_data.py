"""A small recorded trace for the simulator-on-recorded-routing tests (test_advise,
test_reproduce_real_models): gpt-oss-20b's shape, two domains whose prompts and decode
experts differ."""

from __future__ import annotations

import numpy as np

from eldr.traces.trace import Trace, TraceMeta

L, E, K = 24, 32, 4  # gpt-oss-20b's shape, so its preset prices the steps


def recorded_trace(R=48, *, prefill=False, prompt_ids=True, seed=0) -> Trace:
    """R requests of two domains: domain d draws prompt tokens from its own id range and
    decode experts mostly from its own half of the experts (per layer)."""
    rng = np.random.default_rng(seed)
    dom = np.arange(R) % 2
    plen = rng.integers(8, 20, R)
    out = rng.integers(6, 30, R)
    prompts = [rng.integers(100 * d, 100 * d + 60, n) for d, n in zip(dom, plen, strict=True)]

    def tokens(d, n):  # (n, L, K): k distinct experts, from d's half 80 % of the time
        keys = rng.random((n, L, E))
        own = (np.arange(E) // (E // 2) == d) & (rng.random((n, L, 1)) < 0.8)
        return np.argsort(-(keys + own), axis=2)[:, :, :K].astype(np.int16)
    dec = [tokens(d, n - 1) for d, n in zip(dom, out, strict=True)]
    topk = np.concatenate(dec)

    def counts(parts):
        c = np.zeros((R, L, E), np.int32)
        for r, t in enumerate(parts):
            np.add.at(c[r], (np.broadcast_to(np.arange(L)[None, :, None], t.shape), t), 1)
        return c
    pre = [tokens(d, n) for d, n in zip(dom, plen, strict=True)] if prefill else None
    return Trace(meta=TraceMeta(model="gpt-oss-20b", num_layers=L, num_experts=E, top_k=K,
                                source="test:recorded"),
                 prefill_counts=counts(pre) if prefill else None,
                 decode_counts=counts(dec), prompt_lens=plen.astype(np.int64),
                 output_lens=out.astype(np.int64), decode_topk=topk,
                 prefill_topk=np.concatenate(pre) if prefill else None,
                 prompt_token_ids=np.concatenate(prompts).astype(np.int32)
                 if prompt_ids else None,
                 domains=dom.astype(np.int32), domain_names=("a", "b"))
