"""eldr.fit.prompt_vocab: a tokenizer's fingerprint and vocabulary, a model config's
vocabulary, and where a predictor's vocabulary comes from."""

import hashlib
import json

import pytest

from eldr.fit.prompt_vocab import (
    config_vocab_size,
    resolve_vocab_source,
    tokenizer_fingerprint,
    tokenizer_vocab_size,
)


def test_tokenizer_fingerprint_and_vocabulary(tmp_path):
    doc = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}},
           "added_tokens": [{"id": 7, "content": "<eos>"}]}
    raw = json.dumps(doc).encode()
    (tmp_path / "tokenizer.json").write_bytes(raw)
    fp = hashlib.sha256(raw).hexdigest()
    assert tokenizer_fingerprint(raw) == fp
    assert tokenizer_fingerprint(tmp_path) == fp
    assert tokenizer_fingerprint(tmp_path / "tokenizer.json") == fp
    assert tokenizer_fingerprint(raw + b" ") != fp
    assert tokenizer_vocab_size(tmp_path) == 8
    unigram = {"model": {"type": "Unigram", "vocab": [["a", -1.0], ["b", -2.0]]}}
    assert tokenizer_vocab_size(json.dumps(unigram).encode()) == 2
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        tokenizer_fingerprint(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"not a readable tokenizer\.json"):
        tokenizer_vocab_size(b"{not json")
    with pytest.raises(ValueError, match="no vocabulary"):
        tokenizer_vocab_size(b"{}")


def test_config_vocab_size_reads_a_models_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    assert config_vocab_size(tmp_path) == 4096
    assert config_vocab_size(tmp_path / "config.json") == 4096
    assert config_vocab_size({"text_config": {"vocab_size": 262144}}) == 262144
    from eldr.capture import tiny_moe_dir

    assert config_vocab_size(tiny_moe_dir()) == json.loads(
        (tiny_moe_dir() / "config.json").read_text())["vocab_size"]
    for bad, match in (({}, "vocab_size must be an integer"),
                       ({"vocab_size": 0}, "vocab_size must be"),
                       ({"vocab_size": True}, "vocab_size must be"),
                       ({"vocab_size": 2**31 + 1}, "vocab_size must be")):
        with pytest.raises(ValueError, match=match):
            config_vocab_size(bad)
    with pytest.raises(ValueError, match=r"no config\.json"):
        config_vocab_size(tmp_path / "none")
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        config_vocab_size(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"not a readable config\.json"):
        config_vocab_size(tmp_path)


def test_the_vocabulary_source_defaults_to_what_was_given():
    assert resolve_vocab_source(None, None, "") == "calibration"
    assert resolve_vocab_source(None, 100, "ab") == "tokenizer"
    assert resolve_vocab_source(None, 100, "") == "calibration"  # a size alone: recorded
    assert resolve_vocab_source("config", 100, "") == "config"
    with pytest.raises(ValueError, match="needs that vocabulary's vocab_size"):
        resolve_vocab_source("tokenizer", None, "ab")
    with pytest.raises(ValueError, match="vocab_source must be one of"):
        resolve_vocab_source("model", 100, "")
