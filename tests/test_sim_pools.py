"""Prefill routing (prefix affinity, spill) and prefill batching with a prefix cache."""

from __future__ import annotations

import numpy as np

from conftest import make_trace
from eldr.sim import SimConfig
from eldr.sim.pools import DecodeWorker, PrefillRouter, PrefillWorker


def _trace_with_shared_prefix():
    tr = make_trace(6, 48, 128, 8, seed=0)
    # give requests 0..3 the same first block (block_size 4): same affinity key
    ids = tr.prompt_token_ids.copy()
    off = tr.prefill_offsets
    for r in range(4):
        if tr.prompt_lens[r] >= 4:
            ids[off[r]:off[r] + 4] = [1, 2, 3, 4]
    from dataclasses import replace
    return replace(tr, prompt_token_ids=ids, _cache={})


def test_affinity_sends_a_shared_prefix_to_one_worker_until_it_spills():
    tr = _trace_with_shared_prefix()
    cfg = SimConfig(num_prefill=4, spill_tokens=1000)
    router = PrefillRouter(tr, cfg)
    workers = [PrefillWorker(cfg) for _ in range(4)]
    shared = [r for r in range(4) if tr.prompt_lens[r] >= 4]
    targets = {router.choose(r, workers) for r in shared}
    assert len(targets) == 1
    w = targets.pop()
    workers[w].enqueue(0, 5000)  # overload the target: the next one spills
    assert router.choose(shared[0], workers) != w and router.num_spills == 1


def test_prefill_batch_budget_and_prefix_cache_hits():
    tr = make_trace(30, 48, 128, 8, seed=0)
    r0 = int(np.flatnonzero(tr.prompt_lens >= 8)[0])
    p0 = int(tr.prompt_lens[r0])
    cfg = SimConfig(num_prefill=1, prefill_max_batch_tokens=p0 + 1, prefix_caching=True)
    router, w = PrefillRouter(tr, cfg), PrefillWorker(cfg)
    tidx = np.array([r0, r0])
    prompt = tr.prompt_lens[tidx]
    for i in range(2):
        w.enqueue(i, int(prompt[i]))
    batch, cached, fresh = w.take_batch(router, tidx, prompt)
    assert batch == [0] and cached == [0] and fresh == p0  # the second exceeds the budget
    w.finish_batch()
    batch, cached, fresh = w.take_batch(router, tidx, prompt)
    # the same prompt again: its full blocks are cached, but one token is always computed
    expected = min((p0 // 4) * 4, p0 - 1)
    assert batch == [1] and cached == [expected] and fresh == p0 - expected
    assert w.queued_tokens == p0  # the first batch finished


def test_decode_worker_bookkeeping():
    d = DecodeWorker()
    d.admit(7, np.zeros((3, 48, 2), np.uint64), prompt=10, n_out=3, kv=5.0)
    d.step = 1
    d.admit(8, np.zeros((1, 48, 2), np.uint64), prompt=4, n_out=1, kv=2.0)
    assert d.finish_at == {2: [(7, 0)], 1: [(8, 1)]}
    assert (d.prompt_sum, d.start_sum, d.kv_bytes) == (14, 1, 7.0)
    d.remove({8})
    assert d.ids == [7] and (d.prompt_sum, d.start_sum, d.kv_bytes) == (10, 0, 5.0)
