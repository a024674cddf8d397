import json

import numpy as np
import pytest

from eldr.capture.decode import (
    STEP_BUCKETS,
    DecodeTally,
    Footprint,
    StepRing,
    decode_decode_payload,
    decode_step,
    decode_step_ring,
    distinct_per_layer,
    encode_decode_payload,
    is_decode_leg,
)

L, E, K = 3, 16, 2


def _ids(rng, T):
    """(T, L, K) distinct top-k ids per token and layer."""
    return np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(T)])


def test_distinct_per_layer_counts_unique_experts():
    ids = np.array([[[0, 1], [2, 3], [4, 5]], [[1, 2], [2, 3], [6, 7]]])
    assert distinct_per_layer(ids, 8).tolist() == [3, 2, 4]
    assert distinct_per_layer(ids[:0], 8).tolist() == [0, 0, 0]


def test_decode_step_splits_rows_by_request():
    rng = np.random.default_rng(0)
    rows = _ids(rng, 6)
    step = decode_step(rows, [("a", 1, 2), ("b", 3, 0), ("c", 5, 1)], E)
    assert step.req_ids == ("a", "c") and step.owner.tolist() == [0, 0, 1]
    assert np.array_equal(step.ids, rows[[1, 2, 5]]) and step.ids.dtype == np.int16
    assert step.distinct.tolist() == distinct_per_layer(rows[[1, 2, 5]], E).tolist()
    assert decode_step(rows, [("a", 0, 0)], E) is None
    # the whole step, for its timing: 6 rows, 3 of them decode -> mixed; Σ_l D_l of all rows
    assert step.num_tokens == 6 and step.is_mixed and step.wall_s is None
    assert step.distinct_sum == int(distinct_per_layer(rows, E).sum())
    pure = decode_step(rows[:2], [("a", 0, 2)], E)
    assert not pure.is_mixed and pure.distinct_sum == int(pure.distinct.sum())


def test_payload_round_trip_and_tally():
    rng = np.random.default_rng(1)
    tally = DecodeTally(L, E)
    per_step = []
    for _ in range(5):
        ids = _ids(rng, 1)
        d = distinct_per_layer(_ids(rng, 4), E)  # the batch's distinct
        tally.add(ids, d)
        per_step.append(d)
    assert tally.counts.sum(axis=1).tolist() == [5 * K] * L
    obj = encode_decode_payload(tally, own=True)
    assert obj["own"] == 1 and obj["steps"] == 5
    rep = decode_decode_payload(obj)
    assert np.array_equal(rep.counts, tally.counts) and rep.tokens == 5 and rep.steps == 5
    assert np.allclose(rep.distinct, np.mean(per_step, axis=0))
    assert rep.mean_distinct == pytest.approx(np.mean(per_step))
    same = decode_decode_payload(obj, num_layers=L, num_experts=E)
    assert np.array_equal(same.counts, rep.counts)


@pytest.mark.parametrize("change", [
    {"steps": -1}, {"steps": "2"}, {"distinct": [1]}, {"distinct": [1, 2, 10**6]},
    {"shape": [L, 99999]}, {"v": 1}, {"tokens": None}, {"data": "!!"},
])
def test_malformed_payloads_are_refused_with_value_error(change):
    tally = DecodeTally(L, E)
    tally.add(_ids(np.random.default_rng(2), 1), np.array([2, 2, 2]))
    obj = {**encode_decode_payload(tally), **change}
    if change.get("tokens", 0) is None:
        del obj["tokens"]
    with pytest.raises(ValueError, match="eldr"):
        decode_decode_payload(obj)
    with pytest.raises(ValueError):
        decode_decode_payload([obj])


def test_footprint_window_forgets_old_steps():
    fp = Footprint(2, 1, 8)
    for experts in ([0, 1], [2, 3], [4, 5]):
        fp.push(np.array([[experts]]))
    snap = fp.snapshot()
    assert snap["steps"] == 2 and snap["experts"] == [4]  # {2, 3, 4, 5}
    assert snap["step_distinct_mean"] == 2.0
    assert Footprint(3, 2, 4).snapshot()["steps"] == 0
    with pytest.raises(ValueError):
        Footprint(0, 1, 1)


def test_decode_leg_mark():
    assert is_decode_leg({"do_remote_prefill": True})
    assert is_decode_leg({"do_remote_prefill": False})  # NIXL flips it after the pull
    assert not is_decode_leg({"do_remote_decode": True, "do_remote_prefill": False})
    assert not is_decode_leg(None) and not is_decode_leg({})
    assert is_decode_leg({"eldr_report": True})  # the router's mark (ExampleConnector)
    assert not is_decode_leg({"eldr_report": True, "do_remote_decode": True})


# -- the engine's per-cell footprint (issue 13, item 6) -----------------------------------
def _engine_doc(steps_ids, window=4, L=1, E=8, at=100.0):
    from eldr.capture.decode import encode_engine_footprint

    fp = Footprint(window, L, E)
    for ids in steps_ids:
        fp.push(np.asarray(ids))
    return fp, encode_engine_footprint(fp, at)


def test_engine_footprint_counts_each_cell_over_the_window_and_round_trips():
    from eldr.capture.decode import decode_engine_footprint

    # window 2: only the last two steps count ({0, 1} then {1, 2}); the first is gone
    fp, doc = _engine_doc([[[[5, 6]]], [[[0, 1]]], [[[1, 2]]]], window=2)
    assert fp.counts().tolist() == [[1, 2, 1, 0, 0, 0, 0, 0]]
    assert doc["steps"] == 2 and doc["w"] == 1 and len(doc["data"]) == 8
    read = decode_engine_footprint(json.loads(json.dumps(doc)), 1, 8, now=103.0)
    np.testing.assert_allclose(read.freq, [[0.5, 1.0, 0.5, 0, 0, 0, 0, 0]])
    assert read.steps == 2 and read.age == pytest.approx(3.0)
    assert decode_engine_footprint({**doc, "age": 0.25}, 1, 8, now=500.0).age == 0.25


def test_an_empty_engine_reads_as_zero_and_wide_windows_take_two_digits():
    from eldr.capture.decode import decode_engine_footprint

    _, empty = _engine_doc([])
    read = decode_engine_footprint(empty, 1, 8, now=100.0)
    assert read.steps == 0 and not read.freq.any()
    _, wide = _engine_doc([[[[0, 1]]]] * 100, window=100)
    assert wide["w"] == 2 and wide["steps"] == 100
    assert decode_engine_footprint(wide, 1, 8, now=100.0).freq[0, :3].tolist() == [1, 1, 0]


@pytest.mark.parametrize("change, match", [
    ({"v": 2}, "version"), ({"shape": [2, 4]}, "shape"), ({"steps": -1}, "steps"),
    ({"steps": True}, "steps"), ({"w": 4}, "w must"), ({"data": "##"}, "characters"),
    ({"data": 5}, "characters"), ({"time": "now"}, "time"), ({"time": 1e9}, "future"),
    ({"age": -1.0}, "age"), ({"age": float("nan")}, "age"), ({"steps": 0}, "exceeds"),
    ({"data": "\\" * 8}, "exceeds"), ({"data": "é" * 8}, "ASCII"),
])
def test_a_malformed_engine_footprint_is_refused_by_name(change, match):
    from eldr.capture.decode import decode_engine_footprint

    _, doc = _engine_doc([[[[0, 1]]]])
    with pytest.raises(ValueError, match=match):
        decode_engine_footprint({**doc, **change}, 1, 8, now=100.0)
    with pytest.raises(ValueError, match="JSON object"):
        decode_engine_footprint([doc], 1, 8, now=100.0)


def test_step_ring_keeps_the_last_steps_and_lifetime_totals():
    ring = StepRing(3)
    steps = [(0.0004, 1, 10, False), (0.001, 2, 20, True), (0.003, 4, 30, False),
             (0.0105, 8, 40, False)]
    for step in steps:
        ring.push(*step)
    doc = json.loads(json.dumps(ring.snapshot(6, 64, 5.0)))
    assert (doc["layers"], doc["experts"], doc["capacity"], doc["time"]) == (6, 64, 3, 5.0)
    assert doc["wall_us"] == [1000, 3000, 10500]  # oldest first, the first one forgotten
    assert doc["tokens"] == [2, 4, 8] and doc["distinct_sum"] == [20, 30, 40]
    assert doc["mixed"] == [1, 0, 0]
    total = doc["total"]
    assert (total["steps"], total["tokens"], total["distinct_sum"], total["mixed"]) == \
        (4, 15, 100, 1)
    assert total["seconds"] == pytest.approx(0.0149)
    cum = dict((str(le), n) for le, n in total["buckets"])
    # le bounds inclusive: 0.001 falls in the 0.001 bucket
    assert (cum["0.0005"], cum["0.001"], cum["0.002"], cum["0.005"], cum["0.01"],
            cum["0.02"], cum["+Inf"]) == (1, 2, 2, 3, 3, 4, 4)
    assert len(total["buckets"]) == len(STEP_BUCKETS) + 1
    cols = decode_step_ring(doc)
    assert cols.wall_s.tolist() == pytest.approx([0.001, 0.003, 0.0105])
    assert cols.mixed.tolist() == [True, False, False] and cols.total_steps == 4
    assert (cols.num_layers, cols.num_experts) == (6, 64)
    with pytest.raises(ValueError, match="capacity"):
        StepRing(0)


@pytest.mark.parametrize("change, match", [
    ({"v": 2}, "version"),
    ({"layers": 0}, "layers and experts"),
    ({"tokens": [1, 2]}, "differ in length"),
    ({"wall_us": [1.5, 2, 3]}, "wall_us must be a list of non-negative integers"),
    ({"distinct_sum": [1, 2, 10**6]}, "exceeds layers x experts"),
    ({"total": {"steps": 1}}, "total.steps"),
])
def test_a_malformed_step_ring_is_refused_by_name(change, match):
    ring = StepRing(8)
    for i in range(3):
        ring.push(0.001 * (i + 1), i + 1, 10 * (i + 1), False)
    with pytest.raises(ValueError, match=match):
        decode_step_ring({**ring.snapshot(6, 64, 0.0), **change})
    with pytest.raises(ValueError, match="JSON object"):
        decode_step_ring([])


def test_tally_carries_step_seconds_into_the_payload():
    tally = DecodeTally(1, 4)
    ids = np.array([[[0, 1]]])
    tally.add(ids, np.array([2]), 0.25)
    tally.add(ids, np.array([2]), None)  # an untimed step adds no seconds
    tally.add(ids, np.array([2]), 0.5)
    payload = json.loads(json.dumps(encode_decode_payload(tally)))
    assert payload["step_s"] == 0.75 and decode_decode_payload(payload).step_s == 0.75
    assert decode_decode_payload({**payload, "step_s": None}).step_s is None
    with pytest.raises(ValueError, match="step_s"):
        decode_decode_payload({**payload, "step_s": -1})
    untimed = DecodeTally(1, 4)
    untimed.add(ids, np.array([2]))
    assert "step_s" not in encode_decode_payload(untimed)
