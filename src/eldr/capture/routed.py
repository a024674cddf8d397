"""vLLM's own ``routed_experts`` response field, and per-token ids to per-request counts.

GPU builds of vLLM started with ``--enable-return-routed-experts`` return, per choice, the
routing of every token that went through a forward pass as a base64 ``.npy``. Re-exported
by :mod:`eldr.capture.payload`, where the router looks for both kinds of counts.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

__all__ = ["decode_routed_experts", "topk_to_counts"]

_MAX_CHARS = 64 * 1024 * 1024  # refuse base64 strings longer than this (64 MiB)


def decode_routed_experts(b64_npy: object) -> np.ndarray:
    """(T, L, k) int32 expert ids from vLLM's ``routed_experts`` field (base64 ``.npy``).

    vLLM returns the routing of every token that went through a forward pass: the prompt
    and all generated tokens but the last, so T = prompt + output - 1. The ``.npy`` is
    loaded with ``allow_pickle=False``; ids must be non-negative integers.
    """
    if not isinstance(b64_npy, str):
        raise ValueError(f"routed_experts: must be a base64 string, got {type(b64_npy).__name__}")
    if len(b64_npy) > _MAX_CHARS:
        raise ValueError(f"routed_experts: {len(b64_npy)} characters is too large")
    try:
        raw = base64.b64decode(b64_npy.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"routed_experts: not valid base64 ({exc})") from exc
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as exc:  # bad magic, truncated header, object dtype, ...
        raise ValueError(f"routed_experts: not a readable .npy array ({exc})") from exc
    if not isinstance(arr, np.ndarray) or arr.ndim != 3:
        raise ValueError(f"routed_experts: expected a (tokens, layers, top_k) array, got "
                         f"shape {getattr(arr, 'shape', None)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"routed_experts: expert ids must be integers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"routed_experts: negative expert id {int(arr.min())}")
    return arr.astype(np.int32)


def topk_to_counts(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """(L, E) int32 counts of how many tokens chose each expert, from (T, L, k) ids.

    ``counts[l].sum() == T * k`` for every layer. Ids outside [0, num_experts) raise.
    """
    ids = np.asarray(topk)
    if ids.ndim != 3:
        raise ValueError(f"topk_to_counts: ids must be (tokens, layers, top_k), got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"topk_to_counts: ids must be integers, got dtype {ids.dtype}")
    if num_experts <= 0:
        raise ValueError(f"topk_to_counts: num_experts must be positive, got {num_experts}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"topk_to_counts: expert id out of range [0, {num_experts}): "
                         f"{int(ids.min())}..{int(ids.max())}")
    L = ids.shape[1]
    flat = ids.transpose(1, 0, 2).reshape(L, -1).astype(np.int64)
    flat += np.arange(L, dtype=np.int64)[:, None] * num_experts
    counts = np.bincount(flat.ravel(), minlength=L * num_experts)
    return counts.reshape(L, num_experts).astype(np.int32)
