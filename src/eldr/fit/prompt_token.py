"""The ``token`` model of the prompt predictor (:mod:`eldr.fit.prompt`): each n-gram's
experts learned from every prompt token (a trace's ``prefill_topk``), not from whole
prompts; a prompt's prediction is the mean of its n-grams' rows, as cheap as ``tf``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_TOKENS", "TokenData", "dense_table", "token_fold_predictions"]

MAX_TOKENS = 1 << 18  # tokens the token model learns from per fit (a seeded sample beyond)


class TokenData:
    """The ``token`` model's data: every prompt token's experts, learned per n-gram.

    The prefill profile is the mean over the prompt's tokens of each token's k-hot expert
    choice per layer, so a captured trace (``prefill_topk``) gives one supervised sample per
    TOKEN, not per prompt. The model: a token's deviation from the mean profile, in the
    target basis, is ``U[its unigram] + G[its bigram with the previous token]``, ``U`` the
    shrunk mean deviation of the tokens sharing a unigram bucket (``sum / (n + λ)``), ``G``
    the same of what ``U`` leaves, per bigram bucket (backoff); both tables share the
    hashed bucket space (one table, as in the linear models). A prompt's prediction is the
    mean over its tokens: ``mean + Σ_{n-grams} W[bucket] / P``, as cheap as the ``tf``
    model. At most ``MAX_TOKENS`` tokens (a seeded sample) are learned from.
    """

    def __init__(self, ids, hashes, experts, num_experts: int, rng) -> None:
        self.hashes = hashes
        self.lengths = np.array([p.size for p in ids])
        offsets = np.concatenate(([0], np.cumsum(self.lengths)))
        self.offsets = offsets
        total = int(offsets[-1])
        take = np.arange(total) if total <= MAX_TOKENS else np.sort(
            rng.choice(total, MAX_TOKENS, replace=False))
        self.token = take  # global index of each sampled token
        self.prompt = np.searchsorted(offsets, take, side="right") - 1
        pos = take - offsets[self.prompt]
        top = np.concatenate([np.asarray(e, dtype=np.int64).reshape(e.shape[0], -1)
                              for e in experts])[take]  # (T, L·k)
        L = np.asarray(experts[0]).shape[1]
        k = np.asarray(experts[0]).shape[2]
        self.flat = top + (np.arange(L) * num_experts).repeat(k)[None, :]  # into L·E
        self.pos = pos
        self.has_prev = pos > 0

    def _buckets(self, bits: int) -> tuple[np.ndarray, np.ndarray]:
        """(unigram bucket, bigram bucket or -1) of each sampled token."""
        shift = np.uint64(64 - bits)
        uni = np.empty(self.token.size, dtype=np.intp)
        bi = np.full(self.token.size, -1, dtype=np.intp)
        for i in np.unique(self.prompt):
            sel = np.flatnonzero(self.prompt == i)
            h, P, p = self.hashes[i], self.lengths[i], self.pos[sel]
            uni[sel] = (h[p] >> shift).astype(np.intp)
            prev = p > 0
            bi[sel[prev]] = (h[P + p[prev] - 1] >> shift).astype(np.intp)
        return uni, bi

    def tables(self, prompts: np.ndarray, bits: int, basis: np.ndarray, mean: np.ndarray,
               lam: float) -> tuple[np.ndarray, np.ndarray]:
        """The table learned from the tokens of ``prompts``, compact: (sorted buckets,
        (U, rank) float64 rows); other buckets are 0."""
        key = bits
        if getattr(self, "_key", None) != key:
            self._uni, self._bi = self._buckets(bits)
            self._key = key
        sel = np.flatnonzero(np.isin(self.prompt, prompts))
        cache = self.__dict__.setdefault("_deviations", {})
        key = (id(basis), sel.size, basis.shape[0])  # a fold's basis is reused across
        if key not in cache:  # buckets and λ: its token deviations are computed once
            bt = basis.T  # (L·E, rank)
            z = np.empty((sel.size, basis.shape[0]))
            for c in range(0, sel.size, 2048):  # bounded memory of the gathered rows
                rows = sel[c:c + 2048]
                z[c:c + 2048] = np.take(bt, self.flat[rows], axis=0).sum(axis=1)
            z -= mean @ bt
            cache[key] = (basis, z)  # the basis is kept so its id stays unique
        z = cache[key][1].copy()
        uni, bi = self._uni[sel], self._bi[sel]
        keys, vals = _bucket_means(uni, z, lam)
        z -= vals[np.searchsorted(keys, uni)]
        has = bi >= 0
        bkeys, bvals = _bucket_means(bi[has], z[has], lam)
        table_keys = np.union1d(keys, bkeys)
        table = np.zeros((table_keys.size, z.shape[1]))
        table[np.searchsorted(table_keys, keys)] += vals
        table[np.searchsorted(table_keys, bkeys)] += bvals
        return table_keys, table

    def mean_row(self, i: int, bits: int, table: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """(rank,) the model's prediction for prompt ``i`` (deviation from the mean)."""
        keys, vals = table
        rows = (self.hashes[i] >> np.uint64(64 - bits)).astype(np.intp)
        pos = np.minimum(np.searchsorted(keys, rows), keys.size - 1)
        hit = pos[keys[pos] == rows]
        return np.take(vals, hit, axis=0).sum(axis=0) / self.lengths[i]


def dense_table(table: tuple[np.ndarray, np.ndarray], num_buckets: int) -> np.ndarray:
    """(num_buckets, r) float64 from a compact (keys, values) table."""
    keys, vals = table
    out = np.zeros((num_buckets, vals.shape[1]))
    out[keys] = vals
    return out


def _bucket_means(idx: np.ndarray, z: np.ndarray, lam: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Compact table: (sorted buckets present, (U, r) Σ z over each / (count + λ))."""
    keys, inv = np.unique(idx, return_inverse=True)
    n = np.bincount(inv, minlength=keys.size).astype(np.float64)
    out = np.empty((keys.size, z.shape[1]))
    for j in range(z.shape[1]):
        out[:, j] = np.bincount(inv, weights=z[:, j], minlength=keys.size)
    return keys, out / (n + lam)[:, None]


def token_fold_predictions(tokens: TokenData, bits: int, alphas: Sequence[float],
                            train: np.ndarray, held_out: np.ndarray, mean: np.ndarray,
                            basis: np.ndarray):
    """Yield (alpha, (R_v, rank_max) float64 predicted basis coordinates of the requests
    ``held_out``) of the token model learned from the tokens of ``train``, per alpha."""
    for a in alphas:
        table = tokens.tables(train, bits, basis, mean, a)
        yield a, np.stack([tokens.mean_row(i, bits, table) for i in held_out])
