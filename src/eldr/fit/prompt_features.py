"""A prompt's features: its token ids' unigrams and bigrams, hashed into buckets
(:mod:`eldr.fit.prompt`, module docstring).

:func:`ngram_hashes` is a fixed 64-bit multiplicative hash, the same in every process
(never Python's ``hash()``; :data:`HASH_NAME` names it, stored with a predictor and
checked); a bucket of ``bits`` is the hash's top ``bits`` bits. :func:`feature_row`
weights one prompt's buckets (``tfidf``: ``log(1 + tf) · idf``, L2-normalised; ``tf``:
relative frequencies), :func:`tfidf_features` every prompt's with the IDF of them all.
The compiled kernel (:mod:`eldr.fit.prompt_kernel`) mixes the same keys by the same
constants.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HASH_NAME", "bucket_counts", "check_token_ids", "feature_row", "ngram_hashes",
           "tfidf_features"]

HASH_NAME = "mul64-unigram-bigram-v1"  # names the feature hash below; stored, checked
# Odd 64-bit multipliers (golden-ratio and a MurmurHash3 finaliser constant).
_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xC2B2AE3D27D4EB4F)
_S32 = np.uint64(32)
_M1_HIGH = np.uint64((0x9E3779B97F4A7C15 << 32) % (1 << 64))  # M1 << 32


def check_token_ids(token_ids, limit: int | None, where: str = "") -> np.ndarray:
    """(P,) int64 token ids in ``[0, limit)`` (``None``: non-negative only), or ValueError
    naming the problem; ``where`` says what the limit is, for the message."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("empty prompt: no token ids")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    checked = ids.astype(np.int64, copy=False)
    # one pass for the common case: a negative id read as uint64 is >= 2**63, beyond any
    # vocabulary; the two-sided check below names the bad id
    if limit is not None and checked.view(np.uint64).max() < limit:
        return checked
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise ValueError(f"unknown token id {lo}: token ids are non-negative")
    if limit is not None and hi >= limit:
        raise ValueError(f"unknown token id {hi}: outside [0, {limit}) {where}".rstrip())
    return checked


def ngram_hashes(token_ids: np.ndarray) -> np.ndarray:
    """(2P − 1,) uint64 hashes of a prompt's P unigrams then P − 1 bigrams.

    Keys: a unigram is its id ``t`` (< 2**32); a bigram ``(a, b)`` is ``(a + 1) << 32 | b``
    (≥ 2**32, so no bigram key equals a unigram key). Each key is mixed by multiply,
    xor-shift, multiply (mod 2**64); the bucket of ``bits`` is the top ``bits`` bits,
    ``h >> (64 − bits)``, so a coarser bucketing is a shift of a finer one. Ids must be
    valid (non-negative, < 2**31); :meth:`PromptPredictor.predict` checks them first.
    """
    t = np.asarray(token_ids)
    t = t.view(np.uint64) if t.dtype == np.int64 else t.astype(np.uint64)
    keys = np.empty(2 * t.size - 1, dtype=np.uint64)
    unigrams, bigrams = keys[:t.size], keys[t.size:]
    np.multiply(t, _M1, out=unigrams)
    # ((a + 1) << 32 | b) · M1 = (a·M1 << 32) + (M1 << 32) + b·M1 (mod 2**64, as b < 2**32):
    # the bigrams' first product from the unigrams' by shifts and adds (a uint64 multiply
    # is the slowest step), in place (no temporary but the xor-shift's)
    np.left_shift(unigrams[:-1], _S32, out=bigrams)
    bigrams += _M1_HIGH
    bigrams += unigrams[1:]
    keys ^= keys >> _S32
    keys *= _M2
    return keys


def bucket_counts(hashes: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct buckets (sorted, intp) and their counts of one prompt's hashes."""
    b = (hashes >> np.uint64(64 - bits)).astype(np.int32)  # < 2**24: a 32-bit sort is
    b.sort()  # faster than a 64-bit one (docs/fit-and-routing.md, "Layout choices")
    starts = np.flatnonzero(np.concatenate(([True], b[1:] != b[:-1])))
    counts = np.diff(np.append(starts, b.size))
    return b[starts].astype(np.intp), counts


def feature_row(hashes: np.ndarray, bits: int, idf: np.ndarray, weighting: str
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(buckets, float32 weights) of one prompt: ``tfidf``: log(1 + tf) · idf,
    L2-normalised (zero stays zero); ``tf``: tf / number of n-grams (the profile is a mean
    over tokens, so a model linear in relative frequencies can match it exactly when each
    n-gram's experts are fixed)."""
    buckets, counts = bucket_counts(hashes, bits)
    if weighting == "tf":
        return buckets, counts.astype(np.float32) / np.float32(hashes.size)
    w = np.log1p(counts.astype(np.float32)) * idf[buckets]
    norm = np.sqrt(np.dot(w, w))
    if norm > 0:
        w /= norm
    return buckets, w


def tfidf_features(hashes: list[np.ndarray], bits: int, weighting: str
              ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """IDF (2**bits,) float32 over the prompts, and each prompt's feature row."""
    df = np.zeros(1 << bits, dtype=np.int64)
    for h in hashes:
        df[bucket_counts(h, bits)[0]] += 1
    n = len(hashes)
    idf = (np.log((n + 1.0) / (df + 1.0)) + 1.0).astype(np.float32)
    return idf, [feature_row(h, bits, idf, weighting) for h in hashes]
