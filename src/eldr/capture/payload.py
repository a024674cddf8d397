"""The compact expert-count payload handed from a prefill engine to the router.

At the prefill→decode handoff the prefill engine already returns a small JSON object to
the router: ``kv_transfer_params`` in the completion response, which the router forwards
to the decode engine. The vLLM plugin (:mod:`eldr.capture.vllm_plugin`) adds one key,
:data:`PAYLOAD_KEY` (``"eldr"``), to it, so the router learns the prompt's expert counts
without a new network channel.

Wire format, version 2 (what the plugin sends; a JSON object)::

    {"v": 2,
     "shape": [L, E],            # the model's MoE layers x experts
     "layers": [2, 3],           # optional: the rows present (sorted); absent = all L
     "tokens": 123,              # prompt tokens the counts cover
     "enc": "dense",             # "dense" (|S| x E values) or "sparse" (pairs per layer)
     "w": 2,                     # characters per value: 1, 2 or 3
     "data": "<digits>"}         # every value as w base-91 digits, most significant first

Digits are the 91 JSON-safe ASCII characters ``#`` (35) to ``~`` (126) without ``\\``,
so the string needs no escaping and no base64: decoding is one ``np.take`` through a
65,536-entry table of character pairs (w = 2), not a byte-at-a-time base64 and zlib pass.
``w`` is the fewest digits that hold the largest value (91, 8,281, 753,571: a count is at
most the prompt length). ``dense`` lists the counts of the present rows in order;
``sparse`` lists each row's number of non-zero experts, then all their expert ids, then
their counts (row-major, ids increasing within a row): the (expert, count) pairs per
layer. The encoder picks the shorter. ``layers`` restricts the payload to the artifact's
layer mask when the router asks for it (``kv_transfer_params["eldr_layers"]`` of the
prefill request, :data:`LAYERS_KEY`): a third of the data for a 16-of-48 mask. Sizes and
times against version 1 are in ``benchmarks/bench_payload.py`` and docs/capture.md.

Version 1 (still decoded; ``encode_counts``)::

    {"v": 1,                     # payload format version
     "shape": [L, E],            # or [B, L, E]: per-block rows for the signature cache
     "dtype": "uint16",          # "uint16" or "uint32" (the smallest that holds the max)
     "data": "<base64>",         # base64(zlib(little-endian C-order counts))
     "tokens": 123}              # optional: prompt tokens counted (the vLLM plugin adds it)

Decoders ignore keys they do not know, so later versions may add fields.

A 48-layer, 128-expert, top-8 model's counts (Qwen3-30B-A3B) are 12 KiB raw as uint16 and
about 8.6 / 10.5 / 12.2 KB as version-1 JSON for 512 / 2,048 / 8,192-token prompts:
kilobytes, against 0.4 / 1.6 / 6.3 MB of raw int16 per-token ids.

Re-exported from :mod:`eldr.capture.routed`: the decoder of vLLM's own
``routed_experts`` response field (GPU builds started with
``--enable-return-routed-experts``) and ``topk_to_counts``. Everything that comes off the
network is validated; malformed input raises ``ValueError`` naming the problem, never
anything else, and nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from typing import NamedTuple

import numpy as np

from eldr.capture.digits import INVALID, decode_digits, encode_digits, width_for
from eldr.capture.routed import decode_routed_experts, topk_to_counts

__all__ = [
    "LAYERS_KEY",
    "MAX_PAYLOAD_CHARS",
    "PAYLOAD_KEY",
    "PAYLOAD_VERSION",
    "PAYLOAD_VERSIONS",
    "Payload",
    "decode_block_counts",
    "decode_counts",
    "decode_payload",
    "decode_routed_experts",
    "encode_counts",
    "encode_payload",
    "topk_to_counts",
]

PAYLOAD_KEY = "eldr"  # key of the payload inside ``kv_transfer_params``
LAYERS_KEY = "eldr_layers"  # key of the requested layer mask in the prefill's parameters
PAYLOAD_VERSION = 1  # version of encode_counts (kept for block rows and old routers)
PAYLOAD_VERSIONS = (1, 2)  # versions decode_payload reads
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
    """(L, E) int32 counts from a version-1 (L, E) payload or a version-2 payload.

    ``num_layers``/``num_experts`` are what the receiver expects; a payload of any other
    shape is refused (a router serving one model must not mix in another model's counts).
    Rows a layer-masked version-2 payload leaves out are zero.
    """
    if isinstance(obj, dict) and obj.get("v") == 2:
        return decode_payload(obj, num_layers=num_layers, num_experts=num_experts).counts
    arr = _decode(obj)
    if arr.shape != (num_layers, num_experts):
        raise ValueError(f"eldr payload: shape {list(arr.shape)}, expected "
                         f"[{num_layers}, {num_experts}]")
    return arr


class Payload(NamedTuple):
    """What :func:`decode_payload` read from one payload."""

    counts: np.ndarray  # (L, E) int32 prompt counts; rows absent from ``layers`` are zero
    tokens: int | None  # prompt tokens the counts cover, when the payload says
    layers: np.ndarray | None  # (|S|,) int64 sorted rows present, or None: all L rows
    # (|S|, E) int32 the rows present as sent (``counts[layers]``), or None: all L rows
    rows_counts: np.ndarray | None = None
    # every count is at most this (checked while decoding: version 2), or None (version 1)
    count_bound: int | None = None


def encode_payload(counts: np.ndarray, *, tokens: int | None = None,
                   layers=None) -> dict:
    """Version-2 payload of (L, E) non-negative integer counts (see the module docstring).

    ``layers``: sorted unique row indices to send (the router's layer mask), or None for
    all. ``tokens``: the prompt tokens counted. The dense or sparse layout is chosen by
    length. Round-trips exactly through :func:`decode_payload`.
    """
    arr = np.asarray(counts)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"encode_payload: counts must be an (L, E) integer array, got "
                         f"{arr.dtype} {arr.shape}")
    L, E = arr.shape
    if L == 0 or E == 0:
        raise ValueError(f"encode_payload: empty shape {arr.shape}")
    obj: dict = {"v": 2, "shape": [int(L), int(E)]}
    if layers is not None:
        rows, listed = _cached_layers(layers, L)
        obj["layers"] = list(listed)  # the memo's list stays ours
        arr = np.take(arr, rows, axis=0)
    if tokens is not None:
        obj["tokens"] = int(tokens)
    low, top = int(arr.min()), int(arr.max())
    if low < 0:
        raise ValueError(f"encode_payload: negative count {low}")
    S = arr.shape[0]
    nnz = int(np.count_nonzero(arr))
    w_dense = width_for(top)
    w_sparse = width_for(max(top, E))
    if (S + 2 * nnz) * w_sparse < S * E * w_dense:
        row_nnz = np.count_nonzero(arr, axis=1)
        r, e = np.nonzero(arr)
        values = np.concatenate([row_nnz, e, arr[r, e]])
        obj.update(enc="sparse", w=w_sparse, data=encode_digits(values, w_sparse))
    else:
        obj.update(enc="dense", w=w_dense, data=encode_digits(arr, w_dense))
    return obj


def decode_payload(obj: object, *, num_layers: int, num_experts: int) -> Payload:
    """Counts, tokens and rows of a version-1 or version-2 payload, fully validated.

    Refuses (``ValueError``) a payload whose shape is not (num_layers, num_experts), an
    unknown version or layout, a wrong length, characters outside the alphabet, counts
    above ``tokens``, duplicate or out-of-range experts or layers. A version-1 payload of
    per-block rows ``[B, L, E]`` is summed over its blocks.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"eldr payload: must be a JSON object, got {type(obj).__name__}")
    tokens = obj.get("tokens")
    if tokens is not None and not (type(tokens) is int and tokens >= 0):
        raise ValueError(f"eldr payload: tokens must be a non-negative integer, got "
                         f"{tokens!r}")
    version = obj.get("v")
    if version == 1 and type(version) is int:
        arr = _decode(obj)
        if arr.ndim == 3:
            if arr.shape[1:] != (num_layers, num_experts):
                raise ValueError(f"eldr payload: shape {list(arr.shape)}, expected "
                                 f"[B, {num_layers}, {num_experts}]")
            arr = arr.sum(axis=0, dtype=np.int32)
        elif arr.shape != (num_layers, num_experts):
            raise ValueError(f"eldr payload: shape {list(arr.shape)}, expected "
                             f"[{num_layers}, {num_experts}]")
        return Payload(arr, tokens, None)
    if version != 2 or type(version) is not int:
        raise ValueError(f"eldr payload: version {version!r} is not supported "
                         f"(this eldr reads versions {list(PAYLOAD_VERSIONS)})")
    return _decode_v2(obj, num_layers, num_experts, tokens)


def _decode_v2(obj: dict, L: int, E: int, tokens: int | None) -> Payload:
    if obj.get("shape") != [L, E]:
        raise ValueError(f"eldr payload: shape {obj.get('shape')!r}, expected [{L}, {E}]")
    layers = obj.get("layers")
    rows = None if layers is None else _cached_layers(layers, L)[0]
    S = L if rows is None else rows.size
    width, data, enc = obj.get("w"), obj.get("data"), obj.get("enc")
    if type(width) is not int or width not in (1, 2, 3):
        raise ValueError(f"eldr payload: w must be 1, 2 or 3, got {width!r}")
    if not isinstance(data, str):
        raise ValueError(f"eldr payload: data must be a string, got {type(data).__name__}")
    if len(data) > MAX_PAYLOAD_CHARS:
        raise ValueError(f"eldr payload: data is {len(data)} characters, over the "
                         f"{MAX_PAYLOAD_CHARS} limit")
    bound = INVALID - 1 if tokens is None else tokens  # a count is at most the prompt
    if enc == "dense":
        if len(data) != S * E * width:
            raise ValueError(f"eldr payload: data is {len(data)} characters, expected "
                             f"{S * E * width} for {S} x {E} values of width {width}")
        values = decode_digits(data, width)
        top = int(values.max()) if values.size else 0
        if top > bound:
            raise ValueError(_bad_values(values, bound))
        sub = values.reshape(S, E)
    elif enc == "sparse":
        sub, top = _decode_sparse(decode_digits(data, width), S, E, bound), bound
    else:
        raise ValueError(f"eldr payload: enc must be 'dense' or 'sparse', got {enc!r}")
    if rows is None:
        return Payload(sub, tokens, None, None, top)
    counts = np.zeros((L, E), dtype=np.int32)
    counts[rows] = sub
    return Payload(counts, tokens, rows, sub, top)


def _decode_sparse(values: np.ndarray, S: int, E: int, bound: int) -> np.ndarray:
    """(S, E) int32 from [nnz per row (S)] [expert ids (N)] [counts (N)]."""
    if values.size < S:
        raise ValueError(f"eldr payload: sparse data holds {values.size} values, fewer "
                         f"than its {S} row sizes")
    nnz = values[:S]
    if S and int(nnz.max()) > E:
        raise ValueError(f"eldr payload: a row lists more than {E} experts")
    N = int(nnz.sum())
    if values.size != S + 2 * N:
        raise ValueError(f"eldr payload: sparse data holds {values.size} values, expected "
                         f"{S + 2 * N} for {N} (expert, count) pairs")
    ids, cnt = values[S:S + N], values[S + N:]
    out = np.zeros((S, E), dtype=np.int32)
    if N == 0:
        return out
    if int(ids.max()) >= E:
        raise ValueError(f"eldr payload: expert id {int(ids.max())} out of range [0, {E})")
    if int(cnt.max()) > bound or int(cnt.min()) < 1:
        raise ValueError(_bad_values(cnt, bound))
    flat = np.repeat(np.arange(S, dtype=np.int64) * E, nnz) + ids
    if (np.diff(flat) <= 0).any():
        raise ValueError("eldr payload: expert ids must increase within each layer")
    out.ravel()[flat] = cnt
    return out


def _bad_values(values: np.ndarray, bound: int) -> str:
    if int(values.max()) >= INVALID:
        return "eldr payload: data holds characters outside the base-91 alphabet"
    return f"eldr payload: count {int(values.max())} is over {bound} (the tokens counted)"


_LAYER_MEMO: dict[tuple, tuple[np.ndarray, list]] = {}  # a router asks for one mask


def _cached_layers(layers: object, num_layers: int) -> tuple[np.ndarray, list]:
    """(rows, rows as a list) of :func:`_check_layers`, memoised: every request carries
    the same mask. A hit needs an equal list of ints (``1.0 == 1`` would also hit: the same
    rows, so harmless); a miss is validated in full."""
    key = (num_layers, *layers) if isinstance(layers, list) else None
    hit = _LAYER_MEMO.get(key) if key is not None else None
    if hit is None:
        rows = _check_layers(layers, num_layers)
        hit = (rows, rows.tolist())
        if key is not None and len(_LAYER_MEMO) < 64:
            _LAYER_MEMO[key] = hit
    return hit


def _check_layers(layers: object, num_layers: int) -> np.ndarray:
    """(|S|,) int64 sorted unique row indices in [0, num_layers), or ValueError."""
    if isinstance(layers, np.ndarray):
        layers = layers.tolist()
    if (not isinstance(layers, list | tuple) or not layers
            or not all(type(x) is int for x in layers)):
        raise ValueError(f"eldr payload: layers must be a non-empty list of integers, got "
                         f"{layers!r}")
    rows = np.asarray(layers, dtype=np.int64)
    if rows[0] < 0 or rows[-1] >= num_layers or (rows.size > 1 and (np.diff(rows) <= 0).any()):
        raise ValueError(f"eldr payload: layers must increase within [0, {num_layers}), "
                         f"got {layers!r}")
    return rows


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
                         f"(this eldr reads versions {list(PAYLOAD_VERSIONS)})")
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
