import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from eldr.capture.hf import (  # noqa: E402
    RoutingRecorder,
    capture_ids,
    capture_texts,
    find_routers,
    to_trace,
)


def _qwen3(seed=0, layers=2, experts=8, top_k=2):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        mlp_only_layers=[], decoder_sparse_step=1, max_position_embeddings=128)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # routers start at zero: give them real, distinct logits
        for router in find_routers(model):
            router.weight.normal_(0, 1)
    return model


def _mixtral(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for router in find_routers(model):
            router.weight.normal_(0, 1)
    return model


PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 4], [10, 20, 30, 40, 50, 60, 61]]


def test_shapes_and_trace_convention():
    model = _qwen3(layers=3, experts=8, top_k=2)
    res = capture_ids(model, PROMPTS, max_new_tokens=4, progress=False)
    for prompt, r in zip(PROMPTS, res, strict=True):
        assert r.prefill_topk.shape == (len(prompt), 3, 2)
        assert r.prefill_logits.shape == (len(prompt), 3, 8)
        assert r.output_ids.shape == (4,)
        assert r.decode_topk.shape == (3, 3, 2)  # n - 1 decode passes
    trace = to_trace(res, model_name="t", num_experts=8, domains=["a", "b", "a"])
    assert trace.meta.num_layers == 3 and trace.meta.top_k == 2
    np.testing.assert_array_equal(trace.prompt_lens, [5, 3, 7])
    np.testing.assert_array_equal(trace.output_lens, [4, 4, 4])
    assert (trace.prefill_counts.sum(axis=2) == 2 * trace.prompt_lens[:, None]).all()
    assert (trace.decode_counts.sum(axis=2) == 2 * 3).all()
    assert trace.domain_names == ("a", "b") and list(trace.domains) == [0, 1, 0]
    np.testing.assert_allclose(trace.prefill_gate_prob.sum(axis=2),
                               np.repeat(trace.prompt_lens[:, None], 3, axis=1), rtol=1e-5)


@pytest.mark.parametrize("build", [_qwen3, _mixtral])
def test_topk_identity(build):
    """The recorded ids are the top-k of the recorded logits, for every token and layer."""
    model = build()
    res = capture_ids(model, PROMPTS, max_new_tokens=2, progress=False)
    k = res[0].prefill_topk.shape[2]
    for r in res:
        expect = np.argsort(-r.prefill_logits, axis=2, kind="stable")[:, :, :k]
        np.testing.assert_array_equal(np.sort(r.prefill_topk, axis=2), np.sort(expect, axis=2))


def test_decode_routing_matches_a_full_forward():
    """Routing of a token fed back through the KV cache equals its routing in one pass."""
    model = _qwen3(seed=3)
    res = capture_ids(model, [PROMPTS[0]], max_new_tokens=3, progress=False)[0]
    full = list(PROMPTS[0]) + list(res.output_ids[:2])
    with RoutingRecorder(find_routers(model)) as rec, torch.no_grad():
        model(input_ids=torch.tensor([full]))
        topk, _ = rec.take()
    np.testing.assert_array_equal(np.sort(topk[: len(PROMPTS[0])], 2),
                                  np.sort(res.prefill_topk, 2))
    np.testing.assert_array_equal(np.sort(topk[len(PROMPTS[0]):], 2),
                                  np.sort(res.decode_topk, 2))


def test_deterministic():
    a = capture_ids(_qwen3(seed=1), PROMPTS, max_new_tokens=3, progress=False)
    b = capture_ids(_qwen3(seed=1), PROMPTS, max_new_tokens=3, progress=False)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.prefill_topk, y.prefill_topk)
        np.testing.assert_array_equal(x.decode_topk, y.decode_topk)
        np.testing.assert_array_equal(x.output_ids, y.output_ids)


def test_stops_at_eos():
    model = _qwen3(seed=2)
    first = capture_ids(model, [PROMPTS[1]], max_new_tokens=1, progress=False)[0]
    eos = int(first.output_ids[0])
    res = capture_ids(model, [PROMPTS[1]], max_new_tokens=5, eos_token_id=eos,
                      progress=False)[0]
    assert res.output_ids.tolist() == [eos] and res.decode_topk.shape[0] == 0


def test_hooks_removed_after_capture():
    model = _qwen3()
    capture_ids(model, PROMPTS[:1], max_new_tokens=1, progress=False)
    assert all(not r._forward_hooks for r in find_routers(model))


def test_unsupported_architecture_is_a_clear_error():
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="'llama' is not supported"):
        find_routers(model)


def test_bad_arguments():
    model = _qwen3()
    with pytest.raises(ValueError, match="max_new_tokens"):
        capture_ids(model, PROMPTS, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt 0"):
        capture_ids(model, [[]], max_new_tokens=1, progress=False)


class _CharTokenizer:
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 64 for c in text]}


def test_capture_texts_builds_a_trace():
    trace = capture_texts(_qwen3(), _CharTokenizer(), ["hello", "hi"], max_new_tokens=2,
                          domains=["x", "y"], max_prompt_tokens=3, progress=False)
    np.testing.assert_array_equal(trace.prompt_lens, [3, 2])
    assert trace.meta.source == "captured:transformers"
    # the prompt token ids are recorded, truncated like the routing, requests in order
    assert trace.prompt_token_ids.dtype == np.int32
    np.testing.assert_array_equal(trace.prompt_tokens(0), [ord(c) % 64 for c in "hel"])
    np.testing.assert_array_equal(trace.prompt_tokens(1), [ord(c) % 64 for c in "hi"])
    with pytest.raises(ValueError, match="domain labels"):
        capture_texts(_qwen3(), _CharTokenizer(), ["a"], max_new_tokens=1, domains=[])


def test_bfloat16_model_is_recorded():
    """A bf16 model (as run on a GPU) is recorded as float32 numpy. (The .cpu() in
    take() that a CUDA model needs cannot be exercised without a GPU.)"""
    model = _qwen3(seed=4).to(torch.bfloat16)
    with RoutingRecorder(find_routers(model)) as rec, torch.no_grad():
        model(input_ids=torch.tensor([PROMPTS[2]]))
        topk, logits = rec.take()
    assert topk.shape == (len(PROMPTS[2]), 2, 2) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
