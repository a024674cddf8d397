"""The Ray app's decode table (eldr.integrations.ray.table): slots, heartbeats, reservations.

Pure Python, no Ray: a fake clock drives heartbeats and expiries. The routing state is the
router unit tests' (tests/_proxy_fakes.py): decoder w-code's centroid uses experts 0-3,
w-other's 4-7, policy ``eldr`` at τ = 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from _proxy_fakes import domain_counts, make_state
from eldr.capture.payload import encode_counts
from eldr.integrations.ray.table import DecodeTable, TableConfig
from eldr.proxy.config import ServeConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(clock=None, policy="eldr", **kw) -> DecodeTable:
    serve = ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://a:1", "http://b:1"),
                        policy=policy, artifact=None)
    return DecodeTable(TableConfig(num_decode=2, policy=policy, **kw), clock=clock or Clock(),
                       state=make_state(serve, names=("w-code", "w-other")))


def _payload(prompt: str) -> dict:
    return {**encode_counts(domain_counts(prompt)), "tokens": 4}


def _registered(clock=None, **kw) -> DecodeTable:
    t = _table(clock, **kw)
    t.register("prefill", "p", "http://p:1")
    t.register("decode", "r0", "http://a:1", pid=11, node="n1")
    t.register("decode", "r1", "http://b:1", pid=12, node="n2")
    return t


def test_decode_replicas_take_the_artifact_slots_in_order_and_extra_ones_wait():
    t = _table()
    assert t.register("decode", "r0", "http://a:1") == {"slot": "w-code"}
    assert t.register("decode", "r1", "http://b:1") == {"slot": "w-other"}
    assert t.register("decode", "r2", "http://c:1") == {"slot": None}  # a spare
    assert t.register("decode", "r0", "http://a:1") == {"slot": "w-code"}  # heartbeat
    t.unregister("r0")  # Serve stopped it: the spare takes its slot
    snap = t.snapshot()
    assert [d["replica"] for d in snap["decoders"]] == ["r2", "r1"] and snap["spares"] == []
    with pytest.raises(ValueError, match="role"):
        t.register("router", "x", "http://x:1")


def test_the_choice_follows_the_payload_and_release_takes_the_load_back():
    t = _registered()
    a = t.reserve("q1", payload=_payload("some code"), prompt_tokens=4)
    b = t.reserve("q2", payload=_payload("the law"), prompt_tokens=4)
    c = t.reserve("q3", payload=_payload("code again"), prompt_tokens=4)
    assert [x["decoder"] for x in (a, b, c)] == ["w-code", "w-other", "w-code"]
    assert a["url"] == "http://a:1" and a["input"] == "payload" and a["fallback"] is None
    np.testing.assert_array_equal(t.tracker.loads, [2.0, 1.0])
    assert t.release("q1") == {"released": True}
    assert t.release("q1") == {"released": False}  # exactly once
    t.release("q2", "failed")
    t.release("q3", "cancelled")
    snap = t.snapshot()
    assert [d["load"] for d in snap["decoders"]] == [0.0, 0.0] and snap["held"] == 0
    assert snap["counters"]["reservations:completed"] == 1
    assert snap["counters"]["reservations:failed"] == 1
    assert snap["counters"]["reservations:cancelled"] == 1
    with pytest.raises(ValueError, match="outcome"):
        t.release("q4", "lost")


def test_a_payload_of_another_model_or_none_is_routed_by_load_and_counted():
    t = _registered()
    other = {**encode_counts(np.ones((3, 8), dtype=np.int64)), "tokens": 2}  # 3 layers, not 2
    got = [t.reserve(f"q{i}", payload=p, prompt_tokens=3)
           for i, p in enumerate([other, None])]
    assert [g["fallback"] for g in got] == ["mismatch", "missing"]
    assert sorted(g["decoder"] for g in got) == ["w-code", "w-other"]  # by load
    counters = t.snapshot()["counters"]
    assert counters["fallbacks:mismatch"] == 1 and counters["fallbacks:missing"] == 1


def test_failed_excluded_and_silent_decoders_are_skipped():
    clock = Clock()
    t = _registered(clock, heartbeat_timeout=5.0)
    got = t.reserve("q1", payload=_payload("code"), exclude=("w-code",))
    assert got["decoder"] == "w-other"
    t.mark_failed("w-other")
    assert t.reserve("q2", payload=_payload("law"))["decoder"] == "w-code"
    assert t.reserve("q3", payload=_payload("code"), exclude=("w-code",)) == {
        "error": "no healthy decode engine"}
    t.register("decode", "r1", "http://b:1")  # its heartbeat: healthy again
    assert t.reserve("q4", payload=_payload("law"))["decoder"] == "w-other"
    clock.now += 6.0  # no heartbeat from r1 since; r0 keeps beating
    t.register("decode", "r0", "http://a:1")
    np.testing.assert_array_equal(t.healthy(), [True, False])
    # a replacement replica takes the silent one's slot
    assert t.register("decode", "r9", "http://c:1") == {"slot": "w-other"}
    assert t.snapshot()["decoders"][1]["url"] == "http://c:1"


def test_an_unreleased_reservation_expires_and_frees_its_decoder():
    clock = Clock()
    t = _registered(clock, reservation_ttl=10.0)
    t.reserve("q1", payload=_payload("code"))
    clock.now += 11.0
    snap = t.snapshot()
    assert snap["held"] == 0 and snap["decoders"][0]["load"] == 0.0
    assert snap["counters"]["reservations:expired"] == 1
    assert t.release("q1") == {"released": False}
    t.reserve("q2", payload=None)
    with pytest.raises(ValueError, match="already held"):
        t.reserve("q2", payload=None)


def test_prefill_targets_are_the_live_prefill_engines():
    clock = Clock()
    t = _table(clock, heartbeat_timeout=5.0)
    t.register("prefill", "p1", "http://p1:1")
    t.register("prefill", "p0", "http://p0:1")
    assert [x["replica"] for x in t.prefill_targets()] == ["p0", "p1"]
    t.prefill_failed("p1")
    assert [x["replica"] for x in t.prefill_targets()] == ["p0"]
    t.register("prefill", "p1", "http://p1:1")  # its heartbeat
    clock.now += 6.0
    t.register("prefill", "p0", "http://p0:1")
    assert t.prefill_targets() == [{"replica": "p0", "url": "http://p0:1"}]


@pytest.mark.parametrize(("policy", "stride", "want"), [
    ("eldr", 1, {"eldr_layers": [0, 1]}),  # the band reads its encoder's layers
    ("eldr_cost", 1, {}),  # every layer: no mask
    ("eldr_cost", 2, {"eldr_layers": [0]}),  # the rows it prices
    ("jsq", 1, {}),  # reads no payload
])
def test_prefill_params_ask_the_engine_for_the_layers_the_policy_reads(policy, stride, want):
    serve = ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://a:1", "http://b:1"),
                        policy=policy, artifact=None, cost_layer_stride=stride)
    t = DecodeTable(TableConfig(num_decode=2, policy=policy, cost_layer_stride=stride),
                    clock=Clock(), state=make_state(serve, names=("w-code", "w-other")))
    assert t.prefill_params() == want


def test_config_is_validated_and_an_artifact_must_name_as_many_decoders(tmp_path):
    with pytest.raises(ValueError, match="num_decode"):
        TableConfig(num_decode=0)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        TableConfig(num_decode=2, heartbeat_timeout=0)
    from eldr.fit import artifact
    from test_artifact import _trace

    fitted = artifact.fit_artifact(_trace(), worker_ids=["w0", "w1"], n_init=1,
                                   random_state=0)
    path = artifact.save(fitted, tmp_path / "art")
    with pytest.raises(ValueError, match="2 decode workers, but 3"):
        DecodeTable(TableConfig(num_decode=3, artifact=str(path), policy="eldr"))
    t = DecodeTable(TableConfig(num_decode=2, artifact=str(path), policy="eldr"))
    assert t.names == ("w0", "w1")


def test_serve_replicas_given_with_a_reservation_hold_slots_and_loads_can_move():
    """Ray's own PD builder: the decode replicas register nothing; the router passes the
    replica ids it may route to with each reservation, and the prompt's predicted inputs
    instead of a payload."""
    from eldr.proxy.request.signatures import Reading

    clock = Clock()
    t = _table(clock, heartbeat_timeout=5.0)
    state = t.state

    def predicted(prompt: str) -> Reading:
        return Reading(state.encode(domain_counts(prompt)), None, 4, "prompt", None)

    a = t.reserve("q1", reading=predicted("some code"), replicas=("s0", "s1"))
    b = t.reserve("q2", reading=predicted("the law"), replicas=("s0", "s1"))
    assert (a["decoder"], a["replica"], a["input"]) == ("w-code", "s0", "prompt")
    assert (b["decoder"], b["replica"]) == ("w-other", "s1")
    # only slots held by the replicas given are chosen
    c = t.reserve("q3", reading=predicted("code again"), replicas=("s1",))
    assert c["replica"] == "s1"
    # no inputs (the prediction timed out): by load, counted under the reason given
    d = t.reserve("q4", reading=Reading(None, None, 0, "none", "prompt_timeout"),
                  replicas=("s0", "s1"))
    assert d["replica"] == "s0" and d["fallback"] == "prompt_timeout"
    assert t.snapshot()["counters"]["fallbacks:prompt_timeout"] == 1
    # Serve used s1 for q1: its load moves there
    assert t.move("q1", "s1") == {"moved": True, "decoder": "w-other"}
    assert t.move("q1", "s1") == {"moved": False}  # already there
    assert t.move("q1", "nobody") == {"moved": False}
    np.testing.assert_array_equal(t.tracker.loads, [1.0, 3.0])
    for rid in ("q1", "q2", "q3", "q4"):
        assert t.release(rid) == {"released": True}
    np.testing.assert_array_equal(t.tracker.loads, [0.0, 0.0])
    # a quiet spell (every slot stale), then a replacement s2 for s0 arrives first in
    # the list: the live s1 keeps its slot, s2 takes s0's
    clock.now += 10.0
    got = t.reserve("q5", reading=predicted("the law"), replicas=("s2", "s1"))
    assert [d["replica"] for d in t.snapshot()["decoders"]] == ["s2", "s1"]
    assert got["replica"] == "s1"


def test_a_cost_layer_stride_reaches_the_tables_policy():
    """``eldr.cost_layer_stride`` (as ``eldr serve --cost-layer-stride``): the table's
    ``eldr_cost`` prices every s-th layer once it knows the model's shape."""
    from _proxy_fakes import E, L

    t = DecodeTable(TableConfig(num_decode=2, policy="eldr_cost", cost_layer_stride=2),
                    clock=Clock())
    t.state.policy.bind(L, E)
    assert t.state.policy.priced_layers.tolist() == [0]
    every = DecodeTable(TableConfig(num_decode=2, policy="eldr_cost"), clock=Clock())
    every.state.policy.bind(L, E)
    assert every.state.policy.priced_layers is None and every.state.policy.inner is not None
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="cost_layer_stride"):
            TableConfig(num_decode=2, cost_layer_stride=bad)
