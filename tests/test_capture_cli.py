"""``eldr capture``: prompt file parsing and one end-to-end run on a tiny random MoE."""

import json

import numpy as np
import pytest

from eldr.cli import main
from eldr.commands.capture import read_prompts


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_read_prompts(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"prompt": "a b", "domain": "x"}, "",
                                      {"prompt": "c", "domain": "y"}])
    assert read_prompts(p) == (["a b", "c"], ["x", "y"])
    p = _write(tmp_path / "q.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert read_prompts(p) == (["a", "b"], None)


@pytest.mark.parametrize(("rows", "match"), [
    (["{not json"], "not valid JSON"),
    ([{"text": "a"}], "string 'prompt'"),
    ([{"prompt": ""}], "empty prompt"),
    ([{"prompt": "a", "domain": 3}], "'domain' must be a string"),
    ([{"prompt": "a", "domain": "x"}, {"prompt": "b"}], "line 2 has no 'domain'"),
    ([], "no prompts"),
])
def test_read_prompts_refuses(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        read_prompts(_write(tmp_path / "p.jsonl", rows))


def test_missing_model_folder_is_exit_2(tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    rc = main(["capture", "--model", str(tmp_path / "nope"), "--prompts", str(prompts),
               "-o", str(tmp_path / "t.npz")])
    assert rc == 2 and "no config.json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world", "bonjour le monde", "def f(x): return x"],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[], max_position_embeddings=128, eos_token_id=0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return out


def test_capture_command_writes_a_trace(tmp_path, tiny_model_dir, capsys):
    from eldr.traces.trace import load

    prompts = _write(tmp_path / "p.jsonl", [{"prompt": "hello world", "domain": "en"},
                                            {"prompt": "bonjour le monde", "domain": "fr"},
                                            {"prompt": "def f(x)", "domain": "code"}])
    out = tmp_path / "t.npz"
    rc = main(["capture", "--model", str(tiny_model_dir), "--prompts", str(prompts),
               "--max-new-tokens", "3", "--limit", "2", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    trace = load(out)
    assert trace.num_requests == 2 and trace.domain_names == ("en", "fr")
    assert trace.meta.num_layers == 2 and trace.meta.num_experts == 8
    assert trace.meta.source == "captured:transformers"
    assert (trace.output_lens <= 3).all()
    np.testing.assert_array_equal(trace.prefill_counts.sum(axis=2),
                                  2 * trace.prompt_lens[:, None].repeat(2, axis=1))
    # the prompt token ids ride along and decode back to the prompt texts
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert [tok.decode(trace.prompt_tokens(r)) for r in range(2)] == ["hello world",
                                                                       "bonjour le monde"]
