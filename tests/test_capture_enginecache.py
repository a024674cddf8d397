"""The engine's signature cache: block rows from chunks, slots tagged by hash, and the
hooks on vLLM's own BlockPool (the real class, when vLLM is importable)."""

import numpy as np
import pytest

from eldr.capture.enginecache import (
    POOL_HOOKS,
    BlockCarry,
    BlockRowCache,
    PrefillStep,
    chunk_rows,
    pool_cache,
    store_rows,
)
from eldr.capture.payload import topk_to_counts

E, BS = 5, 4


def _ids(n, seed=0, L=2, k=2):
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(n)])


def _ref_rows(ids, start=0):
    """Hand reference: each full block of positions [start, start+T) counted alone."""
    out = {}
    for b in range(start // BS, (start + len(ids)) // BS):
        lo, hi = b * BS - start, (b + 1) * BS - start
        if lo >= 0:
            out[b] = topk_to_counts(ids[lo:hi], E)
    return out


def test_chunk_rows_from_block_boundary():
    ids = _ids(10)
    cut = chunk_rows(ids, start=0, block_size=BS, num_experts=E)
    np.testing.assert_array_equal(cut.counts, topk_to_counts(ids, E))
    assert cut.first_block == 0 and cut.rows.dtype == np.int8 and len(cut.rows) == 2
    ref = _ref_rows(ids)
    for j, row in enumerate(cut.rows):
        np.testing.assert_array_equal(row, ref[j])
    assert cut.carry.block == 2 and cut.carry.num_tokens == 2
    np.testing.assert_array_equal(cut.carry.row, topk_to_counts(ids[8:], E))


@pytest.mark.parametrize("splits", [(3, 5, 10, 13), (4, 8, 13), (1, 2, 3, 11, 13), (13,)])
def test_chunked_prefill_gives_the_rows_of_one_pass(splits):
    ids = _ids(13, seed=1)
    rows, carry, start, counts = {}, None, 0, 0
    for end in splits:
        cut = chunk_rows(ids[start:end], start=start, block_size=BS, num_experts=E,
                         carry=carry)
        for j, row in enumerate(cut.rows):
            rows[cut.first_block + j] = row
        carry, start, counts = cut.carry, end, counts + cut.counts
    ref = _ref_rows(ids)
    assert sorted(rows) == sorted(ref) == [0, 1, 2]
    for b in ref:
        np.testing.assert_array_equal(rows[b], ref[b])
    np.testing.assert_array_equal(counts, topk_to_counts(ids, E))


def test_a_hit_ending_inside_a_block_gives_that_block_no_row():
    ids = _ids(7, seed=2)
    cut = chunk_rows(ids, start=6, block_size=BS, num_experts=E)  # positions 6..12
    assert cut.first_block == 2 and len(cut.rows) == 1  # block 1 lacks positions 4, 5
    np.testing.assert_array_equal(cut.rows[0], topk_to_counts(ids[2:6], E))
    # a carry for another block, or with the wrong token count, is not trusted
    wrong = BlockCarry(1, 1, np.ones((2, E), np.int32))
    assert chunk_rows(ids[:1], start=6, block_size=BS, num_experts=E, carry=wrong).carry is None


def test_prefill_step_merge_keeps_the_first_hit():
    a = PrefillStep(np.ones((1, 2), np.int32), 3, 4, ((1, "r1"),))
    b = PrefillStep(np.ones((1, 2), np.int32), 2, None, ((2, "r2"),))
    m = a.merge(b)
    assert m.num_tokens == 5 and m.hit_tokens == 4 and m.blocks == ((1, "r1"), (2, "r2"))
    np.testing.assert_array_equal(m.counts, [[2, 2]])


def test_row_cache_serves_only_rows_tagged_with_the_blocks_hash():
    cache = BlockRowCache(6, 2, E, BS)
    assert cache.rows_.dtype == np.int8 and cache.nbytes == 6 * 2 * E + 6 * 8
    rows = np.arange(2 * 2 * E, dtype=np.int8).reshape(2, 2, E)
    cache.store([4, 1], [b"x", b"y"], rows)
    assert len(cache) == 2
    total, found = cache.cached_counts([4, 1], [b"x", b"y"])
    assert found == 2 and total.dtype == np.int32
    np.testing.assert_array_equal(total, rows.sum(0))
    total, found = cache.cached_counts([4, 1], [b"x", b"other content"])  # slot reused
    assert found == 1
    np.testing.assert_array_equal(total, rows[0])
    cache.evict(4)
    assert cache.cached_counts([4], [b"x"])[1] == 0 and cache.take(4) is None
    assert cache.take(1)[0] == b"y"
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="rows of shape"):
        cache.store([0], [b"z"], np.zeros((1, 3, E), np.int8))
    with pytest.raises(ValueError, match="num_blocks"):
        BlockRowCache(0, 2, E, BS)
    assert BlockRowCache(1, 1, 1, 128).rows_.dtype == np.int16


# -- the real vLLM BlockPool ----------------------------------------------------------------
@pytest.fixture()
def pool():
    """A real vLLM BlockPool (prefix caching on) with the plugin's hooks and a row cache."""
    try:
        from vllm.v1.core.block_pool import BlockPool
    except Exception as exc:  # not installed, or a broken torchvision next to CPU torch
        pytest.skip(f"vllm is not importable: {exc}")

    class HookedPool(BlockPool):  # hooks on a subclass: the real class stays untouched
        pass

    for name, wrapper in POOL_HOOKS.items():
        setattr(HookedPool, name, wrapper(getattr(BlockPool, name)))
    p = HookedPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=BS)
    p._eldr_rows = BlockRowCache(5, 1, E, BS)
    return p


def _cache_blocks(pool, blocks, hashes):
    from types import SimpleNamespace

    request = SimpleNamespace(block_hashes=hashes, request_id="r", lora_request=None)
    pool.cache_full_blocks(request, blocks, 0, len(blocks), BS, 0)


def test_rows_leave_with_blocks_evicted_by_the_real_block_pool(pool):
    cache = pool_cache(pool)
    blocks = pool.get_new_blocks(2)
    _cache_blocks(pool, blocks, [b"h0" * 16, b"h1" * 16])
    assert all(b.block_hash is not None for b in blocks)
    rows = np.ones((2, 1, E), np.int8)
    store_rows(cache, blocks, ((0, rows),))
    assert len(cache) == 2
    ids, tags = [b.block_id for b in blocks], [b.block_hash for b in blocks]
    assert cache.cached_counts(ids, tags)[1] == 2
    pool.free_blocks(reversed(blocks))  # freed, still cached: rows stay
    assert len(cache) == 2 and cache.cached_counts(ids, tags)[1] == 2
    new = pool.get_new_blocks(4)  # takes every free block: both cached ones are evicted
    assert {b.block_id for b in new} >= set(ids)
    assert len(cache) == 0 and cache.cached_counts(ids, tags)[1] == 0


def test_connector_invalidation_and_reset_drop_rows(pool):
    cache = pool_cache(pool)
    blocks = pool.get_new_blocks(2)
    _cache_blocks(pool, blocks, [b"a" * 32, b"b" * 32])
    store_rows(cache, blocks, ((0, np.ones((2, 1, E), np.int8)),))
    pool.evict_blocks({blocks[0].block_id})  # a KV connector reports the block invalid
    assert cache.take(blocks[0].block_id) is None and cache.take(blocks[1].block_id)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert len(cache) == 0


def test_store_skips_blocks_vllm_did_not_cache(pool):
    cache = pool_cache(pool)
    blocks = pool.get_new_blocks(2)  # never cached: no hash
    store_rows(cache, blocks, ((0, np.ones((2, 1, E), np.int8)),))
    assert len(cache) == 0
