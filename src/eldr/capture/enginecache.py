"""The prefill engine's signature cache: per-block expert counts co-indexed with its KV.

With prefix caching, vLLM serves the leading full blocks of a prompt from its KV cache and
runs the model on the rest only, so the counts the plugin sees cover the tail. This module
keeps, inside the engine, one row of counts per computed KV block, so the payload can add
the rows of the blocks a request reused and stay the exact full-prompt count:

    counts = Σ rows of its reused (prefix-hit) blocks + counts of the tokens it computed

Two halves, one per vLLM process (the plugin, :mod:`eldr.capture.vllm_plugin`, wires them):

- worker (model runner): :func:`chunk_rows` turns one prefill chunk's (T, L, k) top-k ids
  into the chunk's (L, E) counts and the (B, L, E) rows of the KV blocks it completed,
  carrying a block split across chunks in a :class:`BlockCarry`. Rows ship to the engine
  core with the step's output. A row is ``L * E`` bytes (int8 for blocks up to 127
  tokens): smaller than the block's ``block_size * L * k`` ids whenever E < block_size·k,
  and it spares the scheduler process, which is on every request's critical path, the
  counting.
- engine core (scheduler): :class:`BlockRowCache` holds the rows in one preallocated
  ``(num_blocks, L, E)`` array indexed by vLLM's own block id, each slot tagged with the
  block hash (vLLM's ``BlockHashWithGroupId``) it was computed for. The plugin hooks the
  block pool: when vLLM drops a block's hash (eviction on reuse, a connector's
  invalidation, a prefix-cache reset) the slot is emptied with it. A reused block's row
  is read only if its slot's tag equals the block's current hash, so a row is never served
  for other content, even if a hook were missed.

Memory: ``num_blocks * L * E`` bytes plus one pointer per block, a fixed fraction of the
KV cache of the same blocks (:func:`eldr.cache.sigcache.kv_fraction`; docs/capture.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from eldr.cache.sigcache import counts_dtype

__all__ = ["POOL_HOOKS", "BlockCarry", "BlockRowCache", "ChunkRows", "PrefillStep", "chunk_rows",
           "pool_cache", "store_rows"]


class PrefillStep(NamedTuple):
    """One request's prefill work in one engine step, worker → engine core (pickled)."""

    counts: np.ndarray  # (L, E) int32 counts of the prompt tokens computed in the step
    num_tokens: int  # those tokens
    # on a request's first chunk (new or resumed after preemption): prompt tokens before
    # it that the engine did not compute (prefix-cache hit or KV-connector load); else None
    hit_tokens: int | None
    blocks: tuple  # ((first_block, rows (B, L, E)), ...): KV blocks the step completed

    def merge(self, later: PrefillStep) -> PrefillStep:
        """This step followed by ``later`` of the same request (``later`` not a restart)."""
        return PrefillStep(self.counts + later.counts, self.num_tokens + later.num_tokens,
                           self.hit_tokens, self.blocks + later.blocks)


class BlockCarry(NamedTuple):
    """Counts of a block a chunk began but did not finish (the next chunk completes it)."""

    block: int  # index of the block within the request
    num_tokens: int  # tokens of that block counted so far (from its first token)
    row: np.ndarray  # (L, E) int32 their counts


class ChunkRows(NamedTuple):
    """What one prefill chunk of one request adds (see :func:`chunk_rows`)."""

    counts: np.ndarray  # (L, E) int32 counts of the chunk's prompt tokens
    first_block: int  # request block index of rows[0]
    rows: np.ndarray  # (B, L, E) counts_dtype(block_size): blocks this chunk completed
    carry: BlockCarry | None  # the block left unfinished, for the next chunk


def chunk_rows(ids: np.ndarray, *, start: int, block_size: int, num_experts: int,
               carry: BlockCarry | None = None) -> ChunkRows:
    """Counts and completed-block rows of prompt positions ``[start, start + T)``.

    ``ids``: (T, L, k) integer expert ids of consecutive prompt tokens. A block is
    complete when all its ``block_size`` tokens were counted: in this chunk, or the first
    part in an earlier chunk (``carry``, which must name this chunk's first block and hold
    exactly its tokens before ``start``). A block whose leading tokens were not counted
    here (a prefix hit ending inside a block) never gets a row. One ``np.bincount``.
    """
    T, L, _ = ids.shape
    bs, E = block_size, num_experts
    off = start % bs
    b0 = start // bs
    num_spanned = (off + T + bs - 1) // bs
    if T == 0:
        return ChunkRows(np.zeros((L, E), np.int32), b0, np.zeros((0, L, E), counts_dtype(bs)),
                         carry)
    block_of = ((off + np.arange(T, dtype=np.int64)) // bs)[:, None, None]
    flat = (block_of * L + np.arange(L, dtype=np.int64)[None, :, None]) * E + ids
    per = np.bincount(flat.ravel(), minlength=num_spanned * L * E)
    per = per.reshape(num_spanned, L, E).astype(np.int32)
    counts = per.sum(axis=0, dtype=np.int32)
    first = 0  # first spanned block whose every token is counted
    if off:
        if carry is not None and carry.block == b0 and carry.num_tokens == off:
            per[0] += carry.row
        else:
            first = 1
    end = start + T
    last = num_spanned if end % bs == 0 else num_spanned - 1  # exclusive: complete blocks
    new_carry = None
    if end % bs and last >= first:  # the last block is unfinished but fully counted so far
        new_carry = BlockCarry(b0 + last, end - (b0 + last) * bs, per[last].copy())
    rows = per[first:last] if last > first else per[:0]
    return ChunkRows(counts, b0 + first, rows.astype(counts_dtype(bs)), new_carry)


class BlockRowCache:
    """Per-block count rows in slots indexed by KV block id, tagged with the block's hash.

    ``num_blocks`` is the engine's KV block count; ``block_size`` its tokens per block
    (sets the dtype: int8 up to 127). Not thread-safe: the engine core's scheduler loop is
    its one owner.
    """

    def __init__(self, num_blocks: int, num_layers: int, num_experts: int,
                 block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("num_layers", num_layers),
                            ("num_experts", num_experts), ("block_size", block_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.block_size = block_size
        self.rows_ = np.zeros((num_blocks, num_layers, num_experts), counts_dtype(block_size))
        self._tags: list[Hashable | None] = [None] * num_blocks  # None: slot empty

    @property
    def row_shape(self) -> tuple[int, int]:
        return self.rows_.shape[1], self.rows_.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the rows plus one 8-byte tag pointer per slot (the hashes are vLLM's)."""
        return int(self.rows_.nbytes) + 8 * len(self._tags)

    def __len__(self) -> int:
        """Slots holding a row."""
        return sum(tag is not None for tag in self._tags)

    def store(self, block_ids: Sequence[int], tags: Sequence[Hashable],
              rows: np.ndarray) -> None:
        """Put ``rows`` (B, L, E) into the slots of ``block_ids``, tagged ``tags`` (B each)."""
        if len(block_ids) != len(tags) or len(block_ids) != len(rows):
            raise ValueError(f"store: {len(block_ids)} block ids, {len(tags)} tags, "
                             f"{len(rows)} rows")
        if len(block_ids) == 0:
            return
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"store: rows of shape {rows.shape[1:]}, this cache holds "
                             f"{self.row_shape}")
        self.rows_[list(block_ids)] = rows
        for block_id, tag in zip(block_ids, tags, strict=True):
            self._tags[block_id] = tag

    def evict(self, block_id: int) -> None:
        """Empty a slot (vLLM dropped the block's hash)."""
        self._tags[block_id] = None

    def clear(self) -> None:
        self._tags = [None] * len(self._tags)

    def take(self, block_id: int) -> tuple[Hashable, np.ndarray] | None:
        """(tag, a copy of the row) of a slot, or None if empty."""
        tag = self._tags[block_id]
        return None if tag is None else (tag, self.rows_[block_id].copy())

    def cached_counts(self, block_ids: Sequence[int], tags: Sequence[Hashable]
                      ) -> tuple[np.ndarray, int]:
        """(Σ rows whose slot holds the given tag as (L, E) int32, number of such blocks).

        Blocks whose slot is empty or tagged for other content are left out (the caller
        then knows its counts are partial: found < len(block_ids)).
        """
        found = [b for b, tag in zip(block_ids, tags, strict=True)
                 if tag is not None and self._tags[b] == tag]
        total = (self.rows_[found].sum(axis=0, dtype=np.int32) if found
                 else np.zeros(self.row_shape, np.int32))
        return total, len(found)


# -- vLLM's BlockPool, the engine core's KV blocks ---------------------------------------------
# The pool keeps the cache in ``pool._eldr_rows`` (a BlockRowCache; False: disabled).
def pool_cache(pool) -> BlockRowCache | None:
    """The row cache attached to a vLLM ``BlockPool``, or None."""
    cache = pool.__dict__.get("_eldr_rows")
    return cache if isinstance(cache, BlockRowCache) else None


def store_rows(cache: BlockRowCache, blocks: list, segments: tuple) -> None:
    """Put a step's ``(first_block, rows)`` segments into the slots of the request's
    ``blocks`` (vLLM ``KVCacheBlock`` objects) that vLLM cached, tagged with their hashes."""
    for first, rows in segments:
        keep, ids, tags = [], [], []
        for j in range(len(rows)):
            if first + j >= len(blocks):
                break
            blk = blocks[first + j]
            if blk.block_hash is not None and not blk.is_null:  # cached by vLLM
                keep.append(j)
                ids.append(blk.block_id)
                tags.append(blk.block_hash)
        if keep:
            cache.store(ids, tags, rows[keep])


def wrap_remove_hashes(original):
    def _remove_cached_block_hashes(self, block):
        removed = original(self, block)
        cache = pool_cache(self)
        if cache is not None:  # vLLM dropped the block's hash: its row goes with it
            cache.evict(block.block_id)
        return removed
    return _remove_cached_block_hashes


def wrap_move_hashes(original):
    def move_block_hashes(self, src_block, dst_block):
        cache = pool_cache(self)
        kept = cache.take(src_block.block_id) if cache is not None else None
        result = original(self, src_block, dst_block)
        if kept is not None and dst_block.block_hash == kept[0]:
            cache.store([dst_block.block_id], [kept[0]], kept[1][None])
        return result
    return move_block_hashes


def wrap_reset_prefix_cache(original):
    def reset_prefix_cache(self, *args, **kwargs):
        done = original(self, *args, **kwargs)
        cache = pool_cache(self)
        if done and cache is not None:
            cache.clear()
        return done
    return reset_prefix_cache


# BlockPool method -> wrapper: every place vLLM drops a block's hashes goes through
# ``_remove_cached_block_hashes`` (reuse of a free block, connector invalidation, promotion).
POOL_HOOKS = {"_remove_cached_block_hashes": wrap_remove_hashes,
              "move_block_hashes": wrap_move_hashes,
              "reset_prefix_cache": wrap_reset_prefix_cache}
