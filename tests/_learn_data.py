"""Synthetic expert routing of several domains, for the learn tests (seeded, numpy only).

Each domain prefers its own block of experts at every layer (logits +3 on E/D experts);
a token selects its top-k by Gumbel-top-k sampling, so requests of one domain share
experts without being identical. Decode tokens follow their domain's preference too (the
premise ELDR relies on: prefill routing predicts decode routing).
"""

from __future__ import annotations

import numpy as np

from eldr.learn.buffer import make_record

L, E, K = 4, 16, 2  # the synthetic model: layers, experts, top-k
NUM_DOMAINS = 4


def _logits(num_domains: int = NUM_DOMAINS) -> np.ndarray:
    """(D, L, E) fixed per-domain routing logits."""
    rng = np.random.default_rng(1234)
    base = rng.normal(0.0, 0.5, size=(num_domains, L, E))
    block = E // num_domains
    for d in range(num_domains):
        base[d, :, d * block:(d + 1) * block] += 3.0
    return base


_LOGITS = _logits()


def token_counts(rng, domain: int, tokens: int) -> np.ndarray:
    """(L, E) int32 counts of ``tokens`` tokens of ``domain`` (k selections per layer)."""
    counts = np.zeros((L, E), dtype=np.int32)
    if tokens == 0:
        return counts
    g = _LOGITS[domain][None] + rng.gumbel(size=(tokens, L, E))
    top = np.argpartition(-g, K - 1, axis=-1)[..., :K]  # (T, L, k)
    for layer in range(L):
        counts[layer] = np.bincount(top[:, layer].ravel(), minlength=E)
    return counts


def requests(rng, domains, *, with_decode: bool = True):
    """(prefill counts (R, L, E), decode counts (R, L, E) or None, prompt lens, out lens)."""
    pre, dec, plen, olen = [], [], [], []
    for d in domains:
        p = int(rng.integers(8, 40))
        o = int(rng.integers(4, 20))
        pre.append(token_counts(rng, int(d), p))
        dec.append(token_counts(rng, int(d), o - 1))
        plen.append(p)
        olen.append(o)
    return (np.stack(pre), np.stack(dec) if with_decode else None, np.array(plen),
            np.array(olen))


def records(rng, domains, *, with_decode: bool = True, decoders=("d0", "d1")):
    """Learn-buffer records of requests of ``domains`` (decoders assigned round-robin)."""
    pre, dec, plen, olen = requests(rng, domains, with_decode=with_decode)
    return [make_record(pre[i], top_k=K, decoder=decoders[i % len(decoders)], time=float(i),
                        tokens=int(plen[i]),
                        decode_counts=None if dec is None else dec[i],
                        output_tokens=int(olen[i]))
            for i in range(len(domains))]


def mix(rng, n: int, shares) -> np.ndarray:
    """(n,) domain labels drawn with probabilities ``shares`` (D,)."""
    shares = np.asarray(shares, dtype=float)
    return rng.choice(shares.size, size=n, p=shares / shares.sum())
