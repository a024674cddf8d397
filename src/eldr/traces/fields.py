"""What a trace holds, by name: its format version, its metadata record and the groups of
its array fields.

A leaf of :mod:`eldr.traces`: :mod:`eldr.traces.trace` (the :class:`~eldr.traces.trace.Trace`
record, saving and loading) and :mod:`eldr.traces.validation` (checking a trace's arrays)
both import it, and it imports neither.

Format version 2 (this eldr writes it; version 1 files still load):

- prefill routing is optional: a decode-only recording (``prefill_counts`` absent) keeps its
  real ``prompt_lens`` and, where recorded, its ``prompt_token_ids``;
- the metadata carries ``licence`` and ``provenance`` (where the routing came from);
- ``decode_token_ids`` (optional): the token fed at each decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

__all__ = ["COUNT_FIELDS", "FORMAT_VERSION", "GATE_FIELDS", "PREFILL_FIELDS",
           "READABLE_VERSIONS", "TOPK_FIELDS", "TraceMeta"]

FORMAT_VERSION = 2  # on-disk format version this eldr writes
READABLE_VERSIONS = (1, 2)  # versions this eldr reads

COUNT_FIELDS = ("prefill_counts", "decode_counts")  # (R, L, E) int32 expert counts
GATE_FIELDS = ("prefill_gate_prob", "prefill_gate_logit")  # (R, L, E) float32, optional
TOPK_FIELDS = ("prefill_topk", "decode_topk")  # (tokens, L, k) int16 per token, optional
# prefill routing: all absent in a decode-only trace (version 2)
PREFILL_FIELDS = ("prefill_counts", *GATE_FIELDS, "prefill_topk")

_MAX_PROVENANCE_KEYS = 64
_MAX_TEXT = 4096  # characters of one provenance value or of the licence


def _check_provenance(prov) -> dict:
    """A flat JSON object: string keys, values strings, numbers, booleans or null."""
    if not isinstance(prov, dict):
        raise ValueError(f"trace meta: provenance must be a JSON object, got "
                         f"{type(prov).__name__}")
    if len(prov) > _MAX_PROVENANCE_KEYS:
        raise ValueError(f"trace meta: provenance has {len(prov)} keys, at most "
                         f"{_MAX_PROVENANCE_KEYS}")
    for key, value in prov.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"trace meta: provenance keys must be non-empty strings, got "
                             f"{key!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"trace meta: provenance[{key!r}] is not finite")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise ValueError(f"trace meta: provenance[{key!r}] must be a string, number, "
                             f"boolean or null, got {type(value).__name__}")
        if isinstance(value, str) and len(value) > _MAX_TEXT:
            raise ValueError(f"trace meta: provenance[{key!r}] longer than {_MAX_TEXT} "
                             "characters")
    return dict(prov)


@dataclass(frozen=True)
class TraceMeta:
    """What a trace is about. Validated on construction."""

    model: str  # model name, e.g. "qwen3-30b-a3b" or a local path
    num_layers: int  # L, number of MoE layers
    num_experts: int  # E, routed experts per layer
    top_k: int  # k, experts selected per token per layer
    block_size: int = 16  # KV-cache block size in tokens (prefix caching granularity)
    source: str = "unknown"  # "synthetic:<generator>", "captured:<engine>", "imported:<layout>"
    version: int = FORMAT_VERSION  # on-disk format version the trace was read from
    licence: str = ""  # licence of the routing data ("" = not stated; version 2)
    # where the routing came from (version 2): a flat JSON object, e.g. url, commit,
    # recorder, conversion, split; not part of the hash
    provenance: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"trace meta: {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"trace meta: top_k={self.top_k} exceeds num_experts={self.num_experts}"
            )
        if self.version not in READABLE_VERSIONS:
            raise ValueError(
                f"trace meta: format version {self.version} is not supported "
                f"(this eldr reads versions {', '.join(map(str, READABLE_VERSIONS))})"
            )
        if not isinstance(self.licence, str) or len(self.licence) > _MAX_TEXT:
            raise ValueError(f"trace meta: licence must be a string of at most {_MAX_TEXT} "
                             "characters")
        object.__setattr__(self, "provenance", _check_provenance(self.provenance))

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["provenance"] = dict(self.provenance)
        return out
