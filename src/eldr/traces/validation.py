"""Validation of :class:`eldr.traces.trace.Trace` fields, run on construction and on load.

Every failure is a ``ValueError`` naming the field and, where it applies, the first
offending request. Arrays are normalised to the documented dtypes in place.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from eldr.traces.fields import COUNT_FIELDS, GATE_FIELDS, PREFILL_FIELDS, TOPK_FIELDS, TraceMeta

__all__ = ["TraceFields", "validate"]


class TraceFields(Protocol):
    """The fields validation reads and normalises; :class:`eldr.traces.trace.Trace` is one.
    Typed by structure so that this module need not import the trace module, which
    imports it (the optional fields, gates and per-token ids, are read by name)."""

    meta: TraceMeta
    prefill_counts: np.ndarray | None  # (R, L, E); None in a decode-only trace
    decode_counts: np.ndarray  # (R, L, E)
    prompt_lens: np.ndarray  # (R,)
    output_lens: np.ndarray  # (R,)
    domains: np.ndarray | None  # (R,)
    domain_names: tuple[str, ...] | None
    prompt_token_ids: np.ndarray | None  # (P,)
    decode_token_ids: np.ndarray | None  # (D,)


def _fail(field_name: str, msg: str, request: int | None = None) -> None:
    where = f" (request {request})" if request is not None else ""
    raise ValueError(f"trace field {field_name!r}{where}: {msg}")


def _first_bad(mask: np.ndarray) -> int:
    """Index of the first request flagged in a boolean array of leading dimension R."""
    flat = mask.reshape(mask.shape[0], -1).any(axis=1)
    return int(np.flatnonzero(flat)[0])


def validate(t: TraceFields) -> None:
    """Check every field of ``t`` (see eldr.traces.trace); normalise dtypes in place.

    Groups run in dependency order: the meta gives L, E and k; the lengths give R and the
    token totals that the counts and the per-token arrays are checked against."""
    if not isinstance(t.meta, TraceMeta):
        _fail("meta", f"must be a TraceMeta, got {type(t.meta).__name__}")
    _check_lengths(t)
    _check_prefill_present(t)
    _check_counts(t)
    _check_gates(t)
    _check_domains(t)
    _check_topk(t)
    _check_prompt_token_ids(t)
    _check_decode_token_ids(t)


def _check_prefill_present(t: TraceFields) -> None:
    """A decode-only trace (version 2: ``prefill_counts`` is None) has no prefill routing at
    all: no gate sums and no per-token prefill experts either."""
    if t.prefill_counts is not None:
        return
    if t.meta.version < 2:
        _fail("prefill_counts", "required in a version 1 trace")
    present = [name for name in PREFILL_FIELDS[1:] if getattr(t, name) is not None]
    if present:
        _fail(present[0], "prefill routing without prefill_counts (a decode-only trace has "
              "none)")


def _check_lengths(t: TraceFields) -> None:
    """``prompt_lens`` (>= 0) and ``output_lens`` (>= 1): (R,) integers, stored int64."""
    for name in ("prompt_lens", "output_lens"):
        arr = getattr(t, name)
        if not isinstance(arr, np.ndarray) or arr.ndim != 1:
            _fail(name, "must be a 1-D numpy array")
        if not np.issubdtype(arr.dtype, np.integer):
            _fail(name, f"must be integer, got dtype {arr.dtype}")
    R = t.prompt_lens.shape[0]
    if t.output_lens.shape != (R,):
        _fail("output_lens", f"shape {t.output_lens.shape}, expected ({R},)")
    if (t.prompt_lens < 0).any():
        _fail("prompt_lens", "negative length", _first_bad(t.prompt_lens < 0))
    if (t.output_lens < 1).any():
        _fail("output_lens", "must be >= 1 (the first token comes from prefill)",
              _first_bad(t.output_lens < 1))
    object.__setattr__(t, "prompt_lens", t.prompt_lens.astype(np.int64, copy=False))
    object.__setattr__(t, "output_lens", t.output_lens.astype(np.int64, copy=False))


def _check_counts(t: TraceFields) -> None:
    """Expert counts: (R, L, E) non-negative integers summing to k x tokens per layer,
    stored int32."""
    R, L, E, k = t.prompt_lens.shape[0], t.meta.num_layers, t.meta.num_experts, t.meta.top_k
    tokens = {"prefill_counts": t.prompt_lens, "decode_counts": t.output_lens - 1}
    for name in COUNT_FIELDS:
        arr = getattr(t, name)
        if arr is None and name == "prefill_counts":
            continue  # a decode-only trace (checked by _check_prefill_present)
        if not isinstance(arr, np.ndarray):
            _fail(name, "must be a numpy array")
        if arr.shape != (R, L, E):
            _fail(name, f"shape {arr.shape}, expected (R, L, E) = ({R}, {L}, {E})")
        if not np.issubdtype(arr.dtype, np.integer):
            _fail(name, f"must hold integer counts, got dtype {arr.dtype}")
        if R and (arr < 0).any():
            _fail(name, "negative count", _first_bad(arr < 0))
        # no count can exceed the layer's k x tokens selections; checked before summing, so
        # huge int64 counts cannot wrap the sum back to k x tokens (and then to int32)
        over = arr > (k * tokens[name])[:, None, None]
        if R and over.any():
            r = _first_bad(over)
            _fail(name, f"a count exceeds the request's {k} x {int(tokens[name][r])} "
                  f"selections per layer", r)
        if R and arr.dtype.itemsize > 4 and arr.max() > np.iinfo(np.int32).max:
            _fail(name, "a count does not fit int32", _first_bad(arr > np.iinfo(np.int32).max))
        sums = arr.sum(axis=2, dtype=np.int64)  # (R, L)
        bad = sums != (k * tokens[name])[:, None]
        if bad.any():
            r = _first_bad(bad)
            layer = int(np.flatnonzero(bad[r])[0])
            _fail(name, f"layer {layer} counts sum to {int(sums[r, layer])}, expected top_k x "
                  f"tokens = {k} x {int(tokens[name][r])}", r)
        if arr.dtype != np.int32:
            object.__setattr__(t, name, arr.astype(np.int32))


def _check_gates(t: TraceFields) -> None:
    """Optional summed gate outputs: (R, L, E) finite floats, stored float32."""
    R, L, E = t.prompt_lens.shape[0], t.meta.num_layers, t.meta.num_experts
    for name in GATE_FIELDS:
        arr = getattr(t, name)
        if arr is None:
            continue
        if not isinstance(arr, np.ndarray) or arr.shape != (R, L, E):
            _fail(name, f"shape {getattr(arr, 'shape', None)}, expected ({R}, {L}, {E})")
        if not np.issubdtype(arr.dtype, np.floating):
            _fail(name, f"must be floating point, got dtype {arr.dtype}")
        if R and not np.isfinite(arr).all():
            _fail(name, "non-finite value (NaN or Inf)", _first_bad(~np.isfinite(arr)))
        if arr.dtype != np.float32:
            object.__setattr__(t, name, arr.astype(np.float32))


def _check_domains(t: TraceFields) -> None:
    """Optional domain labels: (R,) integers indexing ``domain_names``, stored int32."""
    R = t.prompt_lens.shape[0]
    if t.domains is not None:
        if not isinstance(t.domains, np.ndarray) or t.domains.shape != (R,):
            _fail("domains", f"shape {getattr(t.domains, 'shape', None)}, expected ({R},)")
        if not np.issubdtype(t.domains.dtype, np.integer):
            _fail("domains", f"must be integer labels, got dtype {t.domains.dtype}")
        if t.domain_names is None:
            _fail("domain_names", "domains are given but domain_names is missing")
        n = len(t.domain_names)
        bad = (t.domains < 0) | (t.domains >= n)
        if bad.any():
            r = _first_bad(bad)
            _fail("domains", f"label {int(t.domains[r])} out of range [0, {n})", r)
        object.__setattr__(t, "domains", t.domains.astype(np.int32, copy=False))
    if t.domain_names is not None:
        object.__setattr__(t, "domain_names", tuple(str(s) for s in t.domain_names))


def _check_topk(t: TraceFields) -> None:
    """Optional per-token expert ids: (tokens, L, k) distinct ids in [0, E) per token and
    layer, one row per prompt (decode) token, stored int16."""
    L, E, k = t.meta.num_layers, t.meta.num_experts, t.meta.top_k
    expected_rows = {"prefill_topk": int(t.prompt_lens.sum()),
                     "decode_topk": int((t.output_lens - 1).sum())}
    for name in TOPK_FIELDS:
        arr = getattr(t, name)
        if arr is None:
            continue
        n = expected_rows[name]
        if not isinstance(arr, np.ndarray) or arr.shape != (n, L, k):
            _fail(name, f"shape {getattr(arr, 'shape', None)}, expected ({n}, {L}, {k})")
        if not np.issubdtype(arr.dtype, np.integer):
            _fail(name, f"must hold integer expert ids, got dtype {arr.dtype}")
        if n and ((arr < 0).any() or (arr >= E).any()):
            _fail(name, f"expert id out of range [0, {E})")
        if k > 1 and n:
            s = np.sort(arr, axis=2)
            if (s[:, :, 1:] == s[:, :, :-1]).any():
                _fail(name, "a token selects the same expert twice in one layer")
        if arr.dtype != np.int16:
            object.__setattr__(t, name, arr.astype(np.int16))


def _check_prompt_token_ids(t: TraceFields) -> None:
    """Optional prompt token ids: (Σ prompt_lens,) non-negative integers, stored int32."""
    arr = t.prompt_token_ids
    if arr is None:
        return
    n = int(t.prompt_lens.sum())
    if not isinstance(arr, np.ndarray) or arr.shape != (n,):
        _fail("prompt_token_ids", f"shape {getattr(arr, 'shape', None)}, expected ({n},)")
    if not np.issubdtype(arr.dtype, np.integer) or (n and arr.min() < 0):
        _fail("prompt_token_ids", "must be non-negative integers")
    object.__setattr__(t, "prompt_token_ids", arr.astype(np.int32, copy=False))


def _check_decode_token_ids(t: TraceFields) -> None:
    """Optional ids of the token fed at each decode step: (Σ (output_lens − 1),)
    non-negative integers, stored int32 (version 2)."""
    arr = t.decode_token_ids
    if arr is None:
        return
    n = int((t.output_lens - 1).sum())
    if not isinstance(arr, np.ndarray) or arr.shape != (n,):
        _fail("decode_token_ids", f"shape {getattr(arr, 'shape', None)}, expected ({n},)")
    if not np.issubdtype(arr.dtype, np.integer) or (n and arr.min() < 0):
        _fail("decode_token_ids", "must be non-negative integers")
    if n and arr.dtype.itemsize > 4 and arr.max() > np.iinfo(np.int32).max:
        _fail("decode_token_ids", "an id does not fit int32")
    object.__setattr__(t, "decode_token_ids", arr.astype(np.int32, copy=False))
