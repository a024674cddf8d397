import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.cache.hashing import block_hashes, hash_block_tokens
from eldr.cache.sigcache import (
    SignatureCache,
    block_rows,
    counts_dtype,
    kv_fraction,
    signature_bytes_per_block,
)


def fake_topk(tokens, num_layers, num_experts, top_k):
    """(T, L, k) distinct expert ids that depend on the whole prefix, like a causal model."""
    h, acc = np.zeros(len(tokens), np.int64), 0
    for t, tok in enumerate(tokens):
        acc = (acc * 1_000_003 + int(tok) + 1) % 2_147_483_647
        h[t] = acc
    layer_salt = (np.arange(num_layers, dtype=np.int64) + 1) * 7919
    base = (h[:, None] ^ layer_salt[None, :]) % num_experts
    return ((base[:, :, None] + np.arange(top_k)) % num_experts).astype(np.int16)


def scratch_counts(topk, layers, num_experts):
    """Counts of a whole prompt recomputed from scratch with np.add.at (no blocks)."""
    out = np.zeros((len(layers), num_experts), np.int32)
    sel = topk[:, layers, :]
    layer_idx = np.broadcast_to(np.arange(len(layers))[None, :, None], sel.shape)
    np.add.at(out, (layer_idx.ravel(), sel.ravel()), 1)
    return out


def key(i):
    return hash_block_tokens(None, [i])


def row_of(value, shape=(2, 3)):
    return np.full(shape, value, np.int8)


# -- block_rows ---------------------------------------------------------------------------------
def test_block_rows_hand_computed():
    # T=5 tokens, block_size=2, L=2 layers, k=1, E=3.
    topk = np.array([[[0], [2]], [[0], [1]], [[1], [1]], [[2], [1]], [[0], [0]]])
    rows, tail = block_rows(topk, block_size=2, num_experts=3)
    assert rows.dtype == np.int32 and tail.dtype == np.int32
    np.testing.assert_array_equal(rows, [[[2, 0, 0], [0, 1, 1]], [[0, 1, 1], [0, 2, 0]]])
    np.testing.assert_array_equal(tail, [[1, 0, 0], [1, 0, 0]])
    rows, tail = block_rows(topk[:4], block_size=2, num_experts=3, layers=[1])
    np.testing.assert_array_equal(rows, [[[0, 1, 1]], [[0, 2, 0]]])
    np.testing.assert_array_equal(tail, [[0, 0, 0]])
    rows, tail = block_rows(topk[:1], block_size=2, num_experts=3)
    assert rows.shape == (0, 2, 3) and tail.sum() == 2


def test_block_rows_sums_to_scratch():
    topk = fake_topk(list(range(37)), 4, 16, 3)
    rows, tail = block_rows(topk, block_size=8, num_experts=16, layers=[0, 3])
    assert rows.shape == (4, 2, 16)
    np.testing.assert_array_equal(rows.sum(0) + tail, scratch_counts(topk, [0, 3], 16))
    assert (rows.sum(axis=2) == 8 * 3).all()  # k selections per token per layer


@pytest.mark.parametrize(
    ("topk", "kwargs", "match"),
    [
        (np.zeros((4, 2)), {}, r"\(T, L, k\)"),
        (np.zeros((4, 2, 1), np.float32), {}, "integer"),
        (np.full((4, 2, 1), 3), {}, r"\[0, 3\)"),
        (np.full((4, 2, 1), -1), {}, r"\[0, 3\)"),
        (np.zeros((4, 2, 1), int), {"layers": [2]}, "out of range"),
        (np.zeros((4, 2, 1), int), {"layers": [0, 0]}, "duplicate"),
        (np.zeros((4, 2, 1), int), {"block_size": 0}, "block_size"),
    ],
)
def test_block_rows_refuses_bad_input(topk, kwargs, match):
    kw = {"block_size": 2, "num_experts": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        block_rows(topk, **kw)


# -- cache basics -------------------------------------------------------------------------------
def test_dtype_and_memory_accounting():
    assert counts_dtype(16) == np.int8 and counts_dtype(127) == np.int8
    assert counts_dtype(128) == np.int16
    cache = SignatureCache(10, 16, 48, 128)
    assert cache.dtype == np.int8 and cache.nbytes == 10 * 48 * 128
    assert signature_bytes_per_block(48, 128, 16) == 6144
    # Qwen3-30B-A3B: 6 KiB of signature per 1.5 MiB of KV per block = 1/256.
    assert cache.kv_fraction(96 * 1024) == kv_fraction(48, 128, 16, 96 * 1024) == 1 / 256
    masked = SignatureCache(10, 16, 48, 128, layers=range(0, 48, 3))
    assert masked.row_shape == (16, 128) and masked.nbytes == 10 * 16 * 128
    assert SignatureCache(2, 200, 2, 4).nbytes == 2 * 2 * 4 * 2  # int16 rows
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        cache.kv_fraction(0)


def test_lookup_counts_leading_hits_and_touches_tail_first():
    cache = SignatureCache(8, 2, 2, 3)
    for i in range(5):
        cache.insert(key(i), row_of(i % 3))
    assert cache.lru_order() == [key(i) for i in range(5)]
    assert cache.lookup([key(1), key(2), key(9), key(3)]) == 2  # stops at the first miss
    assert cache.lru_order() == [key(0), key(3), key(4), key(2), key(1)]  # key(3) untouched
    assert cache.lookup([key(9), key(0)]) == 0
    assert cache.lookup([]) == 0
    assert cache.lru_order()[-1] == key(1)


def test_capacity_evicts_least_recently_used():
    cache = SignatureCache(3, 2, 2, 3)
    for i in range(3):
        cache.insert(key(i), row_of(i))
    assert cache.num_free_blocks == 0
    cache.lookup([key(0)])  # key(0) becomes most recent, key(1) least
    cache.insert(key(3), row_of(2))
    assert key(1) not in cache and len(cache) == 3
    assert cache.lru_order() == [key(2), key(0), key(3)]
    np.testing.assert_array_equal(cache.row(key(3)), row_of(2))  # reused slot overwritten
    np.testing.assert_array_equal(cache.row(key(0)), row_of(0))
    cache.insert(key(2), row_of(1))  # re-insert replaces the row and refreshes it
    assert cache.lru_order() == [key(0), key(3), key(2)]
    np.testing.assert_array_equal(cache.row(key(2)), row_of(1))


def test_evict_frees_the_slot():
    cache = SignatureCache(2, 2, 2, 3)
    cache.insert(key(0), row_of(1))
    cache.insert(key(1), row_of(2))
    assert cache.evict(key(0)) is True and cache.evict(key(0)) is False
    assert key(0) not in cache and cache.row(key(0)) is None and cache.num_free_blocks == 1
    cache.insert(key(2), row_of(0))
    assert key(1) in cache and len(cache) == 2  # the freed slot was used, nothing evicted
    cache.clear()
    assert len(cache) == 0 and cache.num_free_blocks == 2 and cache.lookup([key(1)]) == 0


def test_insert_full_layer_row_applies_the_mask():
    cache = SignatureCache(2, 4, 3, 2, layers=[0, 2])
    cache.insert(key(0), np.array([[1, 2], [3, 4], [0, 4]]))
    np.testing.assert_array_equal(cache.row(key(0)), [[1, 2], [0, 4]])
    cache.insert(key(1), np.array([[1, 2], [0, 4]]))
    np.testing.assert_array_equal(cache.row(key(1)), [[1, 2], [0, 4]])


def test_int16_rows_hold_large_blocks():
    cache = SignatureCache(2, 200, 1, 2)
    cache.insert(key(0), np.array([[200, 0]]))
    np.testing.assert_array_equal(cache.cached_counts([key(0), key(0)]), [[400, 0]])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c: c.insert(b"x", row_of(0)), "32-byte"),
        (lambda c: c.insert(key(0), np.zeros((3, 3), np.int8)), "shape"),
        (lambda c: c.insert(key(0), np.zeros((2, 3), np.float32)), "integers"),
        (lambda c: c.insert(key(0), row_of(3)), r"\[0, block_size=2\]"),
        (lambda c: c.insert(key(0), row_of(-1)), r"\[0, block_size=2\]"),
        (lambda c: c.cached_counts([key(5)]), "not in the signature cache"),
    ],
)
def test_cache_refuses_bad_input(call, match):
    cache = SignatureCache(2, 2, 2, 3)
    with pytest.raises(ValueError, match=match):
        call(cache)
    assert len(cache) == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 16, 2, 4), "num_blocks"),
        ((4, 0, 2, 4), "block_size"),
        ((4, 16, 2, 4.0), "num_experts"),
        ((4, 16, True, 4), "num_layers"),
        ((4, 40000, 2, 4), "too large"),
        ((4, 16, 2, 4, [2]), "out of range"),
        ((4, 16, 2, 4, [1, 0]), "sorted"),
        ((4, 16, 2, 4, []), "non-empty"),
        ((4, 16, 2, 4, [0.0]), "integer"),
    ],
)
def test_constructor_refuses_bad_config(args, match):
    with pytest.raises(ValueError, match=match):
        SignatureCache(*args)


# -- request_counts -----------------------------------------------------------------------------
def serve(cache, tokens, top_k=2, num_cached_tokens=None):
    """One request through the documented three-step path; returns (counts, full top-k)."""
    full = fake_topk(tokens, cache.num_layers, cache.num_experts, top_k)
    hashes = block_hashes(tokens, cache.block_size)
    hit = cache.lookup(hashes) * cache.block_size
    cached = hit if num_cached_tokens is None else num_cached_tokens
    return cache.request_counts(hashes, full[cached:], num_cached_tokens=cached), full


def test_request_counts_partial_hit_is_exact():
    cache = SignatureCache(16, 4, 3, 8, layers=[0, 2])
    shared = list(range(10))
    counts, full = serve(cache, [*shared, 50, 51])  # 3 full blocks + 0 tail
    np.testing.assert_array_equal(counts, scratch_counts(full, [0, 2], 8))
    assert len(cache) == 3
    b = [*shared, 60, 61, 62, 63, 64]  # shares 2 full blocks, 1 tail token
    hashes = block_hashes(b, 4)
    assert cache.lookup(hashes) == 2
    counts, full = serve(cache, b)
    np.testing.assert_array_equal(counts, scratch_counts(full, [0, 2], 8))
    assert len(cache) == 4  # one new full block; the tail was not cached


def test_request_larger_than_the_cache_stays_exact_and_keeps_its_prefix():
    cache = SignatureCache(2, 2, 2, 5)
    tokens = list(range(11))
    counts, full = serve(cache, tokens)
    np.testing.assert_array_equal(counts, scratch_counts(full, [0, 1], 5))
    hashes = block_hashes(tokens, 2)
    assert cache.lru_order() == [hashes[1], hashes[0]]  # the prefix survives, root newest
    counts, _ = serve(cache, tokens)  # 2 hits, 3 recomputed blocks
    np.testing.assert_array_equal(counts, scratch_counts(full, [0, 1], 5))


def test_request_counts_refuses_inconsistent_calls():
    cache = SignatureCache(8, 2, 2, 4)
    tokens = list(range(6))
    full = fake_topk(tokens, 2, 4, 2)
    hashes = block_hashes(tokens, 2)
    with pytest.raises(ValueError, match="not in the signature cache"):
        cache.request_counts(hashes, full[2:], num_cached_tokens=2)  # nothing cached yet
    with pytest.raises(ValueError, match="multiple of block_size"):
        cache.request_counts(hashes, full[1:], num_cached_tokens=1)
    with pytest.raises(ValueError, match="3 block hashes for a prompt of 5"):
        cache.request_counts(hashes, full[1:], num_cached_tokens=0)
    with pytest.raises(ValueError, match="expected all num_layers=2"):
        cache.request_counts(hashes, full[:, :1], num_cached_tokens=0)
    with pytest.raises(ValueError, match="integer"):
        cache.request_counts(hashes, full, num_cached_tokens=0.0)
    dup = full.copy()
    dup[:, :, 1] = dup[:, :, 0]  # a token selecting one expert twice: 4 > block_size
    with pytest.raises(ValueError, match="twice"):
        cache.request_counts(hashes, dup, num_cached_tokens=0)
    assert len(cache) == 0  # nothing was inserted by a refused call
    cache.request_counts(hashes, full, num_cached_tokens=0)
    cache.evict(hashes[0])  # the engine evicts between lookup and request_counts
    with pytest.raises(ValueError, match="block 0"):
        cache.request_counts(hashes, full[4:], num_cached_tokens=4)


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4))
    num_layers = draw(st.integers(1, 3))
    top_k = draw(st.integers(1, 3))
    num_experts = draw(st.integers(top_k, 7))
    layers = sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1)))
    capacity = draw(st.integers(1, 10))
    bases = draw(st.lists(st.lists(st.integers(0, 2), max_size=12), min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(1, 5))):
        base = draw(st.sampled_from(bases))
        cut = draw(st.integers(0, len(base)))
        prompts.append(base[:cut] + draw(st.lists(st.integers(0, 2), max_size=6)))
    op = st.one_of(
        st.tuples(st.just("request"), st.integers(0, len(prompts) - 1), st.integers(0, 9)),
        st.tuples(st.just("evict"), st.integers(0, 10**6), st.just(0)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
    )
    ops = draw(st.lists(op, min_size=1, max_size=14))
    return (block_size, num_layers, num_experts, top_k, layers, capacity, prompts, ops)


@settings(max_examples=80, deadline=None)
@given(workloads())
def test_cache_path_equals_scratch_under_hits_and_evictions(workload):
    block_size, num_layers, num_experts, top_k, layers, capacity, prompts, ops = workload
    cache = SignatureCache(capacity, block_size, num_layers, num_experts, layers=layers)
    truth_rows = {}  # block hash -> its (S, E) counts, from the prompt that contains it
    seen = []
    for kind, a, b in ops:
        if kind == "request":
            tokens = prompts[a]
            hashes = block_hashes(tokens, block_size)
            hit = cache.lookup(hashes)
            # The engine may reuse fewer blocks than the signature cache holds.
            used = hit if b < 6 else min(hit, b - 6)
            full = fake_topk(tokens, num_layers, num_experts, top_k)
            counts = cache.request_counts(
                hashes, full[used * block_size :], num_cached_tokens=used * block_size
            )
            np.testing.assert_array_equal(counts, scratch_counts(full, layers, num_experts))
            rows, _ = block_rows(full, block_size=block_size, num_experts=num_experts,
                                 layers=layers)
            truth_rows.update(zip(hashes, rows, strict=True))
            seen += hashes
            if len(hashes) <= capacity:
                assert all(h in cache for h in hashes)
        elif kind == "evict" and seen:
            h = seen[a % len(seen)]
            was_cached = h in cache
            assert cache.evict(h) is was_cached and h not in cache
        elif kind == "clear":
            cache.clear()
        assert len(cache) + cache.num_free_blocks == capacity
        for h in cache.lru_order():
            np.testing.assert_array_equal(cache.row(h), truth_rows[h])
