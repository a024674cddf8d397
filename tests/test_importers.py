"""eldr import: the two public recording layouts, the generic JSONL / NPZ layout, malformed
input (one line, exit 2), and trace format version 2 (decode-only traces, provenance,
version-1 files still loading)."""

import json
from pathlib import Path

import numpy as np
import pytest

from eldr.cli import main
from eldr.traces import REAL_TRACES, load_real_trace, real_trace_path
from eldr.traces.importers import esft_split_points, import_trace
from eldr.traces.trace import Trace, TraceMeta, concat, load, save

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "real-routing"


def _ids(rng, T, L, E, k):
    return np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)])
                     for _ in range(T)]).astype(np.int8)


@pytest.fixture
def gpt_oss_dir(tmp_path):
    """A small folder in the GPT-OSS layout (24 layers, 32 experts, top-4)."""
    tmp_path = tmp_path / "gpt-oss"
    tmp_path.mkdir()
    rng = np.random.default_rng(0)
    gen = [5, 9, 3]
    off = np.concatenate(([0], np.cumsum(gen)))
    np.savez(tmp_path / "routing.npz", expert_ids=_ids(rng, off[-1], 24, 32, 4),
             expert_probs=np.ones((off[-1], 24, 4), np.float16), offsets=off)
    plen = [4, 6, 2]
    poff = np.concatenate(([0], np.cumsum(plen)))
    np.savez(tmp_path / "tokens.npz", vocab=np.array(["a", "b"]),
             prompt_ids=rng.integers(0, 50, poff[-1]).astype(np.int32), prompt_offsets=poff,
             gen_ids=rng.integers(0, 50, off[-1]).astype(np.int32), gen_offsets=off)
    reqs = [{"dataset": d, "category": "x"} for d in ("mmlu_test", "sorry_bench_base",
                                                       "mmlu_pro_test")]
    (tmp_path / "requests.json").write_text(json.dumps(
        {"source": "s", "commit": "c", "licence": "Apache-2.0", "requests": reqs}))
    return tmp_path


@pytest.fixture
def esft_file(tmp_path):
    tmp_path = tmp_path / "esft"
    tmp_path.mkdir()
    rng = np.random.default_rng(1)
    n = [10, 7, 2]
    off = np.concatenate(([0], np.cumsum(n)))
    path = tmp_path / "routing.npz"
    np.savez(path, expert_ids=_ids(rng, off[-1], 26, 64, 6),
             expert_weights=np.ones((off[-1], 26, 6), np.float16), offsets=off,
             task=np.array(["law", "intent", "law"]))
    return path


def test_gpt_oss_layout_is_a_decode_only_trace_on_the_convention(gpt_oss_dir, tmp_path):
    t = import_trace(gpt_oss_dir)
    assert not t.has_prefill and t.prefill_counts is None and t.prefill_topk is None
    # routing row i reads generated token i: rows = decode steps, output = rows + 1
    assert t.output_lens.tolist() == [6, 10, 4] and t.prompt_lens.tolist() == [4, 6, 2]
    raw = np.load(gpt_oss_dir / "routing.npz")["expert_ids"]
    assert np.array_equal(t.decode_topk, raw.astype(np.int16))
    assert t.decode_token_ids.shape == (17,) and t.prompt_token_ids.shape == (12,)
    assert t.domain_names == ("mmlu", "mmlu_pro", "sorry_bench")
    assert t.meta.licence == "Apache-2.0" and t.meta.provenance["commit"].startswith("72b368f6")
    assert t.meta.version == 2
    back = load(save(t, tmp_path / "g.npz"))
    assert not back.has_prefill and np.array_equal(back.decode_counts, t.decode_counts)
    assert back.meta.provenance == t.meta.provenance
    assert "decode-only" in back.describe()


def test_esft_layout_splits_each_sequence_and_drops_the_last_row(esft_file):
    t = import_trace(esft_file, layout="esft", split=0.5)
    assert t.prompt_lens.tolist() == [5, 3, 1]  # floor(n/2), at least 1
    assert t.output_lens.tolist() == [5, 4, 1]  # n - s
    raw = np.load(esft_file)["expert_ids"].astype(np.int16)
    # sequence 0: prompt rows 0..4, decode rows 5..8 (row 9, reading the last token, dropped)
    assert np.array_equal(t.prefill_topk[:5], raw[:5])
    assert np.array_equal(t.decode_topk[:4], raw[5:9])
    assert t.meta.provenance["split"] == 0.5 and "DeepSeek" in t.meta.licence
    assert esft_split_points(np.array([10, 3]), 0.9).tolist() == [9, 2]
    with pytest.raises(ValueError, match="fraction"):
        import_trace(esft_file, layout="esft", split=1.5)


@pytest.mark.skipif(not (SHARED / "gpt-oss-20b").is_dir(), reason="shared recordings absent")
def test_the_shared_recordings_import_as_shipped():
    g = import_trace(SHARED / "gpt-oss-20b")
    assert g.num_requests == 620 and not g.has_prefill
    e = import_trace(SHARED / "esft-vanilla-lite")
    assert e.num_requests == 143 and e.has_prefill
    for name, t in (("gpt-oss-20b", g), ("esft-vanilla-lite", e)):
        shipped = load_real_trace(name)
        assert np.array_equal(shipped.decode_topk, t.decode_topk)
        assert np.array_equal(shipped.prompt_lens, t.prompt_lens)


def test_the_shipped_real_traces_are_small_and_name_their_licence():
    total = 0
    for name in REAL_TRACES:
        path = real_trace_path(name)
        total += path.stat().st_size
        t = load_real_trace(name)
        assert t.meta.licence and t.meta.provenance["url"].startswith("https://github.com/")
        assert t.decode_topk is not None and t.prefill_gate_prob is None
    assert total <= 25e6
    readme = (real_trace_path(REAL_TRACES[0]).parent / "README.md").read_text()
    for needle in ("72b368f6", "Apache License 2.0", "579a7711", "MIT", "DeepSeek"):
        assert needle in readme
    with pytest.raises(ValueError, match="unknown real trace"):
        real_trace_path("mixtral")


def _jsonl(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x
                              for x in lines) + "\n")
    return path


def test_generic_jsonl_per_layer_and_per_token_records(tmp_path):
    recs = [{"eldr_import": 1, "model": "mine", "num_experts": 8, "licence": "CC0"}]
    for rid, (P, D) in {"a": (3, 2), "b": (2, 4)}.items():
        for phase, n in (("prefill", P), ("decode", D)):
            for pos in range(n):
                for layer in range(2):
                    recs.append({"request": rid, "phase": phase, "layer": layer,
                                 "experts": [pos % 8, (pos + 1 + layer) % 8],
                                 "weights": [0.6, 0.4], "token": 10 + pos})
    recs.append({"request": "a", "domain": "code"})
    recs.append({"request": "b", "domain": "chat"})
    t = import_trace(_jsonl(tmp_path / "r.jsonl", recs))
    assert t.has_prefill and t.meta.model == "mine" and t.meta.licence == "CC0"
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k) == (2, 8, 2)
    assert t.prompt_lens.tolist() == [3, 2] and t.output_lens.tolist() == [3, 5]
    assert t.prompt_token_ids.tolist() == [10, 11, 12, 10, 11]
    assert t.decode_token_ids.tolist() == [10, 11, 10, 11, 12, 13]
    assert [t.domain_names[d] for d in t.domains] == ["code", "chat"]
    # one record per token with every layer; decode-only with the real prompt length
    per_token = [{"request": 7, "prompt_len": 40},
                 {"request": 7, "phase": "decode", "experts": [[0, 1], [2, 3], [4, 5]]},
                 {"request": 7, "phase": "decode", "experts": [[1, 2], [3, 4], [5, 6]]}]
    d = import_trace(_jsonl(tmp_path / "d.jsonl", per_token))
    assert not d.has_prefill and d.prompt_lens.tolist() == [40]
    assert d.output_lens.tolist() == [3] and d.meta.num_layers == 3


def test_generic_npz(tmp_path):
    rng = np.random.default_rng(2)
    experts = np.stack([np.stack([rng.choice(16, 2, replace=False) for _ in range(3)])
                        for _ in range(9)])
    path = tmp_path / "r.npz"
    np.savez(path, request=np.array([5, 5, 5, 5, 9, 9, 9, 9, 9]),
             phase=np.array(["prefill", "prefill", "decode", "decode", "prefill", "decode",
                             "decode", "decode", "decode"]), experts=experts,
             token=np.arange(9), domains=np.array(["x", "y"]))
    t = import_trace(path, layout="npz")
    assert t.prompt_lens.tolist() == [2, 1] and t.output_lens.tolist() == [3, 5]
    assert np.array_equal(t.prefill_topk, experts[[0, 1, 4]])
    assert t.prompt_token_ids.tolist() == [0, 1, 4]
    # decode-only: per-request prompt lengths
    np.savez(path, request=np.array([1, 1]), phase=np.array([1, 1]), experts=experts[:2],
             prompt_lens=np.array([12]))
    d = import_trace(path, layout="npz")
    assert not d.has_prefill and d.prompt_lens.tolist() == [12]


@pytest.mark.parametrize("lines, message", [
    (["{not json"], "not valid JSON"),
    ([{"request": "a", "phase": "prefix", "layer": 0, "experts": [1]}], "phase must be"),
    ([{"request": "a", "phase": "decode", "layer": 0, "experts": [1, 1]}], "selected twice"),
    ([{"request": "a", "phase": "decode", "layer": 0, "experts": [1, 2]},
      {"request": "a", "phase": "decode", "layer": 0, "experts": [1]}], "earlier records had 2"),
    ([{"request": "a", "phase": "decode", "layer": 0, "experts": [1]},
      {"request": "a", "phase": "decode", "layer": 1, "experts": [1]},
      {"request": "a", "phase": "decode", "layer": 0, "experts": [2]}], "lacks layer"),
    ([{"request": "a", "phase": "decode", "layer": 0, "experts": [1]}], "prompt_len"),
    ([{"request": "a", "phase": "prefill", "layer": 0, "experts": [1]},
      {"request": "b", "prompt_len": 3},
      {"request": "b", "phase": "decode", "layer": 0, "experts": [1]}], "no prefill records"),
    ([{"request": "a", "phase": "decode", "layer": 0, "experts": [1], "colour": 1}],
     "unknown key"),
    ([], "no routing records"),
])
def test_malformed_jsonl_is_one_line_and_exit_2(tmp_path, capsys, lines, message):
    path = _jsonl(tmp_path / "bad.jsonl", lines)
    assert main(["import", str(path), "-o", str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "t.npz").exists()


def test_malformed_npz_and_folders_are_one_line_and_exit_2(tmp_path, capsys, esft_file):
    cases = []
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    cases.append((tmp_path / "junk.npz", "not a readable .npz"))
    np.savez(tmp_path / "few.npz", request=np.array([1]), experts=np.zeros((1, 2, 2)))
    cases.append((tmp_path / "few.npz", "missing array"))
    np.savez(tmp_path / "oob.npz", expert_ids=np.full((4, 26, 6), 70, np.int8),
             offsets=np.array([0, 4]))
    cases.append((tmp_path / "oob.npz", "out of range"))
    (tmp_path / "empty").mkdir()
    cases.append((tmp_path / "empty", "not a known layout"))
    cases.append((tmp_path / "nothing.npz", "no such file"))
    for path, message in cases:
        assert main(["import", str(path), "-o", str(tmp_path / "t.npz")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (path, err)
    assert main(["import", str(esft_file), "--split", "0", "-o", str(tmp_path / "t.npz")]) == 2


def test_eldr_import_writes_the_trace_and_says_what_it_is(gpt_oss_dir, esft_file, tmp_path,
                                                           capsys):
    out = tmp_path / "g.npz"
    assert main(["import", str(gpt_oss_dir), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode-only" in text and "Apache-2.0" in text and load(out).num_requests == 3
    assert main(["import", str(esft_file), "--split", "0.25", "-o", str(out)]) == 0
    assert "first 0.25" in capsys.readouterr().out
    assert load(out).prompt_lens.tolist() == [2, 1, 1]


# -- format version 2 ---------------------------------------------------------------------------
def _v1_file(path, *, with_prefill=True):
    """A version-1 trace written as eldr 0.1 wrote it (no licence, no provenance)."""
    meta = {"model": "old", "num_layers": 1, "num_experts": 4, "top_k": 1, "block_size": 16,
            "source": "captured:x", "version": 1, "domain_names": None}
    arrays = {"meta_json": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
              "decode_counts": np.array([[[1, 0, 0, 0]]], np.int32),
              "prompt_lens": np.array([2]), "output_lens": np.array([2])}
    if with_prefill:
        arrays["prefill_counts"] = np.array([[[1, 1, 0, 0]]], np.int32)
    np.savez_compressed(path, **arrays)
    return path


def test_version_1_files_still_load_and_save_as_version_2(tmp_path):
    t = load(_v1_file(tmp_path / "v1.npz"))
    assert t.meta.version == 1 and t.has_prefill and t.meta.licence == ""
    assert t.meta.provenance == {}
    again = load(save(t, tmp_path / "v2.npz"))
    assert again.meta.version == 2 and np.array_equal(again.prefill_counts, t.prefill_counts)
    with pytest.raises(ValueError, match="missing trace field"):
        load(_v1_file(tmp_path / "v1b.npz", with_prefill=False))
    from eldr.capture import tiny_moe_trace_path

    assert load(tiny_moe_trace_path()).meta.version == 1  # the shipped v1 capture


def test_decode_only_traces_validate_subset_and_concat():
    meta = TraceMeta("m", 1, 4, 1, licence="MIT", provenance={"url": "u", "n": 3})
    dec = np.array([[[1, 1, 0, 0]], [[0, 0, 0, 2]]], np.int32)
    t = Trace(meta=meta, prefill_counts=None, decode_counts=dec,
              prompt_lens=np.array([5, 7]), output_lens=np.array([3, 3]),
              prompt_token_ids=np.arange(12), decode_token_ids=np.arange(4))
    sub = t.subset([1])
    assert sub.prompt_tokens(0).tolist() == list(range(5, 12))
    assert sub.decode_token_ids.tolist() == [2, 3]
    with pytest.raises(ValueError, match="decode-only"):
        t.require_prefill("the thing")
    with pytest.raises(ValueError, match="without prefill_counts"):
        Trace(meta=meta, prefill_counts=None, decode_counts=dec,
              prompt_lens=np.array([5, 7]), output_lens=np.array([3, 3]),
              prefill_topk=np.zeros((12, 1, 1), np.int16))
    full = Trace(meta=meta, prefill_counts=np.array([[[1, 0, 0, 0]]] * 2, np.int32),
                 decode_counts=dec, prompt_lens=np.array([1, 1]), output_lens=np.array([3, 3]))
    both = concat([t, full])
    assert not both.has_prefill and both.num_requests == 4
    with pytest.raises(ValueError, match="provenance"):
        TraceMeta("m", 1, 4, 1, provenance={"x": [1, 2]})


def test_commands_say_what_they_cannot_do_on_a_decode_only_trace(gpt_oss_dir, tmp_path,
                                                                 capsys):
    path = save(import_trace(gpt_oss_dir), tmp_path / "g.npz")
    assert main(["fit", str(path), "-K", "2", "-o", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err
    assert "decode-only" in err and "eldr score" in err and err.count("\n") == 1
    assert main(["score", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["has_prefill"] is False and doc["representations"] == []
    assert "n/a" in doc["representations_note"] and "n/a" in doc["prompt_predictor_note"]
    assert doc["locality"] is None and "not measured" in doc["locality_note"]  # 3 requests
