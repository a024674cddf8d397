"""Unit tests of the vLLM plugin's bookkeeping, with stand-in objects (no engine)."""

from types import SimpleNamespace

import numpy as np
import pytest

from eldr.capture import vllm_plugin as plugin
from eldr.capture import vllm_prefill as prefill
from eldr.capture.enginecache import BlockRowCache, PrefillStep
from eldr.capture.payload import decode_counts, decode_payload


def test_patch_is_idempotent():
    class Runner:
        def step(self, x):
            return x + 1

    calls = []

    def wrapper(original):
        def step(self, x):
            calls.append(x)
            return original(self, x)
        return step

    plugin._patch(Runner, "step", wrapper)
    plugin._patch(Runner, "step", wrapper)  # a second load must not wrap twice
    assert Runner().step(1) == 2 and calls == [1]


def test_register_can_be_disabled(monkeypatch):
    monkeypatch.setenv("ELDR_CAPTURE", "0")
    plugin.register()  # returns before importing vLLM
    monkeypatch.setenv("ELDR_CAPTURE", "bogus")
    with pytest.raises(ValueError, match="ELDR_CAPTURE"):
        plugin.register()


def test_bincount_matches_hand_count():
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]]])  # (T=2, L=2, k=2)
    np.testing.assert_array_equal(plugin._bincount(ids, 4), [[1, 2, 1, 0], [1, 0, 1, 2]])


def _runner(buffer_rows, req_ids, prompt_lens, num_experts=4, block_size=None):
    torch = pytest.importorskip("torch")
    buf = torch.tensor(np.asarray(buffer_rows), dtype=torch.int32)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids),
        requests={r: SimpleNamespace(num_prompt_tokens=p) for r, p in zip(req_ids, prompt_lens,
                                                                           strict=True)},
        _eldr_capture=plugin._Capture(buf, num_experts, block_size))
    return runner


def _sched(num_tokens, new, cached=()):
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(num_tokens.values()), num_scheduled_tokens=num_tokens,
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached],
                                              resumed_req_ids=set()))


def test_collect_splits_rows_per_request_and_skips_decode():
    # L=1, k=1, E=4. Batch order: "d" (a decoding request, 1 row), then "a" (3 prompt rows,
    # prompt of 5: a first chunk), then "b" (prompt of 2, all of it, plus nothing else).
    rows = [[[3]], [[0]], [[1]], [[1]], [[2]], [[2]], [[0]]]
    runner = _runner(rows, ["d", "a", "b"], [4, 5, 2])
    sched = _sched({"d": 1, "a": 3, "b": 2}, new=[("a", 0), ("b", 0)], cached=[("d", 7)])
    plugin._collect(runner, sched)
    pending = runner._eldr_capture.pending
    assert set(pending) == {"a", "b"}
    np.testing.assert_array_equal(pending["a"].counts, [[1, 2, 0, 0]])
    assert pending["a"].num_tokens == 3 and pending["a"].hit_tokens == 0
    np.testing.assert_array_equal(pending["b"].counts, [[0, 0, 2, 0]])
    # the second chunk of "a": 2 more prompt rows, then its first decode row is not counted
    runner._eldr_capture.buffer[:3] = runner._eldr_capture.buffer.new_tensor([[[3]], [[3]], [[0]]])
    plugin._collect(runner, _sched({"a": 3}, new=[], cached=[("a", 3)]))
    np.testing.assert_array_equal(pending["a"].counts, [[1, 2, 0, 2]])
    assert pending["a"].num_tokens == 5 and pending["a"].hit_tokens == 0


def test_collect_cuts_block_rows_across_chunks_and_reports_hits():
    # block size 2, E=4. "h" had 2 prompt tokens from the prefix cache: its first chunk
    # starts at 2 (hit_tokens 2) and computes positions 2..4: block 1 complete, block 2
    # half done; the next chunk completes block 2 with position 5.
    rows = [[[0]], [[1]], [[2]]]
    runner = _runner(rows, ["h"], [6], block_size=2)
    plugin._collect(runner, _sched({"h": 3}, new=[("h", 2)]))
    step = runner._eldr_capture.pending.pop("h")
    assert step.hit_tokens == 2 and step.num_tokens == 3
    (first, block_rows), = step.blocks
    assert first == 1
    np.testing.assert_array_equal(block_rows, [[[1, 1, 0, 0]]])
    runner._eldr_capture.buffer[:1] = runner._eldr_capture.buffer.new_tensor([[[3]]])
    plugin._collect(runner, _sched({"h": 1}, new=[], cached=[("h", 5)]))
    step = runner._eldr_capture.pending["h"]
    assert step.hit_tokens is None and step.blocks[0][0] == 2
    np.testing.assert_array_equal(step.blocks[0][1], [[[0, 0, 1, 1]]])


def test_collect_skips_a_step_it_does_not_understand():
    runner = _runner([[[0]], [[1]]], ["a"], [2])
    plugin._collect(runner, _sched({"a": 1, "ghost": 1}, new=[("a", 0)]))
    assert runner._eldr_capture.pending == {}


def _tally(counts, tokens, wanted, layers=None):
    params = {"do_remote_decode": wanted}
    if layers is not None:
        params["eldr_layers"] = layers
    return prefill.Tally(PrefillStep(counts, tokens, 0, ()), params)


def test_payload_attached_only_to_finished_wanted_requests():
    counts = np.array([[1, 0, 2, 1]], dtype=np.int32)
    acc = {"p": _tally(counts, 2, True), "n": _tally(counts, 2, False),
           "running": _tally(counts, 2, True)}
    outs = [SimpleNamespace(request_id="p", finish_reason="length", kv_transfer_params=None),
            SimpleNamespace(request_id="n", finish_reason="stop", kv_transfer_params=None),
            SimpleNamespace(request_id="running", finish_reason=None,
                            kv_transfer_params=None),
            SimpleNamespace(request_id="other", finish_reason="stop",
                            kv_transfer_params={"x": 1})]
    prefill.attach_payloads(acc, {0: SimpleNamespace(outputs=outs)})
    payload = outs[0].kv_transfer_params["eldr"]
    assert payload["v"] == 2
    np.testing.assert_array_equal(decode_counts(payload, num_layers=1, num_experts=4), counts)
    assert payload["tokens"] == 2
    assert outs[1].kv_transfer_params is None  # finished but not a prefill leg
    assert outs[2].kv_transfer_params is None  # still running
    assert outs[3].kv_transfer_params == {"x": 1}
    assert set(acc) == {"running"}


def test_payload_follows_the_requested_layer_mask_and_version(monkeypatch):
    counts = np.arange(12, dtype=np.int32).reshape(3, 4)
    masked = prefill._payload(_tally(counts, 11, True, layers=[0, 2]), "2")
    got = decode_payload(masked, num_layers=3, num_experts=4)
    assert got.layers.tolist() == [0, 2] and got.tokens == 11
    np.testing.assert_array_equal(got.counts, [[0, 1, 2, 3], [0, 0, 0, 0], [8, 9, 10, 11]])
    bad = prefill._payload(_tally(counts, 11, True, layers=[5]), "2")  # not a layer: all
    assert "layers" not in bad
    np.testing.assert_array_equal(decode_counts(bad, num_layers=3, num_experts=4), counts)
    old = prefill._payload(_tally(counts, 11, True), "1")
    assert old["v"] == 1 and old["tokens"] == 11


class _Block:
    def __init__(self, block_id, block_hash):
        self.block_id, self.block_hash, self.is_null = block_id, block_hash, False


def _scheduler(blocks_of, params_of, num_blocks=8, block_size=2):
    pool = SimpleNamespace(enable_caching=True, num_gpu_blocks=num_blocks)
    coordinator = SimpleNamespace(get_blocks=lambda rid: (blocks_of.get(rid, []),))
    return SimpleNamespace(
        requests={r: SimpleNamespace(kv_transfer_params=p) for r, p in params_of.items()},
        kv_cache_manager=SimpleNamespace(block_pool=pool, coordinator=coordinator),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[0], hash_block_size=block_size,
                                        kv_cache_tensors=[SimpleNamespace(size=1 << 20)]),
        block_size=block_size)


def test_absorb_adds_reused_block_rows_so_counts_cover_the_prompt():
    # "a" computed blocks 0 and 1 (ids 3, 5) in an earlier step; "b" reuses both (hit of
    # 4 tokens) and computes 1 tail token in the same step as "c" completes block 7.
    wanted = {"do_remote_decode": True}
    a_blocks = [_Block(3, b"h0"), _Block(5, b"h1")]
    sched = _scheduler({"a": a_blocks, "b": [*a_blocks, _Block(6, None)]},
                       {"a": wanted, "b": wanted})
    row0 = np.array([[[2, 0, 0, 0]]], np.int8)
    row1 = np.array([[[0, 1, 1, 0]]], np.int8)
    acc = {}
    prefill.absorb(sched, acc, {"a": PrefillStep(np.array([[2, 1, 1, 0]], np.int32), 4, 0,
                                                 ((0, np.concatenate([row0, row1])),))})
    cache = sched.kv_cache_manager.block_pool._eldr_rows
    assert isinstance(cache, BlockRowCache) and len(cache) == 2
    prefill.absorb(sched, acc, {"b": PrefillStep(np.array([[0, 0, 0, 1]], np.int32), 1, 4,
                                                 ())})
    np.testing.assert_array_equal(acc["b"].counts, [[2, 1, 1, 1]])
    assert acc["b"].tokens == 5
    cache.evict(5)  # vLLM evicted block 5: a later reuse finds only block 3's row
    sched.requests["d"] = SimpleNamespace(kv_transfer_params=wanted)
    sched.kv_cache_manager.coordinator.get_blocks = lambda rid: ([*a_blocks, _Block(1, None)],)
    prefill.absorb(sched, acc, {"d": PrefillStep(np.array([[0, 0, 0, 1]], np.int32), 1, 4,
                                                 ())})
    assert acc["d"].tokens == 3  # partial, never stale
    np.testing.assert_array_equal(acc["d"].counts, [[2, 0, 0, 1]])
