"""The expert-routing trace: one format that every part of ELDR reads and writes.

A trace holds ``R`` requests of one MoE model with ``L`` MoE layers, ``E`` routed experts
per layer and top-``k`` routing. Per request it stores how many prompt tokens (prefill)
and how many generated tokens (decode) selected each expert at each layer.

Token convention. A request with ``output_lens[r] = n`` generated tokens runs ``n - 1``
decode forward passes: the first output token comes out of prefill, and the last one is
never fed back through the model (vLLM's capturer never sees it either). So decode
routing covers ``n - 1`` tokens, and for every request and layer::

    prefill_counts[r, l].sum() == k * prompt_lens[r]
    decode_counts[r, l].sum()  == k * (output_lens[r] - 1)

Decode-only traces (format version 2). A recording that lost the prompt tokens' routing
has ``prefill_counts = None`` (and no gate sums or ``prefill_topk``); its ``prompt_lens``
are still the real prompt lengths and its ``prompt_token_ids`` (if any) the real prompts.
:attr:`Trace.has_prefill` tells them apart; :meth:`Trace.require_prefill` is the one
refusal every consumer of prefill counts raises, naming what it cannot do.

On-disk format: one ``.npz`` file (``numpy.savez_compressed``), loaded with
``allow_pickle=False``. Arrays are stored under their field names; metadata is a UTF-8
JSON document stored as a ``uint8`` array under ``meta_json``. Ragged per-token arrays
are concatenated over requests in request order; their offsets are the cumulative sums
of ``prompt_lens`` (prefill) and ``output_lens - 1`` (decode). See ``docs/trace-format.md``.

:class:`TraceMeta` and the field groups are defined in :mod:`eldr.traces.fields` (which
:mod:`eldr.traces.validation` reads too) and exported from here with the trace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from eldr.fileio import NpzReader, atomic_file, open_regular
from eldr.traces.fields import (
    FORMAT_VERSION,
    GATE_FIELDS,
    PREFILL_FIELDS,
    READABLE_VERSIONS,
    TOPK_FIELDS,
    TraceMeta,
)
from eldr.traces.validation import validate

__all__ = ["FORMAT_VERSION", "MAX_TRACE_BYTES", "MAX_TRACE_FILE_BYTES", "READABLE_VERSIONS",
           "Trace", "TraceMeta", "concat", "load", "save"]

_OPTIONAL_ARRAYS = (
    "domains",
    *GATE_FIELDS,
    *TOPK_FIELDS,
    "prompt_token_ids",
    "decode_token_ids",
)


@dataclass(frozen=True, eq=False)
class Trace:
    """Expert routing of R requests. All arrays are validated in ``__post_init__``.

    Shapes (R requests, L layers, E experts, k top-k, P = Σ prompt_lens,
    D = Σ (output_lens - 1)):
    """

    meta: TraceMeta
    # (R, L, E) int32: prompt tokens that chose expert e at l; None: a decode-only trace
    prefill_counts: np.ndarray | None
    decode_counts: np.ndarray  # (R, L, E) int32: decode tokens that chose expert e at l
    prompt_lens: np.ndarray  # (R,) int64, >= 0
    output_lens: np.ndarray  # (R,) int64, >= 1 (generated tokens, first one from prefill)
    domains: np.ndarray | None = None  # (R,) int32 index into domain_names
    domain_names: tuple[str, ...] | None = None  # names of the domain labels
    prefill_gate_prob: np.ndarray | None = None  # (R, L, E) float32: Σ over prompt tokens
    prefill_gate_logit: np.ndarray | None = None  # (R, L, E) float32: Σ over prompt tokens
    prefill_topk: np.ndarray | None = None  # (P, L, k) int16 expert ids per prompt token
    decode_topk: np.ndarray | None = None  # (D, L, k) int16 expert ids per decode token
    prompt_token_ids: np.ndarray | None = None  # (P,) int32 prompt token ids
    decode_token_ids: np.ndarray | None = None  # (D,) int32 token fed at each decode step
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate(self)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return int(self.prompt_lens.shape[0])

    def __len__(self) -> int:
        return self.num_requests

    @property
    def has_prefill(self) -> bool:
        """Whether the trace records prefill routing (False: a decode-only recording)."""
        return self.prefill_counts is not None

    def require_prefill(self, what: str) -> None:
        """ValueError naming ``what`` (e.g. "the signature encoder") when the trace has no
        prefill routing: the one refusal of every consumer of prefill counts."""
        if self.prefill_counts is None:
            raise ValueError(
                f"{what} needs prefill expert counts, and this trace ({self.meta.model}, "
                f"{self.meta.source}) is decode-only: its recording has no prefill routing "
                "(docs/trace-format.md, 'Decode-only traces')")

    @property
    def decode_lens(self) -> np.ndarray:
        """(R,) int64: decode tokens whose routing is recorded, ``output_lens - 1``."""
        return self.output_lens - 1

    @property
    def prefill_offsets(self) -> np.ndarray:
        """(R + 1,) int64 offsets of each request's rows in ``prefill_topk``."""
        return _offsets(self.prompt_lens)

    @property
    def decode_offsets(self) -> np.ndarray:
        """(R + 1,) int64 offsets of each request's rows in ``decode_topk``."""
        return _offsets(self.decode_lens)

    def prompt_tokens(self, r: int) -> np.ndarray:
        """Prompt token ids of request ``r`` (requires ``prompt_token_ids``)."""
        if self.prompt_token_ids is None:
            raise ValueError("trace has no prompt_token_ids")
        off = self.prefill_offsets
        return self.prompt_token_ids[off[r] : off[r + 1]]

    # -- helpers -------------------------------------------------------------------------
    def subset(self, index: Sequence[int] | np.ndarray) -> Trace:
        """A new trace with the requests ``index`` (integer indices or a boolean mask)."""
        idx = np.asarray(index)
        if idx.dtype == bool:
            if idx.shape != (self.num_requests,):
                raise ValueError(
                    f"subset: boolean mask has shape {idx.shape}, expected ({self.num_requests},)"
                )
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (idx.min() < -self.num_requests or idx.max() >= self.num_requests):
            raise ValueError(f"subset: index out of range for a trace of {self.num_requests}")
        kw: dict = {}
        for name in ("prefill_counts", "decode_counts", "prompt_lens", "output_lens",
                     "domains", *GATE_FIELDS):
            arr = getattr(self, name)
            kw[name] = None if arr is None else arr[idx]
        kw["prefill_topk"] = _take_ragged(self.prefill_topk, self.prefill_offsets, idx)
        kw["prompt_token_ids"] = _take_ragged(self.prompt_token_ids, self.prefill_offsets, idx)
        kw["decode_topk"] = _take_ragged(self.decode_topk, self.decode_offsets, idx)
        kw["decode_token_ids"] = _take_ragged(self.decode_token_ids, self.decode_offsets, idx)
        return replace(self, _cache={}, **kw)

    def split(
        self, fraction: float, *, random_state: int | np.random.Generator | None = 0
    ) -> tuple[Trace, Trace]:
        """Seeded random split into (first, second) with ``round(fraction * R)`` first."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"split: fraction must be in (0, 1), got {fraction}")
        rng = np.random.default_rng(random_state)
        perm = rng.permutation(self.num_requests)
        n_first = round(fraction * self.num_requests)
        return self.subset(np.sort(perm[:n_first])), self.subset(np.sort(perm[n_first:]))

    def describe(self) -> str:
        m = self.meta
        doms = "" if self.domain_names is None else f", domains={list(self.domain_names)}"
        only = "" if self.has_prefill else ", decode-only (no prefill routing)"
        return (
            f"{m.model}: {self.num_requests} requests, L={m.num_layers} E={m.num_experts} "
            f"k={m.top_k}, mean prompt {self.prompt_lens.mean():.0f} / output "
            f"{self.output_lens.mean():.0f} tokens, source={m.source}{doms}{only}"
        )


def _offsets(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def _take_ragged(arr: np.ndarray | None, offsets: np.ndarray, idx: np.ndarray):
    if arr is None:
        return None
    if idx.size == 0:
        return arr[:0]
    rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
    return arr[rows]


# -- I/O ------------------------------------------------------------------------------------
def save(trace: Trace, path: str | os.PathLike) -> Path:
    """Write ``trace`` to ``path`` (``.npz``) atomically: a temporary file, then rename."""
    path = Path(path)
    meta = trace.meta.to_json()
    meta["version"] = FORMAT_VERSION  # written as this eldr's version, whatever it was read as
    meta["domain_names"] = None if trace.domain_names is None else list(trace.domain_names)
    arrays = {
        "meta_json": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        "decode_counts": trace.decode_counts,
        "prompt_lens": trace.prompt_lens,
        "output_lens": trace.output_lens,
    }
    for name in ("prefill_counts", *_OPTIONAL_ARRAYS):
        arr = getattr(trace, name)
        if arr is not None:
            arrays[name] = arr
    with atomic_file(path) as fh:
        np.savez_compressed(fh, **arrays)
    return path


MAX_TRACE_FILE_BYTES = 4 << 30  # a trace file larger than this is refused unread
MAX_TRACE_BYTES = 16 << 30  # the arrays of one trace may declare at most this much, in all
_MAX_META_BYTES = 1 << 20  # the metadata JSON document
_MAX_TOKENS = np.iinfo(np.int32).max  # per-request lengths (per-token arrays are int32-indexed)


def load(path: str | os.PathLike, *, max_bytes: int = MAX_TRACE_BYTES) -> Trace:
    """Read and validate a trace written by :func:`save`. Never unpickles anything.

    Defensive: the file must be a regular file (a FIFO is refused without blocking) of at
    most :data:`MAX_TRACE_FILE_BYTES`; the metadata and the lengths are read first, and
    every other array's header must declare exactly the shape they imply before any of its
    data is decompressed, so a small file cannot inflate into gigabytes; ``max_bytes``
    caps what all arrays declare together. Every failure is one ``ValueError`` line naming
    the file (a missing file: ``FileNotFoundError``).
    """
    path = Path(path)
    with open_regular(path, max_bytes=MAX_TRACE_FILE_BYTES, what="a trace") as fh:
        if fh.read(2) != b"PK":
            raise ValueError(f"{path}: not an .npz trace (the file is not a zip archive)")
        fh.seek(0)
        with NpzReader(fh, max_bytes=max_bytes, where=path) as npz:
            if "meta_json" not in npz.names:
                raise ValueError(f"{path}: not an eldr trace (no 'meta_json' entry)")
            meta, domain_names = _read_meta(npz, path)
            arrays = _read_arrays(npz, meta, path)
    try:
        return Trace(meta=meta,
                     domain_names=None if domain_names is None else tuple(domain_names),
                     **arrays)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _read_meta(npz: NpzReader, path: Path) -> tuple[TraceMeta, list | None]:
    def small_bytes(shape, dtype):
        if len(shape) != 1 or dtype != np.uint8 or shape[0] > _MAX_META_BYTES:
            raise ValueError(f"'meta_json' must be at most {_MAX_META_BYTES} uint8 bytes, "
                             f"got shape {list(shape)} {dtype}")

    raw = npz.read("meta_json", small_bytes)
    try:
        meta = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ValueError(f"{path}: trace metadata is not valid JSON ({reason})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: trace metadata must be a JSON object")
    domain_names = meta.pop("domain_names", None)
    if domain_names is not None and not (isinstance(domain_names, list)
                                         and all(isinstance(n, str) for n in domain_names)):
        raise ValueError(f"{path}: domain_names must be a list of strings")
    known = {f.name for f in fields(TraceMeta)}
    unknown = set(meta) - known
    if unknown:
        raise ValueError(f"{path}: unknown trace metadata keys {sorted(unknown)}")
    try:
        return TraceMeta(**meta), domain_names
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def _read_arrays(npz: NpzReader, meta: TraceMeta, path: Path) -> dict[str, np.ndarray]:
    """Lengths first, then every other array with the exact shape they imply. Version 1
    requires ``prefill_counts``; version 2 makes it optional (a decode-only trace)."""
    required = ("decode_counts", "prompt_lens", "output_lens")
    if meta.version < 2:
        required = ("prefill_counts", *required)
    missing = [n for n in required if n not in npz.names]
    if missing:
        raise ValueError(f"{path}: missing trace field(s) {missing}")
    extra = set(npz.names) - {"meta_json", "prefill_counts", *required, *_OPTIONAL_ARRAYS}
    if extra:
        raise ValueError(f"{path}: unknown trace field(s) {sorted(extra)}")

    def lengths(shape, dtype):
        if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
            raise ValueError(f"lengths must be 1-D integers, got shape {list(shape)} {dtype}")

    arrays = {"prompt_lens": npz.read("prompt_lens", lengths)}
    R = arrays["prompt_lens"].shape[0]
    arrays["output_lens"] = npz.read("output_lens", _exactly("output_lens", (R,)))
    for name, lo in (("prompt_lens", 0), ("output_lens", 1)):
        lens = arrays[name]
        if R and (lens.min() < lo or lens.max() > _MAX_TOKENS):
            raise ValueError(f"{path}: trace field {name!r}: lengths must lie in "
                             f"[{lo}, {_MAX_TOKENS}]")
    L, E, k = meta.num_layers, meta.num_experts, meta.top_k
    P = int(arrays["prompt_lens"].sum(dtype=np.int64))
    D = int((arrays["output_lens"].astype(np.int64) - 1).sum())
    shapes = {"prefill_counts": (R, L, E), "decode_counts": (R, L, E),
              "prefill_gate_prob": (R, L, E), "prefill_gate_logit": (R, L, E),
              "domains": (R,), "prefill_topk": (P, L, k), "decode_topk": (D, L, k),
              "prompt_token_ids": (P,), "decode_token_ids": (D,)}
    for name in npz.names:
        if name not in arrays and name != "meta_json":
            arrays[name] = npz.read(name, _exactly(name, shapes[name]))
    arrays.setdefault("prefill_counts", None)  # a decode-only trace (version 2)
    return arrays


def _exactly(name: str, shape: tuple[int, ...]):
    def check(declared, dtype):
        if tuple(declared) != shape:
            raise ValueError(f"trace field {name!r}: shape {list(declared)}, expected "
                             f"{list(shape)} from the metadata and lengths")
    return check


def concat(traces: Sequence[Trace]) -> Trace:
    """Concatenate traces of the same model (same L, E, k, block size) in order.

    Domain labels are merged by name. Optional arrays survive only if every trace has them.
    """
    if not traces:
        raise ValueError("concat: no traces given")
    first = traces[0].meta
    for i, t in enumerate(traces[1:], start=1):
        m = t.meta
        if (m.num_layers, m.num_experts, m.top_k, m.block_size) != (
            first.num_layers, first.num_experts, first.top_k, first.block_size
        ):
            raise ValueError(
                f"concat: trace {i} is for L={m.num_layers} E={m.num_experts} k={m.top_k} "
                f"block={m.block_size}, trace 0 for L={first.num_layers} "
                f"E={first.num_experts} k={first.top_k} block={first.block_size}"
            )
    kw: dict = {}
    for name in ("decode_counts", "prompt_lens", "output_lens"):
        kw[name] = np.concatenate([getattr(t, name) for t in traces])
    for name in PREFILL_FIELDS[1:]:  # prefill routing only if every trace has it
        if any(t.prefill_counts is None for t in traces):
            kw[name] = None
    kw["prefill_counts"] = None if any(t.prefill_counts is None for t in traces) else \
        np.concatenate([t.prefill_counts for t in traces])
    for name in (*GATE_FIELDS, *TOPK_FIELDS, "prompt_token_ids", "decode_token_ids"):
        if name in kw:
            continue
        parts = [getattr(t, name) for t in traces]
        kw[name] = None if any(p is None for p in parts) else np.concatenate(parts)
    if all(t.domains is not None for t in traces):
        names: list[str] = []
        for t in traces:
            names += [n for n in t.domain_names if n not in names]
        kw["domain_names"] = tuple(names)
        kw["domains"] = np.concatenate(
            [np.array([names.index(n) for n in t.domain_names], dtype=np.int32)[t.domains]
             for t in traces]
        )
    sources = sorted({t.meta.source for t in traces})
    licences = sorted({t.meta.licence for t in traces if t.meta.licence})
    prov = first.provenance if all(t.meta.provenance == first.provenance for t in traces) \
        else {"concatenated": f"{len(traces)} traces of differing provenance"}
    return Trace(meta=replace(first, source="+".join(sources), licence="; ".join(licences),
                              provenance=prov, version=FORMAT_VERSION), **kw)
