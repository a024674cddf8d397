"""A toy captured-like trace whose prompt tokens determine their experts (prompt tests)."""

import numpy as np

from eldr.traces.trace import Trace, TraceMeta

L, E, K_TOP, VOCAB = 3, 8, 2, 48


def token_trace(R=90, seed=0, vocab=VOCAB, with_topk=False):
    """Three domains, each with its own 16 token ids; each token id selects fixed experts
    per layer (so the prefill profile is the mean of its tokens' choices), decode tokens
    follow the domain's experts. ``with_topk``: also each prompt token's experts
    (``prefill_topk``), what the token model learns from."""
    rng = np.random.default_rng(seed)
    experts = np.stack([np.stack([np.random.default_rng(t).choice(E, K_TOP, replace=False)
                                  for _ in range(L)]) for t in range(vocab)])  # (V, L, k)
    dom = np.arange(R) % 3
    lens = rng.integers(4, 24, R)
    outs = rng.integers(16, 40, R)
    tokens, pre = [], np.zeros((R, L, E), dtype=np.int32)
    dec = np.zeros((R, L, E), dtype=np.int32)
    width = vocab // 3
    for r in range(R):
        ids = rng.integers(dom[r] * width, (dom[r] + 1) * width, lens[r])
        tokens.append(ids)
        for t in ids:
            for layer in range(L):
                pre[r, layer, experts[t, layer]] += 1
        for _ in range(outs[r] - 1):
            t = rng.integers(dom[r] * width, (dom[r] + 1) * width)
            for layer in range(L):
                dec[r, layer, experts[t, layer]] += 1
    topk = np.concatenate([experts[t] for t in tokens]).astype(np.int16) if with_topk else None
    return Trace(meta=TraceMeta("toy", L, E, K_TOP, source="test"), prefill_counts=pre,
                 prefill_topk=topk,
                 decode_counts=dec, prompt_lens=lens.astype(np.int64),
                 output_lens=outs.astype(np.int64), domains=dom.astype(np.int32),
                 domain_names=("a", "b", "c"),
                 prompt_token_ids=np.concatenate(tokens).astype(np.int32))


def two_domain_trace(R: int = 48, seed: int = 0) -> Trace:
    """Two domains of token ids (0-39 and 40-79); each id picks fixed experts per layer,
    among 0-3 (ids < 40) or 4-7, so a prompt's ids determine its prefill counts (what a
    prompt predictor learns). Decode: 3 steps, the experts of the prompt's first 3 tokens.
    The router's tests route on it with decoders named ``w-code`` (ids < 40) and
    ``w-other``."""
    L_, E_, k = 3, 8, 2
    rng = np.random.default_rng(seed)
    picks = np.stack([[rng.permutation(4)[:k] + 4 * (t >= 40) for _ in range(L_)]
                      for t in range(80)])  # (80, L, k)
    dom = np.arange(R) % 2
    lens = rng.integers(6, 20, R)
    tokens, pre = [], np.zeros((R, L_, E_), dtype=np.int32)
    dec = np.zeros_like(pre)
    for r in range(R):
        ids = rng.integers(dom[r] * 40, dom[r] * 40 + 40, lens[r])
        tokens.append(ids)
        for j, t in enumerate(ids):
            for layer in range(L_):
                pre[r, layer, picks[t, layer]] += 1
                if j < 3:
                    dec[r, layer, picks[t, layer]] += 1
    return Trace(meta=TraceMeta("toy", L_, E_, k, source="test"), prefill_counts=pre,
                 decode_counts=dec, prompt_lens=lens.astype(np.int64),
                 output_lens=np.full(R, 4, dtype=np.int64), domains=dom.astype(np.int32),
                 domain_names=("a", "b"),
                 prompt_token_ids=np.concatenate(tokens).astype(np.int32))


def mix64(key: int) -> int:
    """The documented 64-bit mix of one n-gram key, in Python integers."""
    mask = (1 << 64) - 1
    h = key * 0x9E3779B97F4A7C15 & mask
    h ^= h >> 32
    return h * 0xC2B2AE3D27D4EB4F & mask
