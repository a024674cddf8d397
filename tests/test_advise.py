"""eldr advise: what ELDR would buy on a user's own trace (eldr.reproduce.advise and the
command): each kind of input, the recommendation rule, too-small traces, a model from its
config.json, and bad input ending in one line with exit 2."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from _recorded_data import recorded_trace
from eldr.cli import main
from eldr.intervals import PairedInterval
from eldr.reproduce.advise import advise, prepare, recommend
from eldr.reproduce.recorded import Comparison
from eldr.traces.models import get_preset, preset_from_config
from eldr.traces.trace import save

GPT_OSS_20B = {"_name_or_path": "openai/gpt-oss-20b", "hidden_size": 2880,
               "num_hidden_layers": 24, "vocab_size": 201088, "num_local_experts": 32,
               "num_experts_per_tok": 4, "intermediate_size": 2880,
               "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
               "sliding_window": 128, "layer_types": ["sliding_attention",
                                                      "full_attention"] * 12,
               "tie_word_embeddings": False, "quantization_config": {"quant_method": "mxfp4"},
               "max_position_embeddings": 131072}
DSV2_LITE = {"hidden_size": 2048, "num_hidden_layers": 27, "vocab_size": 102400,
             "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
             "intermediate_size": 10944, "first_k_dense_replace": 1, "n_shared_experts": 2,
             "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
             "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


@pytest.mark.parametrize(("doc", "preset", "rel"), [(GPT_OSS_20B, "gpt-oss-20b", 2e-3),
                                                    (DSV2_LITE, "deepseek-v2-lite", 0.0)])
def test_a_preset_from_config_json_matches_the_hand_built_one(doc, preset, rel):
    p, ref = preset_from_config(doc, name="mine"), get_preset(preset)
    for f in ("num_layers", "num_experts", "top_k", "kv_bytes_per_token",
              "kv_sliding_bytes_per_token", "sliding_window"):
        assert getattr(p, f) == getattr(ref, f), f
    for f in ("expert_bytes", "attn_bytes_per_layer", "dense_bytes_per_step"):  # no biases
        assert getattr(p, f) == pytest.approx(getattr(ref, f), rel=rel), f


def test_a_dense_config_is_refused_by_name():
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        preset_from_config({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10,
                            "num_attention_heads": 2, "intermediate_size": 16})


def _cmp(p50, p99, *, batch=12.0, half=0.5, policies=("eldr_cost", "eldr"), met=0):
    rows = [{"policy": "jsq", "mean_batch": batch, "copies_in_flight": met, "seed": 0}]
    c = Comparison("gpt-oss-20b", "h200", 8, 50.0, "prompt", rows, "jsq", heldout=300)
    for p in policies:
        c.vs_jsq[p] = {"p50": PairedInterval(p50, half, 3), "p99": PairedInterval(p99, half, 3)}
    return c


def test_recommend_wants_a_sure_median_gain_without_a_sure_p99_loss():
    assert recommend(_cmp(-3.0, 0.0), heldout=300)[0] == "eldr_cost"
    rec, why = recommend(_cmp(-3.0, 2.0), heldout=300)  # p99 surely worse: not worth it
    assert rec == "load balancing" and "not worth it" in why
    assert recommend(_cmp(-0.8, 0.0), heldout=300)[0] == "load balancing"  # below 1 %
    assert recommend(_cmp(-3.0, 0.0, half=8.0), heldout=300)[0] == "too small to tell"
    assert recommend(_cmp(-3.0, 0.0, batch=1.2), heldout=300)[0] == "too small to tell"
    assert recommend(_cmp(-3.0, 0.0, met=2), heldout=300)[0] == "too small to tell"
    assert recommend(_cmp(-3.0, 0.0), heldout=10)[0] == "too small to tell"
    assert recommend(_cmp(-3.0, 0.0, policies=("eldr",)), heldout=300)[0] == "eldr"
    rec, why = recommend(_cmp(0, 0, policies=()), heldout=300)
    assert rec == "load balancing" and "no locality policy has a routing input" in why


def test_a_learn_export_keeps_requests_with_decode_counts_and_drops_decoder_labels():
    t = recorded_trace(prefill=True, prompt_ids=False)
    out = np.where(np.arange(t.num_requests) % 3 == 0, 1, t.output_lens)
    keep = out > 1
    t = replace(t, meta=replace(t.meta, source="learned:eldr-serve"), output_lens=out,
                decode_counts=np.where(keep[:, None, None], t.decode_counts, 0),
                decode_topk=None, prefill_topk=None, _cache={})
    trace, kind, notes = prepare(t)
    assert kind == "learned" and trace.num_requests == int(keep.sum())
    assert trace.domains is None and any("decoders eldr serve chose" in n for n in notes)
    assert any("dealt" in n for n in notes)


def test_advise_says_too_small_without_simulating():
    a = advise(recorded_trace(R=20), seeds=2)
    assert a.recommendation == "too small to tell" and a.comparison is None


def test_the_command_on_a_small_recorded_trace(tmp_path, capsys):
    path = save(recorded_trace(R=80), tmp_path / "mine.npz")
    assert main(["advise", str(path), "--decoders", "2", "--seeds", "2", "--duration",
                 "2", "--warmup", "0.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "recorded" and doc["routing_input"] == "prompt prediction"
    assert doc["recommendation"] in ("eldr_cost", "eldr", "load balancing",
                                     "too small to tell")
    assert {r["policy"] for r in doc["simulation"]["rows"]} == {"jsq", "eldr", "eldr_cost",
                                                               "oracle_signature"}
    assert doc["simulation"]["vs_jsq"]["eldr_cost"]["p50"]["n"] == 2
    assert doc["locality"]["inputs"][0]["name"] == "prompt"


def test_the_command_prints_text_and_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = save(recorded_trace(R=80, prefill=True, prompt_ids=False), tmp_path / "t.npz")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(GPT_OSS_20B))
    png = tmp_path / "advice.png"
    assert main(["advise", str(path), "--model", str(cfg), "--hardware", "h100",
                 "--decoders", "2", "--seeds", "2", "--duration", "2", "--warmup", "0.5",
                 "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "recommendation:" in text and "prefill signature" in text and "h100" in text
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(("argv", "message"), [
    (["absent.npz"], "absent.npz"),
    (["{trace}", "--model", "mixtral"], "unknown model preset"),
    (["{trace}", "--model", "qwen3-30b-a3b"], "(layers, experts, top-k)"),
    (["{trace}", "--model", "{dense}"], "not a mixture-of-experts"),
    (["{trace}", "--model", "{notjson}"], "not JSON"),
    (["{trace}", "--hardware", "a100"], "unknown hardware"),
    (["{trace}", "--seeds", "1"], "--seeds"),
    (["{notjson}"], "not an .npz trace"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    trace = save(recorded_trace(R=20), tmp_path / "t.npz")
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10,
                                 "num_attention_heads": 2}))
    notjson = tmp_path / "bad.json"
    notjson.write_text("{nope")
    args = [a.format(trace=trace, dense=dense, notjson=notjson) for a in argv]
    assert main(["advise", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
