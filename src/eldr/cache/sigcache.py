"""Block-granular expert-signature cache, keyed and evicted like the paged KV cache.

With prefix caching an engine skips prefill for the cached blocks of a prompt, so the
expert counts it observes for a prefix-hit request are incomplete. ELDR therefore keeps one
row of counts per KV block: ``row[l, e]`` = tokens of that block whose top-k at MoE layer
``l`` contains expert ``e``. A request's counts are::

    counts = Σ rows of its cached (hit) blocks      read from the cache
           + Σ rows of its freshly computed blocks  built from top-k ids, then inserted
           + counts of its partial tail block        built from top-k ids, never cached

which is exact under partial hits and evictions, whichever request populated a block
(docs/sigcache.md). Blocks are named by :func:`eldr.cache.hashing.block_hashes`.

Typical use (engine, simulator or router)::

    hashes = block_hashes(prompt_ids, block_size)
    num_hit = cache.lookup(hashes)                       # leading cached blocks
    topk = run_prefill(prompt_ids[num_hit * block_size:])  # (T_new, L, k) expert ids
    counts = cache.request_counts(hashes, topk, num_cached_tokens=num_hit * block_size)

Memory: the rows live in ONE preallocated array ``(num_blocks, |S|, E)`` of int8 (block
sizes up to 127; int16 beyond). int8 cannot overflow: the top-k experts of one token at
one layer are distinct, so a block of ``B`` tokens adds at most ``B`` to any (layer,
expert) cell, and ``B <= 127``. Hence the cache holds at most ``num_blocks * |S| * E``
bytes — e.g. 6 KiB per 16-token block for 48 x 128, 0.39% of Qwen3-30B-A3B's 1.5 MiB of
KV per block. The hash -> slot index is an ``OrderedDict`` that doubles as the LRU list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from eldr.cache.hashing import HASH_NBYTES, BlockHash

__all__ = [
    "BlockRows",
    "SignatureCache",
    "block_rows",
    "counts_dtype",
    "kv_fraction",
    "signature_bytes_per_block",
]


def counts_dtype(block_size: int) -> np.dtype:
    """Smallest signed dtype that holds a block's count: int8 up to 127 tokens, then int16."""
    block_size = _positive_int(block_size, "block_size")
    if block_size <= np.iinfo(np.int8).max:
        return np.dtype(np.int8)
    if block_size <= np.iinfo(np.int16).max:
        return np.dtype(np.int16)
    raise ValueError(f"block_size={block_size} is too large (at most 32767 tokens)")


def signature_bytes_per_block(num_layers: int, num_experts: int, block_size: int) -> int:
    """Bytes of one cache row: ``num_layers * num_experts * itemsize`` (layers = the mask)."""
    n_layers = _positive_int(num_layers, "num_layers")
    n_experts = _positive_int(num_experts, "num_experts")
    return n_layers * n_experts * counts_dtype(block_size).itemsize


def kv_fraction(
    num_layers: int, num_experts: int, block_size: int, kv_bytes_per_token: float
) -> float:
    """Signature-cache bytes / KV-cache bytes of the same blocks (independent of their count).

    ``num_layers`` is the number of cached layers (all MoE layers, or the mask size).
    Fixed per-request KV (e.g. a sliding-window or sink buffer) is not part of a paged
    block and is ignored, so this is an upper bound on the true fraction.
    """
    if not kv_bytes_per_token > 0:
        raise ValueError(f"kv_bytes_per_token must be positive, got {kv_bytes_per_token!r}")
    row = signature_bytes_per_block(num_layers, num_experts, block_size)
    return row / (block_size * float(kv_bytes_per_token))


class BlockRows(NamedTuple):
    """Per-block counts built from per-token top-k ids (see :func:`block_rows`)."""

    rows: np.ndarray  # (num_full_blocks, S, E) int32: counts of each FULL block, in order
    tail: np.ndarray  # (S, E) int32: counts of the partial tail block (all zero if none)


def block_rows(
    topk: np.ndarray,
    *,
    block_size: int,
    num_experts: int,
    layers: Sequence[int] | np.ndarray | None = None,
) -> BlockRows:
    """Count top-k selections per block, vectorised (one ``np.bincount``, no token loop).

    ``topk``: (T, L, k) integer expert ids of T consecutive tokens that start on a block
    boundary; token ``t`` falls in block ``t // block_size``. ``layers``: the layer mask
    (indices into L, kept in the given order) or ``None`` for all layers, so S = |layers|
    or L. Returns ``T // block_size`` full-block rows and the tail row of the remaining
    ``T % block_size`` tokens.
    """
    B = _positive_int(block_size, "block_size")
    E = _positive_int(num_experts, "num_experts")
    topk = _check_topk(topk, E)
    if layers is not None:
        topk = topk[:, _check_layers(layers, topk.shape[1]), :]
    return _count_blocks(topk, B, E)


def _count_blocks(topk: np.ndarray, block_size: int, num_experts: int) -> BlockRows:
    """:func:`block_rows` on validated (T, S, k) int ids: one flat index per selection."""
    T, S, _ = topk.shape
    num_full = T // block_size
    block_of = (np.arange(T, dtype=np.int64) // block_size)[:, None, None]  # tail -> num_full
    flat = (block_of * S + np.arange(S, dtype=np.int64)[None, :, None]) * num_experts + topk
    counts = np.bincount(flat.ravel(), minlength=(num_full + 1) * S * num_experts)
    counts = counts.astype(np.int32).reshape(num_full + 1, S, num_experts)
    return BlockRows(rows=counts[:num_full], tail=counts[num_full])


class SignatureCache:
    """LRU cache of per-block expert-count rows, keyed by :data:`~eldr.cache.hashing.BlockHash`.

    ``num_blocks`` rows of shape ``(|S|, E)`` are preallocated (use the engine's number of
    KV blocks to mirror its cache); ``layers`` is the routing artifact's layer mask (sorted,
    e.g. ``SignatureEncoder.layers_``) or ``None`` for all ``num_layers`` layers. Inserting
    into a full cache evicts the least-recently-used row; an engine that evicts KV blocks
    itself calls :meth:`evict` to stay in lock-step. Nothing here is thread-safe.

    LRU order: :meth:`lookup` and :meth:`request_counts` touch a request's blocks tail
    first, so the chain's FIRST block ends most recent and capacity eviction drops the
    tails of chains before their prefixes (a block is useless once its parent is gone).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_experts: int,
        layers: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        self.num_blocks = _positive_int(num_blocks, "num_blocks")
        self.block_size = _positive_int(block_size, "block_size")
        self.num_layers = _positive_int(num_layers, "num_layers")
        self.num_experts = _positive_int(num_experts, "num_experts")
        if layers is None:
            self.layers = np.arange(self.num_layers, dtype=np.int64)
        else:
            self.layers = _check_layers(layers, self.num_layers)
            if (np.diff(self.layers) <= 0).any():
                raise ValueError(f"layers must be sorted, got {self.layers.tolist()}")
        self.dtype = counts_dtype(self.block_size)
        # (num_blocks, S, E): all rows, one allocation; a slot is free or holds one block.
        self._rows = np.zeros((self.num_blocks, self.layers.size, self.num_experts), self.dtype)
        # hash -> slot, least recently used first: the index and the LRU list in one.
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() -> slot 0

    # -- sizes ---------------------------------------------------------------------------
    @property
    def row_shape(self) -> tuple[int, int]:
        """``(|S|, E)``: the shape of one row and of :meth:`request_counts`' result."""
        return (int(self.layers.size), self.num_experts)

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated rows (the host-side hash index is not counted)."""
        return int(self._rows.nbytes)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def kv_fraction(self, kv_bytes_per_token: float) -> float:
        """:attr:`nbytes` / KV bytes of ``num_blocks`` blocks of ``block_size`` tokens."""
        return kv_fraction(self.layers.size, self.num_experts, self.block_size,
                           kv_bytes_per_token)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slots

    def lru_order(self) -> list[BlockHash]:
        """Cached hashes, least recently used (next to be evicted) first."""
        return list(self._slots)

    def row(self, block_hash: BlockHash) -> np.ndarray | None:
        """A copy of a cached row as (|S|, E) int32, or ``None``. Does not touch LRU order."""
        slot = self._slots.get(block_hash)
        return None if slot is None else self._rows[slot].astype(np.int32)

    # -- operations ----------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """Number of LEADING ``block_hashes`` that are cached; touches those (tail first)."""
        slots = self._slots
        num_hit = 0
        for h in block_hashes:
            if h not in slots:
                break
            num_hit += 1
        for i in range(num_hit - 1, -1, -1):
            slots.move_to_end(block_hashes[i])
        return num_hit

    def insert(self, block_hash: BlockHash, row: np.ndarray) -> None:
        """Store the counts of one full block (replacing any row it had), most recent.

        ``row``: (|S|, E) integer counts, or (L, E) for all layers (the mask is applied);
        every count must lie in [0, block_size].
        """
        _check_hash(block_hash)
        row = np.asarray(row)
        if row.shape == (self.num_layers, self.num_experts) and row.shape != self.row_shape:
            row = row[self.layers]
        self._store([block_hash], self._check_rows(row[None], "row"))

    def evict(self, block_hash: BlockHash) -> bool:
        """Drop one block's row (the engine evicted its KV block). True if it was cached."""
        slot = self._slots.pop(block_hash, None)
        if slot is None:
            return False
        self._free.append(slot)
        return True

    def clear(self) -> None:
        """Drop every row (e.g. the engine reset its prefix cache)."""
        self._slots.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def cached_counts(self, block_hashes: Sequence[BlockHash]) -> np.ndarray:
        """(|S|, E) int32 sum of the rows of ``block_hashes``; every one must be cached."""
        slots = np.empty(len(block_hashes), dtype=np.intp)
        for i, h in enumerate(block_hashes):
            slot = self._slots.get(h)
            if slot is None:
                raise ValueError(
                    f"block {i} ({bytes(h).hex()[:16]}...) is not in the signature cache "
                    "(evicted since lookup?)"
                )
            slots[i] = slot
        if slots.size == 0:
            return np.zeros(self.row_shape, dtype=np.int32)
        # int16 accumulation is exact while Σ <= 32767 and halves the memory traffic.
        acc = np.int16 if slots.size * self.block_size <= np.iinfo(np.int16).max else np.int32
        total = np.add.reduce(np.take(self._rows, slots, axis=0), axis=0, dtype=acc)
        return total.astype(np.int32, copy=False)

    def request_counts(
        self,
        block_hashes: Sequence[BlockHash],
        fresh_topk: np.ndarray,
        *,
        num_cached_tokens: int,
    ) -> np.ndarray:
        """Exact (|S|, E) int32 counts of one prompt; caches its freshly computed blocks.

        ``block_hashes``: the hashes of ALL full blocks of the prompt
        (:func:`~eldr.cache.hashing.block_hashes`). ``num_cached_tokens``: prompt tokens whose
        prefill was skipped (a multiple of ``block_size``; usually ``lookup(...) *
        block_size``, or the engine's own count) — their blocks must be cached. ``fresh_topk``:
        (T_new, L, k) expert ids (all L layers) of the tokens actually computed, the prompt's
        tokens ``num_cached_tokens ..``; so the prompt has ``num_cached_tokens + T_new``
        tokens and ``len(block_hashes) == (num_cached_tokens + T_new) // block_size``.

        Cached rows are read before anything is inserted, so the result stays exact even
        when inserting the fresh blocks evicts the request's own prefix (tiny caches).
        """
        B = self.block_size
        if isinstance(num_cached_tokens, bool) or not isinstance(
            num_cached_tokens, (int, np.integer)
        ):
            raise ValueError(f"num_cached_tokens must be an integer, got {num_cached_tokens!r}")
        if num_cached_tokens < 0 or num_cached_tokens % B:
            raise ValueError(
                f"num_cached_tokens={num_cached_tokens} must be a non-negative multiple of "
                f"block_size={B}"
            )
        topk = _check_topk(fresh_topk, self.num_experts)
        if topk.shape[1] != self.num_layers:
            raise ValueError(
                f"fresh_topk has {topk.shape[1]} layers, expected all "
                f"num_layers={self.num_layers} (the layer mask is applied here)"
            )
        if self.layers.size != self.num_layers:
            topk = topk[:, self.layers, :]
        fresh = _count_blocks(topk, B, self.num_experts)
        num_cached = int(num_cached_tokens) // B
        num_tokens = int(num_cached_tokens) + topk.shape[0]
        if len(block_hashes) != num_tokens // B:
            raise ValueError(
                f"got {len(block_hashes)} block hashes for a prompt of {num_tokens} tokens "
                f"({num_tokens // B} full blocks of {B})"
            )
        rows = self._check_rows(fresh.rows, "fresh_topk block")
        total = self.cached_counts(block_hashes[:num_cached])  # before any insertion
        total += rows.sum(axis=0, dtype=np.int32) + fresh.tail
        self._store(block_hashes[num_cached:], rows)
        for i in range(num_cached - 1, -1, -1):  # then the prefix, root last = most recent
            if block_hashes[i] in self._slots:
                self._slots.move_to_end(block_hashes[i])
        return total

    # -- internals -----------------------------------------------------------------------
    def _check_rows(self, rows: np.ndarray, what: str) -> np.ndarray:
        """(n, S, E) integer counts in [0, block_size], as this cache's dtype."""
        if rows.ndim != 3 or rows.shape[1:] != self.row_shape:
            raise ValueError(f"{what}: shape {rows.shape[1:]}, expected {self.row_shape}")
        if rows.dtype == bool or not np.issubdtype(rows.dtype, np.integer):
            raise ValueError(f"{what}: counts must be integers, got dtype {rows.dtype}")
        if rows.size and (rows.min() < 0 or rows.max() > self.block_size):
            raise ValueError(
                f"{what}: counts must lie in [0, block_size={self.block_size}], got "
                f"[{rows.min()}, {rows.max()}] (does a token select one expert twice?)"
            )
        return rows.astype(self.dtype, copy=False)

    def _store(self, block_hashes: Sequence[BlockHash], rows: np.ndarray) -> None:
        """Insert rows[i] under block_hashes[i], tail first (so the first ends most recent)."""
        slot_row: dict[int, int] = {}  # slot -> row index; a slot reused later is overwritten
        for i in range(len(block_hashes) - 1, -1, -1):
            h = block_hashes[i]
            slot = self._slots.get(h)
            if slot is not None:
                self._slots.move_to_end(h)
            else:
                if self._free:
                    slot = self._free.pop()
                else:
                    _, slot = self._slots.popitem(last=False)
                self._slots[h] = slot
            slot_row[slot] = i
        if slot_row:
            slots = np.fromiter(slot_row.keys(), dtype=np.intp, count=len(slot_row))
            index = np.fromiter(slot_row.values(), dtype=np.intp, count=len(slot_row))
            self._rows[slots] = rows[index]


# -- validation ------------------------------------------------------------------------------
def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_hash(block_hash: object) -> None:
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_NBYTES:
        raise ValueError(
            f"block_hash must be a {HASH_NBYTES}-byte BlockHash, got {type(block_hash).__name__}"
        )


def _check_layers(layers: Sequence[int] | np.ndarray, num_layers: int) -> np.ndarray:
    arr = np.asarray(layers)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"layers must be a non-empty 1-D list of layer indices, got {layers!r}")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"layers must be integer layer indices, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= num_layers:
        raise ValueError(f"layers {arr.tolist()} out of range [0, {num_layers})")
    if np.unique(arr).size != arr.size:
        raise ValueError(f"layers {arr.tolist()} contain a duplicate")
    return arr.astype(np.int64)


def _check_topk(topk: np.ndarray, num_experts: int) -> np.ndarray:
    if not isinstance(topk, np.ndarray) or topk.ndim != 3:
        raise ValueError(
            f"topk must be a (T, L, k) numpy array, got shape {getattr(topk, 'shape', None)}"
        )
    if topk.dtype == bool or not np.issubdtype(topk.dtype, np.integer):
        raise ValueError(f"topk must hold integer expert ids, got dtype {topk.dtype}")
    if topk.size and (topk.min() < 0 or topk.max() >= num_experts):
        raise ValueError(
            f"topk expert ids must lie in [0, {num_experts}), got [{topk.min()}, {topk.max()}]"
        )
    return topk.astype(np.int64, copy=False)
