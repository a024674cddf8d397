from __future__ import annotations

import json
import pickle
from dataclasses import replace

import numpy as np
import pytest

from conftest import make_trace
from eldr.traces.trace import Trace, TraceMeta, concat, load, save


def test_round_trip_keeps_every_field(tmp_path, toy_trace):
    path = save(toy_trace, tmp_path / "t.npz")
    back = load(path)
    assert back.meta == toy_trace.meta
    assert back.domain_names == toy_trace.domain_names
    for name in ("prefill_counts", "decode_counts", "prompt_lens", "output_lens", "domains",
                 "prefill_gate_prob", "prefill_gate_logit", "prefill_topk", "decode_topk",
                 "prompt_token_ids"):
        np.testing.assert_array_equal(getattr(back, name), getattr(toy_trace, name), name)
    assert back.prefill_counts.dtype == np.int32 and back.prefill_topk.dtype == np.int16


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path, toy_trace):
    save(toy_trace, tmp_path / "t.npz")
    save(toy_trace, tmp_path / "t.npz")  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]


def _kw(t: Trace) -> dict:
    return {n: getattr(t, n) for n in ("meta", "prefill_counts", "decode_counts", "prompt_lens",
                                         "output_lens", "domains", "domain_names")}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda kw: kw.update(prefill_counts=kw["prefill_counts"][:, :-1]), "prefill_counts"),
        (lambda kw: kw.update(output_lens=kw["output_lens"][:-1]), "output_lens"),
        (lambda kw: kw.update(prompt_lens=kw["prompt_lens"].astype(float)), "integer"),
        (lambda kw: kw.update(domains=kw["domains"] + 10), "out of range"),
        (lambda kw: kw.update(decode_counts=kw["decode_counts"].astype(float)), "integer counts"),
    ],
)
def test_malformed_fields_are_refused(toy_trace, mutate, message):
    kw = _kw(toy_trace)
    mutate(kw)
    with pytest.raises(ValueError, match=message):
        Trace(**kw)


def test_negative_count_names_field_and_request(toy_trace):
    kw = _kw(toy_trace)
    counts = kw["prefill_counts"].copy()
    counts[5, 1, 0] -= counts[5, 1, 0] + 1  # make it -1
    counts[5, 1, 1] += 1 + toy_trace.prefill_counts[5, 1, 0]  # keep the sum
    kw["prefill_counts"] = counts
    with pytest.raises(ValueError, match=r"'prefill_counts' \(request 5\): negative"):
        Trace(**kw)


def test_topk_identity_violation_names_request_and_layer(toy_trace):
    kw = _kw(toy_trace)
    counts = kw["decode_counts"].copy()
    r = int(np.flatnonzero(toy_trace.output_lens > 1)[0])
    counts[r, 2, 3] += 1
    kw["decode_counts"] = counts
    with pytest.raises(ValueError, match=rf"'decode_counts' \(request {r}\): layer 2 counts sum"):
        Trace(**kw)


def test_nan_gate_is_refused(toy_trace):
    gate = toy_trace.prefill_gate_prob.copy()
    gate[3, 0, 0] = np.nan
    with pytest.raises(ValueError, match=r"'prefill_gate_prob' \(request 3\): non-finite"):
        replace(toy_trace, prefill_gate_prob=gate, _cache={})


def test_topk_duplicates_and_range_are_refused(toy_trace):
    topk = toy_trace.prefill_topk.copy()
    topk[0, 0, 1] = topk[0, 0, 0]
    with pytest.raises(ValueError, match="same expert twice"):
        replace(toy_trace, prefill_topk=topk, _cache={})
    topk = toy_trace.prefill_topk.copy()
    topk[0, 0, 0] = 99
    with pytest.raises(ValueError, match="out of range"):
        replace(toy_trace, prefill_topk=topk, _cache={})


def test_meta_validation():
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        TraceMeta("m", 2, 8, 9)
    with pytest.raises(ValueError, match="num_layers"):
        TraceMeta("m", 0, 8, 2)
    with pytest.raises(ValueError, match="format version 7"):
        TraceMeta("m", 2, 8, 2, version=7)


def test_pickled_object_array_is_refused(tmp_path, toy_trace):
    path = save(toy_trace, tmp_path / "t.npz")
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["domains"] = np.array([object()] * len(toy_trace), dtype=object)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    with pytest.raises(ValueError, match=r"object array \(needs pickle\), refused"):
        load(bad)


def test_not_a_zip_and_missing_meta_are_refused(tmp_path, toy_trace):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not a zip archive"):
        load(junk)
    only_counts = tmp_path / "nometa.npz"
    np.savez(only_counts, prefill_counts=toy_trace.prefill_counts)
    with pytest.raises(ValueError, match="no 'meta_json'"):
        load(only_counts)


def test_load_validates_contents(tmp_path, toy_trace):
    path = save(toy_trace, tmp_path / "t.npz")
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["decode_counts"] = arrays["decode_counts"] * 2
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=r"bad\.npz.*decode_counts"):
        load(tmp_path / "bad.npz")
    meta = json.loads(arrays["meta_json"].tobytes())
    meta["surprise"] = 1
    arrays["meta_json"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(tmp_path / "bad2.npz", **arrays)
    with pytest.raises(ValueError, match="unknown trace metadata keys"):
        load(tmp_path / "bad2.npz")


def test_subset_keeps_ragged_rows_aligned(toy_trace):
    idx = [7, 2, 11]
    sub = toy_trace.subset(idx)
    assert sub.num_requests == 3
    off, sub_off = toy_trace.prefill_offsets, sub.prefill_offsets
    for new, old in enumerate(idx):
        np.testing.assert_array_equal(
            sub.prefill_topk[sub_off[new]:sub_off[new + 1]],
            toy_trace.prefill_topk[off[old]:off[old + 1]],
        )
        np.testing.assert_array_equal(sub.prompt_tokens(new), toy_trace.prompt_tokens(old))
        np.testing.assert_array_equal(sub.decode_counts[new], toy_trace.decode_counts[old])
    mask = np.zeros(len(toy_trace), dtype=bool)
    mask[[1, 3]] = True
    assert toy_trace.subset(mask).num_requests == 2


def test_split_is_seeded_and_partitions(toy_trace):
    a1, b1 = toy_trace.split(0.25, random_state=3)
    a2, _b2 = toy_trace.split(0.25, random_state=3)
    a3, _ = toy_trace.split(0.25, random_state=4)
    assert len(a1) == 10 and len(b1) == 30
    np.testing.assert_array_equal(a1.prefill_counts, a2.prefill_counts)
    assert not np.array_equal(a1.prefill_counts, a3.prefill_counts)
    both = np.concatenate([a1.prompt_token_ids, b1.prompt_token_ids])
    assert both.size == toy_trace.prompt_token_ids.size
    with pytest.raises(ValueError, match="fraction"):
        toy_trace.split(1.0)


def test_concat_merges_domains_by_name():
    a = make_trace(10, seed=1)
    b = make_trace(12, seed=2, num_domains=2)
    b = replace(b, domain_names=("d1", "extra"), _cache={})
    both = concat([a, b])
    assert len(both) == 22
    assert both.domain_names == ("d0", "d1", "d2", "extra")
    names = [both.domain_names[d] for d in both.domains]
    assert names[10:] == [b.domain_names[d] for d in b.domains]
    assert both.prefill_topk.shape[0] == a.prefill_topk.shape[0] + b.prefill_topk.shape[0]


def test_concat_refuses_other_models():
    with pytest.raises(ValueError, match="concat: trace 1 is for L=3"):
        concat([make_trace(5), make_trace(5, num_layers=3)])


# -- issue 12: odd files are refused in one line, never block, never inflate ----------------
def _arrays(path):
    with np.load(path) as npz:
        return dict(npz)


def _npy_bytes(header_shape, dtype="<i4", payload=b""):
    """A .npy member whose header declares ``header_shape`` (the data need not match)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False,
                                               "shape": tuple(header_shape)})
    return buf.getvalue() + payload


def _rewrite(path, out, replace_members=None, extra_members=None):
    import zipfile

    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            data = (replace_members or {}).get(info.filename, src.read(info))
            dst.writestr(info.filename, data)
        for name, data in (extra_members or {}).items():
            dst.writestr(name, data)
    return out


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os
    import threading

    fifo = tmp_path / "t.npz"
    os.mkfifo(fifo)
    result = {}

    def go():
        try:
            load(fifo)
        except ValueError as exc:
            result["error"] = str(exc)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(5)
    if th.is_alive():  # unblock the reader before failing
        with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
        pytest.fail("load() blocked on a FIFO")
    assert "not a regular file" in result["error"]


def test_a_non_npy_member_is_refused(tmp_path, toy_trace):
    path = save(toy_trace, tmp_path / "t.npz")
    bad = _rewrite(path, tmp_path / "bad.npz", extra_members={"notes.txt": b"hello"})
    with pytest.raises(ValueError, match=r"'notes\.txt' is not a \.npy array"):
        load(bad)
    fake = _rewrite(path, tmp_path / "fake.npz", replace_members={"domains.npy": b"garbage"})
    with pytest.raises(ValueError, match=r"'domains' is not a \.npy array"):
        load(fake)


@pytest.mark.parametrize("member, shape", [
    ("prefill_counts.npy", (10**6, 10**6)),  # 10^12 elements: no MemoryError
    ("prefill_counts.npy", (600_000_000,)),  # 2.4 GB declared: no "pickled" message
])
def test_huge_declared_shapes_are_refused_before_reading(tmp_path, toy_trace, member, shape):
    path = save(toy_trace, tmp_path / "t.npz")
    bad = _rewrite(path, tmp_path / "bad.npz", replace_members={member: _npy_bytes(shape)})
    with pytest.raises(ValueError, match=r"'prefill_counts': shape \[.*\], expected \[40, 4, 16\]"):
        load(bad)


def test_a_decompression_bomb_is_refused_before_inflating(tmp_path, toy_trace):
    import zipfile

    path = save(toy_trace, tmp_path / "t.npz")
    zeros = _npy_bytes((1 << 26,), "<i4") + bytes(1 << 28)  # 256 MiB of zeros, ~260 KB zipped
    bad = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename != "decode_counts.npy":
                dst.writestr(info.filename, src.read(info))
        dst.writestr("decode_counts.npy", zeros)
    del zeros
    assert bad.stat().st_size < 1 << 20
    with pytest.raises(ValueError, match="'decode_counts': shape"):
        load(bad)
    with pytest.raises(ValueError, match="limit for the whole file"):
        load(path, max_bytes=1000)


def test_counts_that_wrap_around_in_int64_are_refused(toy_trace):
    counts = toy_trace.prefill_counts.astype(np.int64)
    counts[0, 0, 0] += 1 << 62  # the sum wraps back to k x tokens after four of them
    counts[0, 0, 1] += 1 << 62
    counts[0, 0, 2] += 1 << 62
    counts[0, 0, 3] += 1 << 62
    with pytest.raises(ValueError, match=r"'prefill_counts' \(request 0\).*exceeds"):
        replace(toy_trace, prefill_counts=counts)


def test_odd_trace_files_fail_in_one_line_with_exit_2(tmp_path, toy_trace, capsys):
    import os
    import warnings

    from eldr.cli import main

    empty = save(toy_trace.subset([]), tmp_path / "empty.npz")
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04 not really a zip")
    for bad in (empty, fifo, junk, tmp_path / "missing.npz"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a RuntimeWarning would be a second line
            assert main(["score", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("eldr score: error:"), err


def test_fuzzed_trace_files_load_or_fail_with_one_value_error(tmp_path_factory, toy_trace):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = save(toy_trace.subset(range(6)), tmp_path_factory.mktemp("fuzz") / "t.npz")
    data = good.read_bytes()
    out = good.with_name("mutated.npz")

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(flips=st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)),
                          max_size=4),
           cut=st.integers(0, len(data)))
    def check(flips, cut):
        mutated = bytearray(data[:cut] if cut > 2 else data)
        for pos, value in flips:
            if pos < len(mutated):
                mutated[pos] = value
        out.write_bytes(bytes(mutated))
        try:
            load(out)
        except ValueError as exc:
            assert "\n" not in str(exc)

    check()
