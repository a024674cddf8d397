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


def _with_prompt(rng, prompt_len: int, **kw):
    """A record of ``prompt_len`` tokens whose prompt ids are given (kept as a bag)."""
    counts = np.zeros((L, E), dtype=np.int32)
    for layer in range(L):
        top = np.argsort(rng.random((prompt_len, E)), axis=1)[:, :K]
        counts[layer] = np.bincount(top.ravel(), minlength=E)
    ids = rng.integers(0, 500, size=prompt_len)
    given = kw.pop("prompt_ids", ids)
    return make_record(counts, top_k=K, decoder="decode-0", time=1.0, prompt_ids=given,
                       **kw), ids


def test_a_prompt_is_kept_as_a_sorted_bag_of_hashed_ngrams_never_as_ids(tmp_path):
    from eldr.fit.prompt import ngram_hashes

    rng = np.random.default_rng(5)
    rec, ids = _with_prompt(rng, 9)
    assert rec.prompt_hashes.dtype == np.uint64 and rec.prompt_hashes.size == 2 * 9 - 1
    assert np.array_equal(rec.prompt_hashes, np.sort(ngram_hashes(ids)))
    assert rec.max_token_id == int(ids.max())
    assert not np.isin(ids.astype(np.uint64), rec.prompt_hashes).any()  # no raw ids
    # ids that do not match the counted tokens, or are not valid ids: no bag, record kept
    for bad in (ids[:-1], np.array([-1] * 9), ids.astype(float)):
        r, _ = _with_prompt(np.random.default_rng(5), 9, prompt_ids=bad)
        assert r.prompt_hashes is None and r.max_token_id is None and r.prompt_tokens == 9
    # round trip through the buffer directory, beside records without a bag
    plain = records(rng, [0, 1])
    recs = [rec, *plain, _with_prompt(rng, 4)[0]]
    buffer_io.save(tmp_path / "buffer", recs, model="m", top_k=K, num_seen=4,
                   num_dropped=0, state={})
    assert (tmp_path / "buffer" / "prompts.npz").is_file()
    back, _ = buffer_io.load(tmp_path / "buffer")
    for a, b in zip(back, recs, strict=True):
        assert (a.prompt_hashes is None) == (b.prompt_hashes is None)
        assert a.max_token_id == b.max_token_id
        if a.prompt_hashes is not None:
            assert np.array_equal(a.prompt_hashes, b.prompt_hashes)
    # a buffer without any bag writes no prompts file; a damaged one is an error
    buffer_io.save(tmp_path / "plain", plain, model="m", top_k=K, num_seen=2,
                   num_dropped=0, state={})
    assert not (tmp_path / "plain" / "prompts.npz").exists()
    np.savez(tmp_path / "buffer" / "prompts.npz", hashes=np.zeros(3, np.uint64),
             offsets=np.array([0, 1]), max_ids=np.array([1]))
    with pytest.raises(ValueError, match="prompt bags inconsistent"):
        buffer_io.load(tmp_path / "buffer")
