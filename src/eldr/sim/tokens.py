"""Per-request expert bitsets for the simulator: what each request selects, step by step.

A request with ``n_out`` output tokens takes ``n_out`` decode steps on its decode worker:
in vLLM's PD flow the decode worker receives the prompt's KV, runs the last prompt token
and emits the first output token itself, then one token per step. The trace records the
routing of the ``n_out - 1`` tokens after the first (trace.py's token convention), so step
0 reuses the routing of decode token 0 (a request with ``n_out = 1`` selects nothing in its
one step). Hence :meth:`TokenBank.decode` returns ``n_out`` rows.

Rows come from the trace's per-token top-k when present (``decode_topk``), otherwise from
:func:`~eldr.sim.steptime.deal_bitsets` on the request's decode counts, seeded per trace
request (``(seed, request index)``), so every policy of a sweep sees the same tokens.
"""

from __future__ import annotations

import numpy as np

from eldr.sim.steptime import deal_bitsets, expert_bitsets, num_words, topk_bitsets
from eldr.traces.trace import Trace

__all__ = ["TokenBank"]


class TokenBank:
    """Decode-token and prefill bitsets of a trace, built lazily and cached up to a budget.

    ``max_bytes`` bounds the cache of decode rows (default 1 GiB); past it rows are built
    again on each use (same seed, same rows). Share one bank across the runs of a sweep.
    """

    def __init__(self, trace: Trace, *, seed: int = 0, max_bytes: int = 1 << 30) -> None:
        self.trace = trace
        self.seed = int(seed)
        self.max_bytes = int(max_bytes)
        self.num_layers = trace.meta.num_layers
        self.num_experts = trace.meta.num_experts
        self.words = num_words(self.num_experts)
        self._decode: dict[int, np.ndarray] = {}
        self._bytes = 0
        self._offsets = trace.decode_offsets if trace.decode_topk is not None else None
        # (R, L, W) uint64: experts each request's prompt selects at least once
        self.prefill = expert_bitsets(trace.prefill_counts > 0)

    def build_all(self) -> int:
        """Build (and cache, within budget) every request's rows now, e.g. before forking
        worker processes so they share the rows. Returns the number cached."""
        for r in range(self.trace.num_requests):
            if self._bytes >= self.max_bytes:
                break
            self.decode(r)
        return len(self._decode)

    def decode(self, r: int) -> np.ndarray:
        """(n_out, L, W) uint64 bitsets of trace request ``r``'s decode steps."""
        rows = self._decode.get(r)
        if rows is not None:
            return rows
        t = self.trace
        n_out = int(t.output_lens[r])
        if self._offsets is not None:
            tokens = topk_bitsets(t.decode_topk[self._offsets[r]:self._offsets[r + 1]],
                                  self.num_experts)
        else:
            rng = np.random.default_rng((self.seed, 0xDEC0DE, r))
            tokens = deal_bitsets(t.decode_counts[r], n_out - 1, rng)
        rows = np.empty((n_out, self.num_layers, self.words), dtype=np.uint64)
        if n_out > 1:
            rows[0] = tokens[0]
            rows[1:] = tokens
        else:
            rows[0] = 0
        if self._bytes + rows.nbytes <= self.max_bytes:
            self._decode[r] = rows
            self._bytes += rows.nbytes
        return rows
