"""What a trace holds, by name: its format version, its metadata record and the groups of
its array fields.

A leaf of :mod:`eldr.traces`: :mod:`eldr.traces.trace` (the :class:`~eldr.traces.trace.Trace`
record, saving and loading) and :mod:`eldr.traces.validation` (checking a trace's arrays)
both import it, and it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

__all__ = ["COUNT_FIELDS", "FORMAT_VERSION", "GATE_FIELDS", "TOPK_FIELDS", "TraceMeta"]

FORMAT_VERSION = 1  # on-disk format version this eldr reads and writes

COUNT_FIELDS = ("prefill_counts", "decode_counts")  # (R, L, E) int32 expert counts
GATE_FIELDS = ("prefill_gate_prob", "prefill_gate_logit")  # (R, L, E) float32, optional
TOPK_FIELDS = ("prefill_topk", "decode_topk")  # (tokens, L, k) int16 per token, optional


@dataclass(frozen=True)
class TraceMeta:
    """What a trace is about. Validated on construction."""

    model: str  # model name, e.g. "qwen3-30b-a3b" or a local path
    num_layers: int  # L, number of MoE layers
    num_experts: int  # E, routed experts per layer
    top_k: int  # k, experts selected per token per layer
    block_size: int = 16  # KV-cache block size in tokens (prefix caching granularity)
    source: str = "unknown"  # "synthetic:<generator>" or "captured:<engine>" ...
    version: int = FORMAT_VERSION  # on-disk format version

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"trace meta: {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"trace meta: top_k={self.top_k} exceeds num_experts={self.num_experts}"
            )
        if self.version != FORMAT_VERSION:
            raise ValueError(
                f"trace meta: format version {self.version} is not supported "
                f"(this eldr reads version {FORMAT_VERSION})"
            )

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
