import numpy as np
import pytest

from _learn_data import E, K, L, records
from eldr.learn import buffer as buffer_io
from eldr.learn.buffer import LearnBuffer, make_record, records_to_trace
from eldr.traces import trace as trace_io


def test_bound_drops_the_oldest():
    rng = np.random.default_rng(0)
    recs = records(rng, [0, 1, 2, 3, 0, 1, 2, 3])
    buf = LearnBuffer(max_requests=5)
    for r in recs:
        buf.add(r)
    assert len(buf) == 5 and buf.num_seen == 8 and buf.num_dropped == 3
    assert buf.snapshot() == recs[3:]  # the newest five, oldest first
    assert buf.snapshot(last=2) == recs[6:]


def test_other_shapes_are_refused():
    buf = LearnBuffer(4)
    buf.add(make_record(np.full((L, E), 1, np.int32), top_k=E, decoder="a", time=0.0))
    with pytest.raises(ValueError, match="buffer holds"):
        buf.add(make_record(np.ones((L + 1, E), np.int32), top_k=E, decoder="a", time=0.0))


@pytest.mark.parametrize("kwargs, match", [
    ({"tokens": 5}, "the payload says 5"),
    ({"decode_counts": np.eye(L, E, dtype=np.int32) * 3}, "multiple of k"),
    ({"decode_counts": np.eye(L, E, dtype=np.int32) * np.arange(1, L + 1)[:, None] * 2},
     "differ between layers"),
    ({"decode_counts": np.ones((L, E + 1), np.int32)}, "decode counts must be"),
])
def test_inconsistent_records_are_refused(kwargs, match):
    counts = np.zeros((L, E), np.int32)
    counts[:, :2] = 3  # 3 tokens, k = 2
    assert make_record(counts, top_k=K, decoder="a", time=0.0).prompt_tokens == 3
    with pytest.raises(ValueError, match=match):
        make_record(counts, top_k=K, decoder="a", time=0.0, **kwargs)


def test_trace_with_and_without_decode_counts_is_valid():
    rng = np.random.default_rng(1)
    recs = records(rng, [0, 1, 2]) + records(rng, [3, 0], with_decode=False)
    trace, known = records_to_trace(recs, model="m", top_k=K)
    assert known.tolist() == [True, True, True, False, False]
    assert trace.output_lens[3:].tolist() == [1, 1]  # no decode routing observed
    assert (trace.decode_counts[3:] == 0).all()
    assert trace.output_lens[:3].tolist() == [r.output_tokens for r in recs[:3]]
    assert trace.domain_names == ("d0", "d1")
    assert [trace.domain_names[i] for i in trace.domains] == [r.decoder for r in recs]


def test_restart_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    recs = records(rng, [0, 1, 2, 3, 1]) + records(rng, [2, 2], with_decode=False)
    buf = LearnBuffer(10)
    buf.model, buf.top_k = "tiny", K
    for r in recs:
        buf.add(r)
    buffer_io.save(tmp_path / "buffer", buf.snapshot(), model=buf.model, top_k=K,
                   num_seen=buf.num_seen, num_dropped=0, state={"fits": 3})
    # the saved trace is a valid trace of the project's format
    assert trace_io.load(tmp_path / "buffer" / "trace.npz").num_requests == 7
    again = LearnBuffer(10)
    state = buffer_io.restore(again, tmp_path / "buffer")
    assert state == {"fits": 3} and again.num_seen == 7 and again.model == "tiny"
    for a, b in zip(again.snapshot(), recs, strict=True):
        assert np.array_equal(a.prefill_counts, b.prefill_counts)
        assert a.prompt_tokens == b.prompt_tokens and a.decoder == b.decoder
        assert a.output_tokens == b.output_tokens
        assert (a.decode_counts is None) == (b.decode_counts is None)
        if a.decode_counts is not None:
            assert np.array_equal(a.decode_counts, b.decode_counts)
    smaller = LearnBuffer(3)  # a smaller bound after a restart keeps the newest
    buffer_io.restore(smaller, tmp_path / "buffer")
    assert [r.time for r in smaller.snapshot()] == [r.time for r in recs[-3:]]


def test_a_crash_between_the_renames_reads_the_old_buffer(tmp_path):
    rng = np.random.default_rng(3)
    recs = records(rng, [0, 1, 2])
    buffer_io.save(tmp_path / "buffer", recs, model="m", top_k=K, num_seen=3,
                   num_dropped=0, state={})
    (tmp_path / "buffer").rename(tmp_path / ".buffer.123.old")  # the first rename only
    got, doc = buffer_io.load(tmp_path / "buffer")
    assert len(got) == 3 and doc["num_seen"] == 3
    assert buffer_io.load(tmp_path / "nothing") == ([], {})


def test_a_damaged_state_is_an_error(tmp_path):
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "learn.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        buffer_io.load(tmp_path / "buffer")
