"""TokenBank: n_out rows per request, from decode_topk or dealt from counts, seeded."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from conftest import make_trace
from eldr.sim import TokenBank, topk_bitsets


def test_rows_from_decode_topk_with_step0_reusing_token0():
    tr = make_trace(12, 48, 128, 8, seed=1, with_topk=True)
    bank = TokenBank(tr)
    off = tr.decode_offsets
    for r in range(tr.num_requests):
        rows = bank.decode(r)
        assert rows.shape == (tr.output_lens[r], 48, 2)
        if tr.output_lens[r] > 1:
            bits = topk_bitsets(tr.decode_topk[off[r]:off[r + 1]], 128)
            np.testing.assert_array_equal(rows[1:], bits)
            np.testing.assert_array_equal(rows[0], bits[0])
        else:
            assert not rows.any()


def test_dealt_rows_match_counts_and_are_seeded():
    tr = make_trace(12, 48, 128, 8, seed=1, with_topk=False)
    a, b, c = TokenBank(tr, seed=3), TokenBank(tr, seed=3), TokenBank(tr, seed=4)
    r = int(np.argmax(tr.output_lens))
    rows = a.decode(r)
    counts = np.unpackbits(rows[1:].view(np.uint8), axis=2, bitorder="little").sum(axis=0)
    np.testing.assert_array_equal(counts, tr.decode_counts[r])
    np.testing.assert_array_equal(rows, b.decode(r))
    assert not np.array_equal(rows, c.decode(r))
    assert a.decode(r) is rows  # cached


def test_cache_budget_is_respected():
    tr = make_trace(12, 48, 128, 8, seed=1, with_topk=False)
    bank = TokenBank(tr, max_bytes=0)
    first = bank.decode(0)
    assert bank.decode(0) is not first and np.array_equal(bank.decode(0), first)


def test_prefill_bitsets_mark_selected_experts():
    tr = make_trace(5, 48, 128, 8, seed=2)
    bank = TokenBank(tr)
    unpacked = np.unpackbits(bank.prefill.view(np.uint8), axis=2, bitorder="little")
    np.testing.assert_array_equal(unpacked.astype(bool), tr.prefill_counts > 0)


def test_cache_is_lru_within_its_budget():
    tr = make_trace(12, 48, 128, 8, seed=1, with_topk=False)
    size = [TokenBank(tr).decode(r).nbytes for r in range(3)]
    bank = TokenBank(tr, max_bytes=size[0] + size[1] + size[2] - 1)
    a = bank.decode(0)
    bank.decode(1)
    assert bank.decode(0) is a  # a hit makes 0 the most recent
    bank.decode(2)  # over budget: 1, the least recent, leaves
    assert bank.decode(0) is a and 1 not in bank._cache and bank._bytes <= bank.max_bytes


@pytest.mark.parametrize("to_file", [False, True])
def test_slab_serves_the_same_rows_and_pickles_without_the_cache(tmp_path, to_file):
    tr = make_trace(12, 48, 128, 8, seed=1, with_topk=False)
    lazy, built = TokenBank(tr, seed=3), TokenBank(tr, seed=3)
    lazy.decode(0)
    slab = built.build_all(tmp_path / "rows.npy" if to_file else None)
    assert built.is_built and slab.nbytes == built.nbytes_all
    assert isinstance(slab.base, np.memmap) == to_file
    for r in range(tr.num_requests):
        np.testing.assert_array_equal(built.decode(r), lazy.decode(r))
    again = pickle.loads(pickle.dumps(lazy))
    assert len(again._cache) == 0 and np.array_equal(again.decode(0), lazy.decode(0))


def test_flat_rows_fill_request_by_request_and_match_decode():
    tr = make_trace(12, 48, 128, 8, seed=1, with_topk=False)
    ref, bank = TokenBank(tr, seed=3), TokenBank(tr, seed=3)
    flat = bank.flat_rows()
    assert flat.shape == (int(tr.output_lens.sum()), 48 * 2) and not bank.is_built
    for r in (5, 0, 5, 11):  # any order; a second call finds the rows already there
        a = bank.row_start(r)
        rows = flat[a:a + int(tr.output_lens[r])].reshape(-1, 48, 2)
        np.testing.assert_array_equal(rows, ref.decode(r))
        np.testing.assert_array_equal(bank.decode(r), ref.decode(r))
    again = pickle.loads(pickle.dumps(bank))  # a partly filled slab is not carried
    assert again._slab is None and np.array_equal(again.decode(5), ref.decode(5))


def test_flat_rows_respect_the_budget():
    tr = make_trace(12, 48, 128, 8, seed=1, with_topk=False)
    assert TokenBank(tr, max_bytes=TokenBank(tr).nbytes_all - 1).flat_rows() is None


def test_simulation_is_the_same_from_the_slab_and_from_the_cache():
    from eldr.routing import make_policy
    from eldr.sim import SimConfig, simulate

    tr = make_trace(40, 48, 128, 8, seed=2, with_topk=False)
    cfg = SimConfig(num_prefill=2, num_decode=3, qps=40.0, warmup_s=0.5, duration_s=2.0)
    out = []
    for bank in (TokenBank(tr), TokenBank(tr, max_bytes=0)):  # slab; LRU cache (no slab)
        res = simulate(tr, cfg, make_policy("jsq", num_workers=3), tokens=bank)
        out.append((res.requests["t_last"], res.decoder_distinct_sum, res.total_steps))
        assert (bank.flat_rows() is None) == (bank.max_bytes == 0)
    for a, b in zip(*out, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_slab_built_elsewhere_is_mapped_not_rebuilt(tmp_path):
    """map_built serves the rows build_all wrote (e.g. in a worker process), and refuses a
    file of another bank's shape."""
    trace = make_trace(30, 48, 128, 8, seed=2, with_topk=False)
    path = tmp_path / "slab.npy"
    TokenBank(trace, seed=3).build_all(path)
    bank = TokenBank(trace, seed=3)
    mapped = bank.map_built(path)
    assert bank.is_built and not mapped.flags.writeable
    for r in (0, 7, 29):
        np.testing.assert_array_equal(bank.decode(r), TokenBank(trace, seed=3).decode(r))
    other = make_trace(31, 48, 128, 8, seed=2, with_topk=False)
    with pytest.raises(ValueError, match="slab of"):
        TokenBank(other, seed=3).map_built(path)
