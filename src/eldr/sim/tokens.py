"""Per-request expert bitsets for the simulator: what each request selects, step by step.

A request with ``n_out`` output tokens takes ``n_out`` decode steps on its decode worker:
in vLLM's PD flow the decode worker receives the prompt's KV, runs the last prompt token
and emits the first output token itself, then one token per step. The trace records the
routing of the ``n_out - 1`` tokens after the first (trace.py's token convention), so step
0 reuses the routing of decode token 0 (a request with ``n_out = 1`` selects nothing in its
one step). Hence :meth:`TokenBank.decode` returns ``n_out`` rows.

A decode-only trace (no prefill routing) gets a stand-in prompt expert set for the prefill
step's weight read (:func:`prefill_bitsets`); its decode rows are what it recorded.

Rows come from the trace's per-token top-k when present (``decode_topk``), otherwise from
:func:`~eldr.sim.steptime.deal_bitsets` on the request's decode counts, seeded per trace
request (``(seed, request index)``), so every policy of a sweep sees the same tokens.

Memory: a request's rows take ``n_out · L · W · 8`` bytes (768 B per token at 48 × 128),
so a 13k-request held-out split needs about 2 GB. Built lazily, rows live in one slab
filled request by request when every request's rows fit in ``max_bytes`` (the pages of
requests never read are never touched), else in a bounded LRU cache. A sweep instead
builds every row ONCE into the slab (:meth:`TokenBank.build_all`), optionally a
memory-mapped ``.npy`` file that every worker process maps read-only: the operating system
then holds one copy for all of them. The simulator reads a step's rows from the slab with
one gather (:meth:`TokenBank.flat_rows`), which is why it is preferred to the cache.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from eldr.sim.steptime import deal_bitsets, expert_bitsets, num_words, topk_bitsets
from eldr.traces.trace import Trace

__all__ = ["TokenBank", "prefill_bitsets"]


def prefill_bitsets(trace: Trace) -> np.ndarray:
    """(R, L, W) uint64: the experts each request's prompt selects at least once.

    A decode-only trace (format version 2, ``prefill_counts`` None) does not say: its
    prompt of ``P`` tokens is taken to select ``min(E, k·P)`` experts at every layer (the
    lowest ids, as a stand-in set). That is an upper bound of its prefill's weight read
    (exact once ``k·P ≥ E`` and the prompt touches every expert: GPT-OSS-20B's prompts of
    72+ tokens choose 288+ of 32 experts); it moves prefill time, never a decode step."""
    if trace.prefill_counts is not None:
        return expert_bitsets(trace.prefill_counts > 0)
    m = trace.meta
    n = np.minimum(m.num_experts, m.top_k * trace.prompt_lens.astype(np.int64))  # (R,)
    mask = np.arange(m.num_experts)[None, :] < n[:, None]  # (R, E)
    return expert_bitsets(np.broadcast_to(mask[:, None, :],
                                          (trace.num_requests, m.num_layers, m.num_experts)))


class TokenBank:
    """Decode-token and prefill bitsets of a trace.

    Rows are built lazily, into the slab when it fits in ``max_bytes`` (default 1 GiB),
    else into an LRU cache of at most ``max_bytes``; or all at once into the slab by
    :meth:`build_all`. Pickling a bank (to send it to a worker process) carries a built
    slab, not lazily built rows.
    """

    def __init__(self, trace: Trace, *, seed: int = 0, max_bytes: int = 1 << 30) -> None:
        self.trace = trace
        self.seed = int(seed)
        self.max_bytes = int(max_bytes)
        self.num_layers = trace.meta.num_layers
        self.num_experts = trace.meta.num_experts
        self.words = num_words(self.num_experts)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()  # r -> rows, LRU order
        self._bytes = 0
        self._slab: np.ndarray | None = None  # (Σ n_out, L, W) every request's rows
        self._filled: np.ndarray | None = None  # (R,) bool rows in the slab; None: all
        self._starts = np.concatenate([[0], np.cumsum(trace.output_lens, dtype=np.int64)])
        self._offsets = trace.decode_offsets if trace.decode_topk is not None else None
        # (R, L, W) uint64: experts each request's prompt selects at least once
        self.prefill = prefill_bitsets(trace)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_cache"], state["_bytes"] = OrderedDict(), 0  # rebuilt lazily where needed
        if self._filled is not None:  # a lazily filled slab is a cache too
            state["_slab"], state["_filled"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if isinstance(self._slab, np.memmap):  # plain views: np.memmap slicing is slower
            self._slab = self._slab.view(np.ndarray)

    @property
    def is_built(self) -> bool:
        """Every request's rows are in the slab."""
        return self._slab is not None and self._filled is None

    @property
    def nbytes_all(self) -> int:
        """Bytes of the rows of every request (the slab's size)."""
        return int(self._starts[-1]) * self.num_layers * self.words * 8

    def build_all(self, path: str | os.PathLike | None = None) -> np.ndarray:
        """Build every request's rows into one slab and serve rows from it from now on.

        ``path``: write the slab to this ``.npy`` file and map it read-only (worker
        processes given the bank then map the same file instead of copying it); ``None``:
        an in-memory array. Returns the (Σ n_out, L, W) uint64 slab."""
        if self.is_built:
            return self._slab
        shape = (int(self._starts[-1]), self.num_layers, self.words)
        if path is None:
            slab = np.empty(shape, dtype=np.uint64)
            for r in range(self.trace.num_requests):
                slab[self._starts[r]:self._starts[r + 1]] = self._rows(r)
        else:
            # written request by request, not through a map: the bytes pass through the
            # page cache without ever being resident in this process
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint64)),
                      "fortran_order": False, "shape": shape}
            with open(path, "wb") as fh:
                np.lib.format.write_array_header_1_0(fh, header)
                for r in range(self.trace.num_requests):
                    fh.write(self._rows(r).tobytes())
            # a plain view of a read-only map (np.memmap slicing is slower); joblib still
            # finds the file through .base and sends workers the file name, not the bytes
            slab = np.load(path, mmap_mode="r").view(np.ndarray)
        self._slab, self._filled = slab, None
        self._cache.clear()
        self._bytes = 0
        return slab

    def map_built(self, path: str | os.PathLike) -> np.ndarray:
        """Serve rows from a slab file that :meth:`build_all` wrote for this trace and seed
        (in another process, e.g. the worker that fitted the set-up), mapped read-only.
        Refuses a file of another shape or dtype. Returns the (Σ n_out, L, W) slab."""
        slab = np.load(path, mmap_mode="r")
        shape = (int(self._starts[-1]), self.num_layers, self.words)
        if slab.shape != shape or slab.dtype != np.uint64:
            raise ValueError(f"{os.fspath(path)}: a slab of {slab.shape} {slab.dtype}, this "
                             f"bank's is {shape} uint64")
        self._slab, self._filled = slab.view(np.ndarray), None
        self._cache.clear()
        self._bytes = 0
        return self._slab

    def drop_all(self) -> None:
        """Forget the slab (e.g. before deleting its file): rows are built lazily again."""
        self._slab, self._filled = None, None

    def flat_rows(self) -> np.ndarray | None:
        """The slab as (Σ n_out, L·W) uint64, request ``r``'s rows from ``row_start(r)``
        on; ``None`` when the rows of every request do not fit in ``max_bytes`` (rows then
        come from :meth:`decode` only). Unbuilt, the slab is allocated here and filled by
        :meth:`row_start` request by request (untouched pages take no memory)."""
        if self._slab is None:
            if self.nbytes_all > self.max_bytes:
                return None
            shape = (int(self._starts[-1]), self.num_layers, self.words)
            self._slab = np.empty(shape, dtype=np.uint64)
            self._filled = np.zeros(self.trace.num_requests, dtype=bool)
            self._cache.clear()
            self._bytes = 0
        return self._slab.reshape(self._slab.shape[0], -1)

    def row_start(self, r: int) -> int:
        """Index of trace request ``r``'s first row in :meth:`flat_rows` (its rows are
        built now if they are not yet). Call :meth:`flat_rows` first."""
        a = int(self._starts[r])
        if self._filled is not None and not self._filled[r]:
            self._slab[a:int(self._starts[r + 1])] = self._rows(r)
            self._filled[r] = True
        return a

    def decode(self, r: int) -> np.ndarray:
        """(n_out, L, W) uint64 bitsets of trace request ``r``'s decode steps."""
        if self._slab is not None:
            return self._slab[self.row_start(r):int(self._starts[r + 1])]
        rows = self._cache.get(r)
        if rows is not None:
            self._cache.move_to_end(r)
            return rows
        rows = self._rows(r)
        if rows.nbytes <= self.max_bytes:
            self._cache[r] = rows
            self._bytes += rows.nbytes
            while self._bytes > self.max_bytes:
                self._bytes -= self._cache.popitem(last=False)[1].nbytes
        return rows

    def _rows(self, r: int) -> np.ndarray:
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
        return rows
