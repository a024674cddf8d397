"""Real request traces: both formats, detection by content, errors, scaling, shared prefixes."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.cache.hashing import block_hashes
from eldr.traces.arrivals import (
    DEFAULT_ARRIVALS,
    RequestArrivals,
    arrivals_trace,
    calibration_and_replay,
    clip_lengths,
    default_arrivals,
    detect_format,
    head,
    load_arrivals,
    scale_to_rate,
    sim_arrivals,
    window,
)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:46.9805900,396,109

2023-11-16 18:15:48.0000000,10,1
"""

MOONCAKE = """{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 250, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}
{"timestamp": 250, "input_length": 1024, "output_length": 1, "hash_ids": [0, 7]}
{"timestamp": 1000, "input_length": 20, "output_length": 2, "hash_ids": [9]}
"""


def _write(tmp_path, text, name="trace.txt"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _arrivals(times, source="hand"):
    n = len(times)
    return RequestArrivals(times=np.asarray(times, float), prompt_lens=np.full(n, 4),
                           output_lens=np.full(n, 2), block_ids=None, source=source)


# -- parsing ----------------------------------------------------------------------------------
def test_azure_csv_hand_written(tmp_path):
    a = load_arrivals(_write(tmp_path, AZURE))
    np.testing.assert_allclose(a.times, [0.0, 0.3, 1.31941])
    np.testing.assert_array_equal(a.prompt_lens, [374, 396, 10])
    np.testing.assert_array_equal(a.output_lens, [44, 109, 1])
    assert a.block_ids is None and a.source == "trace.txt"


def test_mooncake_jsonl_hand_written(tmp_path):
    a = load_arrivals(_write(tmp_path, MOONCAKE))
    np.testing.assert_allclose(a.times, [0.0, 0.25, 0.25, 1.0])
    np.testing.assert_array_equal(a.prompt_lens, [1100, 600, 1024, 20])
    np.testing.assert_array_equal(a.output_lens, [5, 3, 1, 2])
    assert [b.tolist() for b in a.block_ids] == [[0, 1, 2], [0, 1], [0, 7], [9]]


@pytest.mark.parametrize("text, fmt", [(AZURE, "azure_csv"), (MOONCAKE, "mooncake_jsonl")])
@pytest.mark.parametrize("name", ["x.csv", "x.jsonl", "x.bin"])
def test_format_is_told_by_content_not_extension(tmp_path, text, fmt, name):
    path = _write(tmp_path, text, name)
    assert detect_format(path) == fmt
    assert load_arrivals(path).num_requests == 4 if fmt == "mooncake_jsonl" else 3


def test_unsorted_file_is_sorted_stably(tmp_path):
    text = "\n".join(MOONCAKE.splitlines()[::-1])
    a = load_arrivals(_write(tmp_path, text))
    np.testing.assert_allclose(a.times, [0.0, 0.25, 0.25, 1.0])
    np.testing.assert_array_equal(a.prompt_lens, [1100, 1024, 600, 20])  # ties: file order


# (counts, span s, prompt mean, output mean) from src/eldr/data/workloads/README.md
@pytest.mark.parametrize("name, n, span, prompt_mean, output_mean", [
    ("azure_conv", 19_366, 3_502, 1_155, 211),
    ("mooncake_conv", 12_031, 3_537, 12_035, 343),
])
def test_shipped_traces_match_their_readme(name, n, span, prompt_mean, output_mean):
    a = default_arrivals(name)
    assert a.num_requests == n
    assert round(a.span_s) == span
    assert round(a.prompt_lens.mean()) == prompt_mean
    assert round(a.output_lens.mean()) == output_mean
    assert a.times[0] == 0 and (np.diff(a.times) >= 0).all()
    assert (a.block_ids is not None) == (name == "mooncake_conv")


def test_shipped_names_are_the_documented_ones():
    assert set(DEFAULT_ARRIVALS) == {"azure_conv", "mooncake_conv"}
    with pytest.raises(ValueError, match="unknown shipped arrivals 'sharegpt'"):
        default_arrivals("sharegpt")


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, line, field", [
    (AZURE.replace(",396,", ",3x6,"), 3, "ContextTokens"),
    (AZURE.replace(",109", ",-1"), 3, "GeneratedTokens"),
    (AZURE.replace("18:15:46.9805900", "18:15"), 3, "TIMESTAMP"),
    (AZURE.replace("2023-11-16 18:15:48", "2023-13-16 18:15:48"), 5, "TIMESTAMP"),
    (AZURE.replace(",10,1", ",10"), 5, "*"),
    (MOONCAKE.replace('"input_length": 600', '"input_length": "600"'), 2, "input_length"),
    (MOONCAKE.replace('"output_length": 1,', '"output_length": -1,'), 3, "output_length"),
    (MOONCAKE.replace('"timestamp": 1000', '"timestamp": true'), 4, "timestamp"),
    (MOONCAKE.replace('"timestamp": 1000', '"timestamp": 1000.5'), 4, "timestamp"),
    (MOONCAKE.replace('[0, 7]', '[0, -7]'), 3, "hash_ids"),
    (MOONCAKE.replace(', "hash_ids": [9]', ""), 4, "hash_ids"),
    (MOONCAKE.replace('"input_length": 20,', '"input_length": 20'), 4, "*"),
    (MOONCAKE + "[1, 2]\n", 5, "*"),
])
def test_malformed_line_names_file_line_and_field(tmp_path, text, line, field):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=rf"trace\.txt: line {line}, field '{field}'"):
        load_arrivals(path)


@pytest.mark.parametrize("text, match", [
    ("", "empty file"),
    ("\n\n", "empty file"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests after the header"),
    ("time,prompt,output\n1,2,3\n", "neither a Mooncake JSON object nor an Azure CSV"),
])
def test_files_without_requests_are_refused(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_arrivals(_write(tmp_path, text))


def test_size_cap_and_missing_file_and_binary(tmp_path):
    path = _write(tmp_path, MOONCAKE)
    with pytest.raises(ValueError, match="above the 100-byte limit"):
        load_arrivals(path, max_bytes=100)
    with pytest.raises(ValueError, match="no such file"):
        load_arrivals(tmp_path / "absent.csv")
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_arrivals(bad)


def test_record_validation():
    with pytest.raises(ValueError, match="non-decreasing"):
        _arrivals([0.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="block_ids has 1 entries for 2"):
        RequestArrivals(times=np.zeros(2), prompt_lens=np.ones(2, int),
                        output_lens=np.ones(2, int), block_ids=(np.zeros(1),), source="x")
    with pytest.raises(ValueError, match="prompt_lens must be >= 0"):
        RequestArrivals(times=np.zeros(1), prompt_lens=np.array([-1]),
                        output_lens=np.ones(1, int), block_ids=None, source="x")


# -- replay -----------------------------------------------------------------------------------
def test_scaling_keeps_order_and_exact_gap_ratios_and_hits_the_rate():
    a = _arrivals([0.0, 1.0, 1.5, 4.0, 4.0, 10.0])  # mean rate 5 / 10 = 0.5 req/s
    s = scale_to_rate(a, 2.0)
    np.testing.assert_array_equal(s.times, a.times * 0.25)  # one factor: 0.5 / 2
    assert s.mean_rate == pytest.approx(2.0, rel=1e-12)
    ga, gs = np.diff(a.times), np.diff(s.times)
    np.testing.assert_allclose(gs[ga > 0] / ga[ga > 0], 0.25, rtol=1e-12)
    assert (gs[ga == 0] == 0).all()  # simultaneous arrivals stay simultaneous (bursts kept)
    np.testing.assert_array_equal(s.prompt_lens, a.prompt_lens)


@pytest.mark.parametrize("rate", [5.0, 20.0, 100.0])
def test_scaling_a_shipped_trace_hits_the_rate_and_keeps_its_bursts(rate):
    a = default_arrivals("azure_conv")
    s = scale_to_rate(a, rate)
    assert s.mean_rate == pytest.approx(rate, rel=1e-9)
    np.testing.assert_allclose(s.times * (rate / a.mean_rate), a.times, rtol=1e-12, atol=1e-9)
    # the coefficient of variation of the gaps (burstiness) is scale-free
    ga, gs = np.diff(a.times), np.diff(s.times)
    assert gs.std() / gs.mean() == pytest.approx(ga.std() / ga.mean(), rel=1e-9)


def test_scale_needs_a_positive_rate_and_two_arrivals():
    with pytest.raises(ValueError, match="rate must be finite and > 0"):
        scale_to_rate(_arrivals([0.0, 1.0]), 0.0)
    with pytest.raises(ValueError, match=">= 2 arrivals"):
        scale_to_rate(_arrivals([0.0]), 1.0)


def test_window_and_head():
    a = _arrivals([0.0, 1.0, 2.0, 3.0, 4.0])
    w = window(a, 1.0, 2.5)
    np.testing.assert_array_equal(w.times, [0.0, 1.0, 2.0])
    assert head(a, 2).num_requests == 2 and head(a, 9).num_requests == 5
    with pytest.raises(ValueError, match="head: n must be"):
        head(a, -1)
    times, index = sim_arrivals(w)
    np.testing.assert_array_equal(times, w.times)
    np.testing.assert_array_equal(index, [0, 1, 2])


def test_clip_keeps_leading_tokens_and_fits_the_context(tmp_path):
    a = load_arrivals(_write(tmp_path, MOONCAKE))
    c = clip_lengths(a, 700)
    np.testing.assert_array_equal(c.prompt_lens, [699, 600, 699, 20])
    np.testing.assert_array_equal(c.output_lens, [1, 3, 1, 2])
    assert (c.prompt_lens + c.output_lens <= 700).all()
    assert [b.tolist() for b in c.block_ids] == [[0, 1], [0, 1], [0, 7], [9]]
    with pytest.raises(ValueError, match="max_context_tokens must be an integer >= 2"):
        clip_lengths(a, 1)


# -- routing for the replayed lengths ---------------------------------------------------------
def test_trace_has_exact_lengths_and_shared_leading_blocks_share_token_ids(tmp_path):
    a = load_arrivals(_write(tmp_path, MOONCAKE))
    t = arrivals_trace(a, "qwen3-30b-a3b", seed=1)
    assert t.num_requests == 4
    np.testing.assert_array_equal(t.prompt_lens, a.prompt_lens)
    np.testing.assert_array_equal(t.output_lens, a.output_lens)
    assert t.domain_names[0] == "english"  # the language mixture (conversation traces)
    p = [t.prompt_tokens(r) for r in range(4)]
    np.testing.assert_array_equal(p[0][:600], p[1])  # blocks [0, 1] shared, 600 tokens
    np.testing.assert_array_equal(p[0][:512], p[2][:512])  # block 0 shared
    assert (p[0][512:1024] != p[2][512:1024]).mean() > 0.99  # block 1 vs block 7
    assert (p[3][:20] != p[0][:20]).mean() > 0.9
    h = [block_hashes(x, t.meta.block_size) for x in p]
    assert h[0][:37] == h[1][:37]  # 600 // 16 full blocks: every one shared
    assert h[0][:32] == h[2][:32] and h[0][32] != h[2][32]


def test_token_ids_depend_on_block_ids_only():
    kw = dict(times=np.zeros(2), output_lens=np.array([1, 1]), source="x")
    a = RequestArrivals(prompt_lens=np.array([512, 30]), block_ids=(np.array([5]),
                        np.array([5])), **kw)
    b = RequestArrivals(prompt_lens=np.array([30, 512]), block_ids=(np.array([5]),
                        np.array([5])), **kw)
    ta, tb = arrivals_trace(a, "qwen3-30b-a3b", seed=0), arrivals_trace(b, "qwen3-30b-a3b",
                                                                       seed=9)
    np.testing.assert_array_equal(ta.prompt_tokens(0)[:30], tb.prompt_tokens(0))
    np.testing.assert_array_equal(ta.prompt_tokens(1), tb.prompt_tokens(0))


def test_tokens_past_the_listed_blocks_are_unique_to_their_request():
    a = RequestArrivals(times=np.zeros(2), prompt_lens=np.array([40, 40]),
                        output_lens=np.array([2, 2]), block_ids=(np.zeros(0), np.zeros(0)),
                        source="x")
    t = arrivals_trace(a, "qwen3-30b-a3b")
    assert (t.prompt_tokens(0) != t.prompt_tokens(1)).mean() > 0.9


def test_azure_trace_has_no_token_ids_and_output_zero_becomes_one():
    a = RequestArrivals(times=np.array([0.0, 1.0]), prompt_lens=np.array([7, 9]),
                        output_lens=np.array([0, 3]), block_ids=None, source="x")
    t = arrivals_trace(a, "qwen3-30b-a3b", "task")
    assert t.prompt_token_ids is None
    np.testing.assert_array_equal(t.output_lens, [1, 3])
    assert t.meta.source.endswith("+arrivals:x")


def test_calibration_and_replay_share_structure_but_not_requests(tmp_path):
    a = load_arrivals(_write(tmp_path, MOONCAKE))
    calib, replay = calibration_and_replay(a, "qwen3-30b-a3b", num_calibration=5, seed=2)
    assert calib.num_requests == 5 and replay.num_requests == 4
    np.testing.assert_array_equal(replay.prompt_lens, a.prompt_lens)
    assert set(calib.prompt_lens) <= set(a.prompt_lens)  # real lengths, resampled
    np.testing.assert_array_equal(replay.prompt_tokens(1), replay.prompt_tokens(0)[:600])
    with pytest.raises(ValueError, match="num_calibration must be a positive integer"):
        calibration_and_replay(a, "qwen3-30b-a3b", num_calibration=0)


def test_replay_through_the_simulator_keeps_the_scaled_arrivals(tmp_path):
    from eldr.routing import make_policy
    from eldr.sim import SimConfig, simulate

    a = scale_to_rate(load_arrivals(_write(tmp_path, MOONCAKE)), 6.0)
    trace = arrivals_trace(a, "qwen3-30b-a3b")
    cfg = SimConfig(num_prefill=2, num_decode=2, qps=6.0, warmup_s=0.0, duration_s=1.0,
                    prefix_caching=True)
    res = simulate(trace, cfg, make_policy("jsq", num_workers=2), arrivals=sim_arrivals(a))
    rec = res.requests
    np.testing.assert_array_equal(rec["t_arrival"], a.times)
    np.testing.assert_array_equal(rec["prompt_len"], a.prompt_lens)
    np.testing.assert_array_equal(rec["finishes"], np.ones(4))
    assert rec["cached_tokens"].sum() > 0  # the shared Mooncake blocks hit the prefix cache
