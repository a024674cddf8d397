"""Block hashes: one pure, reproducible hash chain over full KV-cache blocks.

A prompt of ``T`` tokens is cut into blocks of ``block_size`` tokens. Block ``i`` is named
by ``h_i = hash_block_tokens(h_{i-1}, tokens of block i, extra_keys)`` with ``h_{-1}`` a
fixed root, so a block hash names the whole prefix up to and including that block (vLLM's
prefix-caching scheme). Two prompts share their first ``n`` block hashes exactly when they
share their first ``n * block_size`` tokens (and extra keys). Only FULL blocks are hashed:
a partial tail block can still grow, so it is never cached and never named.

The signature cache (:mod:`eldr.cache.sigcache`), the simulator and the HTTP router all import
these two functions, so a hash computed in one place finds the row stored by another.

Canonical serialisation, format version 1 (pinned by a test; changing it is a format
change). The hash is SHA-256 of the concatenation of::

    parent       32 bytes: the parent block hash, or ROOT_HASH for the first block
    num_tokens   uint64 little-endian
    token ids    num_tokens x int64 little-endian
    num_keys     uint64 little-endian (0 when extra_keys is None or empty)
    each key     one tag byte, then
                   b"i": int64 little-endian            (an int or numpy integer, not bool)
                   b"s": uint64 LE length + UTF-8 bytes (a str)
                   b"b": uint64 LE length + raw bytes   (bytes)

``ROOT_HASH = sha256(b"eldr.hashing/v1/root")``. Python's built-in ``hash()`` is never used:
it is salted per process, so two processes (router and engine) would disagree.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType, Union

import numpy as np

__all__ = [
    "HASH_FORMAT_VERSION",
    "HASH_NBYTES",
    "ROOT_HASH",
    "BlockHash",
    "ExtraKey",
    "block_hashes",
    "hash_block_tokens",
]

BlockHash = NewType("BlockHash", bytes)
"""32-byte SHA-256 digest naming one full block and, through its parent, its whole prefix."""

ExtraKey = Union[int, str, bytes]  # noqa: UP007 - a runtime alias, kept py3.10-compatible
"""What may be mixed into a block hash: a LoRA id, a cache salt, a multimodal item hash..."""

HASH_FORMAT_VERSION = 1
HASH_NBYTES = 32
ROOT_HASH: BlockHash = BlockHash(hashlib.sha256(b"eldr.hashing/v1/root").digest())

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: Sequence[ExtraKey] | None = None,
) -> BlockHash:
    """Hash one full block given its parent's hash (``None`` for the first block).

    ``token_ids``: the block's token ids, a non-empty 1-D sequence of non-negative integers.
    ``extra_keys``: optional ints / strs / bytes that must also match for a cache hit
    (``None`` and ``()`` hash the same). Returns a 32-byte :data:`BlockHash`.
    """
    parent_bytes = _parent_bytes(parent)
    tokens = _token_array(token_ids, "hash_block_tokens")
    if tokens.size == 0:
        raise ValueError("hash_block_tokens: a block must hold at least one token, got none")
    return _digest(parent_bytes, tokens.tobytes(), tokens.size, _encode_extra_keys(extra_keys))


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra_keys: Sequence[ExtraKey] | None = None,
) -> list[BlockHash]:
    """Hash chain of the FULL blocks of a prompt: ``len(token_ids) // block_size`` hashes.

    The partial tail block (``len(token_ids) % block_size`` tokens) is never hashed.
    ``extra_keys`` are mixed into every block (a key of the first block alone would already
    reach every later block through the chain); for per-block keys call
    :func:`hash_block_tokens` directly.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"block_hashes: block_size must be an integer, got {block_size!r}")
    if block_size <= 0:
        raise ValueError(f"block_hashes: block_size must be positive, got {block_size}")
    tokens = _token_array(token_ids, "block_hashes")
    extra = _encode_extra_keys(extra_keys)
    raw = tokens.tobytes()
    step = 8 * int(block_size)
    parent: bytes = ROOT_HASH
    out: list[BlockHash] = []
    for i in range(tokens.size // int(block_size)):
        parent = _digest(parent, raw[i * step : (i + 1) * step], int(block_size), extra)
        out.append(parent)
    return out


# -- serialisation -------------------------------------------------------------------------
def _digest(parent: bytes, token_bytes: bytes, num_tokens: int, extra: bytes) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(_U64.pack(num_tokens))
    h.update(token_bytes)
    h.update(extra)
    return BlockHash(h.digest())


def _parent_bytes(parent: BlockHash | None) -> bytes:
    if parent is None:
        return ROOT_HASH
    if not isinstance(parent, bytes) or len(parent) != HASH_NBYTES:
        got = f"{len(parent)} bytes" if isinstance(parent, bytes) else type(parent).__name__
        raise ValueError(
            f"hash_block_tokens: parent must be a {HASH_NBYTES}-byte BlockHash or None, got {got}"
        )
    return parent


def _token_array(token_ids: Sequence[int] | np.ndarray, who: str) -> np.ndarray:
    """Token ids as a 1-D little-endian int64 array (the canonical token encoding)."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{who}: token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i8")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{who}: token_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"{who}: token id {int(arr.max())} does not fit in int64")
    arr = arr.astype("<i8", copy=False)
    if int(arr.min()) < 0:
        raise ValueError(f"{who}: token ids must be non-negative, got {int(arr.min())}")
    return np.ascontiguousarray(arr)


def _encode_extra_keys(extra_keys: Sequence[ExtraKey] | None) -> bytes:
    if extra_keys is None:
        return _U64.pack(0)
    if isinstance(extra_keys, (str, bytes)) or not isinstance(extra_keys, Sequence):
        raise ValueError(
            f"extra_keys must be a sequence (tuple/list) of int/str/bytes or None, "
            f"got {type(extra_keys).__name__}"
        )
    parts = [_U64.pack(len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, np.integer):
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
            raise ValueError(
                f"extra key {key!r}: must be int, str or bytes, got {type(key).__name__}"
            )
        if isinstance(key, int):
            if not _INT64_MIN <= key <= _INT64_MAX:
                raise ValueError(f"extra key {key}: an int key must fit in int64")
            parts += [b"i", _I64.pack(key)]
        elif isinstance(key, str):
            data = key.encode("utf-8")
            parts += [b"s", _U64.pack(len(data)), data]
        else:
            parts += [b"b", _U64.pack(len(key)), key]
    return b"".join(parts)
