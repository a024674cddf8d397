"""Unit tests of the vLLM plugin's bookkeeping, with stand-in objects (no engine)."""

from types import SimpleNamespace

import numpy as np
import pytest

from eldr.capture import vllm_plugin as plugin
from eldr.capture.payload import decode_counts


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


def _runner(buffer_rows, req_ids, prompt_lens, num_experts=4):
    torch = pytest.importorskip("torch")
    buf = torch.tensor(np.asarray(buffer_rows), dtype=torch.int32)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids),
        requests={r: SimpleNamespace(num_prompt_tokens=p) for r, p in zip(req_ids, prompt_lens,
                                                                           strict=True)},
        _eldr_capture=plugin._Capture(buf, num_experts))
    return runner


def _sched(num_tokens, new, cached=()):
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(num_tokens.values()), num_scheduled_tokens=num_tokens,
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached]))


def test_collect_splits_rows_per_request_and_skips_decode():
    # L=1, k=1, E=4. Batch order: "d" (a decoding request, 1 row), then "a" (3 prompt rows,
    # prompt of 5: a first chunk), then "b" (prompt of 2, all of it, plus nothing else).
    rows = [[[3]], [[0]], [[1]], [[1]], [[2]], [[2]], [[0]]]
    runner = _runner(rows, ["d", "a", "b"], [4, 5, 2])
    sched = _sched({"d": 1, "a": 3, "b": 2}, new=[("a", 0), ("b", 0)], cached=[("d", 7)])
    plugin._collect(runner, sched)
    pending = runner._eldr_capture.pending
    assert set(pending) == {"a", "b"}
    np.testing.assert_array_equal(pending["a"][0], [[1, 2, 0, 0]])
    assert pending["a"][1] == 3
    np.testing.assert_array_equal(pending["b"][0], [[0, 0, 2, 0]])
    # the second chunk of "a": 2 more prompt rows, then its first decode row is not counted
    runner._eldr_capture.buffer[:3] = runner._eldr_capture.buffer.new_tensor([[[3]], [[3]], [[0]]])
    plugin._collect(runner, _sched({"a": 3}, new=[], cached=[("a", 3)]))
    np.testing.assert_array_equal(pending["a"][0], [[1, 2, 0, 2]])
    assert pending["a"][1] == 5


def test_collect_skips_a_step_it_does_not_understand():
    runner = _runner([[[0]], [[1]]], ["a"], [2])
    plugin._collect(runner, _sched({"a": 1, "ghost": 1}, new=[("a", 0)]))
    assert runner._eldr_capture.pending == {}


def test_payload_attached_only_to_finished_wanted_requests():
    counts = np.array([[1, 0, 2, 1]], dtype=np.int32)
    acc = {"p": [counts, 2, True], "n": [counts, 2, False], "running": [counts, 2, True]}
    outs = [SimpleNamespace(request_id="p", finish_reason="length", kv_transfer_params=None),
            SimpleNamespace(request_id="n", finish_reason="stop", kv_transfer_params=None),
            SimpleNamespace(request_id="running", finish_reason=None,
                            kv_transfer_params=None),
            SimpleNamespace(request_id="other", finish_reason="stop",
                            kv_transfer_params={"x": 1})]
    plugin._attach_payloads(acc, {0: SimpleNamespace(outputs=outs)})
    payload = outs[0].kv_transfer_params["eldr"]
    np.testing.assert_array_equal(decode_counts(payload, num_layers=1, num_experts=4), counts)
    assert payload["tokens"] == 2
    assert outs[1].kv_transfer_params is None  # finished but not a prefill leg
    assert outs[2].kv_transfer_params is None  # still running
    assert outs[3].kv_transfer_params == {"x": 1}
    assert set(acc) == {"running"}
