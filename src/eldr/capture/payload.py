"""The compact expert-count payload handed from a prefill engine to the router.

At the prefill→decode handoff the prefill engine already returns a small JSON object to
the router: ``kv_transfer_params`` in the completion response, which the router forwards
to the decode engine. The vLLM plugin (:mod:`eldr.capture.vllm_plugin`) adds one key,
:data:`PAYLOAD_KEY` (``"eldr"``), to it, so the router learns the prompt's expert counts
without a new network channel.

Wire format, version 1 (a JSON object)::

    {"v": 1,                     # payload format version
     "shape": [L, E],            # or [B, L, E]: per-block rows for the signature cache
     "dtype": "uint16",          # "uint16" or "uint32" (the smallest that holds the max)
     "data": "<base64>",         # base64(zlib(little-endian C-order counts))
     "tokens": 123}              # optional: prompt tokens counted (the vLLM plugin adds it)

Decoders ignore keys they do not know, so later versions may add fields.

A 48-layer, 128-expert, top-8 model's counts (Qwen3-30B-A3B) are 12 KiB raw as uint16 and
about 8.6 / 10.5 / 12.2 KB as JSON for 512 / 2,048 / 8,192-token prompts (zlib gains
little on dense counts; base64 adds a third): kilobytes, against 0.4 / 1.6 / 6.3 MB of raw
int16 per-token ids. The tiny shipped MoE (6 x 64) needs about 570 bytes.

Also decoded here: vLLM's own ``routed_experts`` response field (GPU builds started with
``--enable-return-routed-experts``), a base64 ``.npy`` of shape (tokens - 1, L, k).
Everything that comes off the network is validated; malformed input raises ``ValueError``
naming the problem, never anything else, and nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import binascii
import io
import zlib

import numpy as np

__all__ = [
    "MAX_PAYLOAD_CHARS",
    "PAYLOAD_KEY",
    "PAYLOAD_VERSION",
    "decode_block_counts",
    "decode_counts",
    "decode_routed_experts",
    "encode_counts",
    "topk_to_counts",
]

PAYLOAD_KEY = "eldr"  # key of the payload inside ``kv_transfer_params``
PAYLOAD_VERSION = 1
MAX_PAYLOAD_CHARS = 8 * 1024 * 1024  # refuse base64 strings longer than this (8 MiB)
_MAX_ELEMENTS = 1 << 26  # refuse shapes over 64 M counts (a decompression bomb guard)
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def encode_counts(counts: np.ndarray) -> dict:
    """Encode non-negative integer counts (L, E) or (B, L, E) as a JSON-able dict.

    ``counts`` may be any integer dtype; values must lie in [0, 2**32). The smallest of
    uint16/uint32 that holds the maximum is used. The result round-trips exactly through
    :func:`decode_counts` (2-D) or :func:`decode_block_counts` (3-D).
    """
    arr = np.asarray(counts)
    if arr.ndim not in (2, 3):
        raise ValueError(
            f"encode_counts: counts must be (L, E) or (B, L, E), got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"encode_counts: counts must be integers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"encode_counts: negative count {int(arr.min())}")
    top = int(arr.max()) if arr.size else 0
    if top >= 1 << 32:
        raise ValueError(f"encode_counts: count {top} does not fit in uint32")
    name = "uint16" if top < 1 << 16 else "uint32"
    raw = np.ascontiguousarray(arr, dtype=_DTYPES[name]).tobytes()
    data = base64.b64encode(zlib.compress(raw, 6)).decode("ascii")
    return {"v": PAYLOAD_VERSION, "shape": [int(s) for s in arr.shape], "dtype": name,
            "data": data}


def decode_counts(obj: object, *, num_layers: int, num_experts: int) -> np.ndarray:
    """(L, E) int32 counts from a payload made by :func:`encode_counts` of an (L, E) array.

    ``num_layers``/``num_experts`` are what the receiver expects; a payload of any other
    shape is refused (a router serving one model must not mix in another model's counts).
    """
    arr = _decode(obj)
    if arr.shape != (num_layers, num_experts):
        raise ValueError(f"eldr payload: shape {list(arr.shape)}, expected "
                         f"[{num_layers}, {num_experts}]")
    return arr


def decode_block_counts(obj: object, *, num_layers: int, num_experts: int) -> np.ndarray:
    """(B, L, E) int32 per-block counts from a payload of a 3-D array (B >= 0 blocks)."""
    arr = _decode(obj)
    if arr.ndim != 3 or arr.shape[1:] != (num_layers, num_experts):
        raise ValueError(f"eldr payload: shape {list(arr.shape)}, expected "
                         f"[B, {num_layers}, {num_experts}]")
    return arr


def _decode(obj: object) -> np.ndarray:
    if not isinstance(obj, dict):
        raise ValueError(f"eldr payload: must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("v", "shape", "dtype", "data") if k not in obj]
    if missing:
        raise ValueError(f"eldr payload: missing key(s) {missing}")
    if obj["v"] != PAYLOAD_VERSION or isinstance(obj["v"], bool):
        raise ValueError(f"eldr payload: version {obj['v']!r} is not supported "
                         f"(this eldr reads version {PAYLOAD_VERSION})")
    shape = obj["shape"]
    if (not isinstance(shape, list) or len(shape) not in (2, 3)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                       for s in shape)):
        raise ValueError(f"eldr payload: shape must be a list of 2 or 3 non-negative "
                         f"integers, got {shape!r}")
    size = int(np.prod(shape, dtype=np.int64))
    if size > _MAX_ELEMENTS:
        raise ValueError(f"eldr payload: shape {shape} is too large ({size} counts)")
    dtype = _DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"eldr payload: dtype must be one of {sorted(_DTYPES)}, "
                         f"got {obj['dtype']!r}")
    raw = _unbase64_unzip(obj["data"], expected=size * dtype.itemsize)
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return arr.astype(np.int32) if dtype.itemsize < 4 else _to_int32(arr)


def _to_int32(arr: np.ndarray) -> np.ndarray:
    if arr.size and int(arr.max()) > np.iinfo(np.int32).max:
        raise ValueError(f"eldr payload: count {int(arr.max())} is too large for int32")
    return arr.astype(np.int32)


def _unbase64_unzip(data: object, *, expected: int) -> bytes:
    if not isinstance(data, str):
        raise ValueError(f"eldr payload: data must be a base64 string, got "
                         f"{type(data).__name__}")
    if len(data) > MAX_PAYLOAD_CHARS:
        raise ValueError(f"eldr payload: data is {len(data)} characters, over the "
                         f"{MAX_PAYLOAD_CHARS} limit")
    try:
        packed = base64.b64decode(data.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"eldr payload: data is not valid base64 ({exc})") from exc
    inflater = zlib.decompressobj()
    try:
        # max_length bounds memory even for a hostile stream; one byte over reveals excess.
        raw = inflater.decompress(packed, expected + 1)
    except zlib.error as exc:
        raise ValueError(f"eldr payload: data is not valid zlib ({exc})") from exc
    if len(raw) != expected or not inflater.eof or inflater.unused_data:
        raise ValueError(f"eldr payload: data holds {len(raw)}{'+' if not inflater.eof else ''} "
                         f"bytes, expected {expected} for the declared shape and dtype")
    return raw


def decode_routed_experts(b64_npy: object) -> np.ndarray:
    """(T, L, k) int32 expert ids from vLLM's ``routed_experts`` field (base64 ``.npy``).

    vLLM returns the routing of every token that went through a forward pass: the prompt
    and all generated tokens but the last, so T = prompt + output - 1. The ``.npy`` is
    loaded with ``allow_pickle=False``; ids must be non-negative integers.
    """
    if not isinstance(b64_npy, str):
        raise ValueError(f"routed_experts: must be a base64 string, got {type(b64_npy).__name__}")
    if len(b64_npy) > MAX_PAYLOAD_CHARS * 8:
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
