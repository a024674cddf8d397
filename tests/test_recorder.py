"""eldr.traces.recorder: the synthetic token path records every token's top-k and returns
per-segment counts that agree with what it recorded, across chunk boundaries."""

import numpy as np
import pytest

from eldr.traces import recorder as rec_mod
from eldr.traces.recorder import TokenRecorder

E, K, L = 8, 2, 2


@pytest.fixture(params=[65_536, 3])  # one chunk, and chunks that cut through segments
def chunk(request, monkeypatch):
    monkeypatch.setattr(rec_mod, "_TOKEN_CHUNK", request.param)
    return request.param


def test_prefill_counts_match_the_recorded_ids(chunk):
    seg_lens = np.array([4, 0, 3, 5, 1])  # an empty segment among them
    rec = TokenRecorder(seg_lens, np.array([2, 2]), L, K)
    rng = np.random.default_rng(0)
    z = rng.normal(size=(seg_lens.size, E))
    cnt, prob, logit = rec.route_prefill(rng, 1, z, E, gate_scale=1.0)
    off = rec.seg_off
    for s in range(seg_lens.size):
        ids = rec.seg_topk[off[s]:off[s + 1], 1]
        assert np.array_equal(cnt[s], np.bincount(ids.ravel(), minlength=E))
        assert np.isclose(prob[s].sum(), seg_lens[s], atol=1e-4)  # softmax rows sum to 1
    assert cnt.sum() == seg_lens.sum() * K and not rec.seg_topk[:, 0].any()  # layer 1 only
    assert (logit[1] == 0).all()  # the empty segment has no gate sums


def test_decode_stickiness_one_repeats_each_requests_first_choice(chunk):
    dec_lens = np.array([3, 0, 4])
    rec = TokenRecorder(np.array([1]), dec_lens, L, K)
    rng = np.random.default_rng(1)
    cnt = rec.route_decode(rng, 0, rng.normal(size=(3, E)), E, stickiness=1.0)
    off = rec.dec_off
    for r in range(3):
        rows = rec.decode_topk[off[r]:off[r + 1], 0]
        assert (rows == rows[:1]).all()  # every token reuses the request's first top-k
        assert np.array_equal(cnt[r], np.bincount(rows.ravel(), minlength=E))
    assert cnt[1].sum() == 0


def test_prefill_topk_puts_the_shared_prefix_first():
    rec = TokenRecorder(np.array([2, 3, 1, 4]), np.array([1, 1]), L, K)  # Q=2 prefixes
    rec.seg_topk[:] = np.arange(10, dtype=np.int16)[:, None, None]  # row id as content
    out = rec.prefill_topk(np.array([1, -1]), Q=2)
    # request 0: prefix segment 1 (rows 2-4), then its own segment 2 (row 5);
    # request 1: no prefix, its own segment 3 (rows 6-9)
    assert out[:, 0, 0].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
