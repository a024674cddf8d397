"""Routing on the prompt (eldr.proxy.request.prompts): token ids as vLLM's server makes
them, the prediction standing in where a prefill signature is missing (stock vLLM
prefills, short prompts), and the fallbacks counted."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from _prompt_data import two_domain_trace
from _proxy_fakes import cluster, domain_counts, fake_encoder, run
from eldr.proxy.config import ServeConfig
from eldr.proxy.request.decision import prompt_routing
from eldr.proxy.request.prompts import (
    PromptRouting,
    PromptTokenizer,
    RequestPrompt,
    Untokenizable,
    prompt_token_ids,
    tokenizer_dir_for,
)

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

TINY = tokenizer_dir_for("tiny_moe")
TINY_PATH = Path(TINY)
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CODE_IDS = [11, 12, 13]  # the fake predictor's "code" prompt (token ids)
LAW_IDS = [21, 22, 23]


def _tok(tmp_path=None, template: str | None = TEMPLATE) -> PromptTokenizer:
    path = None
    if template is not None:
        path = tmp_path / "chat.jinja"
        path.write_text(template)
    return PromptTokenizer(TINY, chat_template=path)


def _reference(text: str, special: bool) -> list[int]:
    tok = tokenizers.Tokenizer.from_file(f"{TINY}/tokenizer.json")
    return tok.encode(text, add_special_tokens=special).ids


# -- token ids ----------------------------------------------------------------------------
def test_completions_ids_need_no_tokenizer_and_text_is_encoded_as_vllm_does():
    ids = prompt_token_ids({"prompt": [5, 6, 7]}, "completions", None)
    assert ids.dtype == np.int64 and ids.tolist() == [5, 6, 7]
    assert prompt_token_ids({"prompt": [[5, 6]]}, "completions", None).tolist() == [5, 6]
    tok = PromptTokenizer(TINY)
    text = "def add(a, b): return a + b"
    assert prompt_token_ids({"prompt": text}, "completions", tok).tolist() == \
        _reference(text, True)
    assert prompt_token_ids({"prompt": [text]}, "completions", tok).tolist() == \
        _reference(text, True)
    assert prompt_token_ids({"prompt": text, "add_special_tokens": False}, "completions",
                            tok).tolist() == _reference(text, False)


def test_chat_is_rendered_with_its_template_then_encoded_without_special_tokens(tmp_path):
    tok = _tok(tmp_path)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "text", "text": "there"}]}]
    got = prompt_token_ids({"messages": messages}, "chat", tok).tolist()
    text = "<|system|>be brief\n<|user|>hi\nthere\n<|assistant|>"
    assert tok.render(
        [messages[0], {"role": "user", "content": "hi\nthere"}]) == text
    assert got == _reference(text, False)
    no_prompt = prompt_token_ids({"messages": messages, "add_generation_prompt": False},
                                 "chat", tok).tolist()
    assert no_prompt == _reference(text[:-len("<|assistant|>")], False)


@pytest.mark.parametrize(("body", "kind", "reason"), [
    ({"prompt": ["a", "b"]}, "completions", "untokenizable"),  # a batch
    ({"prompt": [[1], [2]]}, "completions", "untokenizable"),
    ({"prompt": "x", "prompt_embeds": "AAAA"}, "completions", "untokenizable"),
    ({"prompt": "text"}, "completions", "no_tokenizer"),
    ({"messages": [{"role": "user", "content": "x"}]}, "chat", "no_tokenizer"),
    ({"prompt": ""}, "completions", "untokenizable"),
    ({"prompt": [True, 2]}, "completions", "untokenizable"),
])
def test_prompts_that_give_no_ids_say_why(body, kind, reason):
    with pytest.raises(Untokenizable) as err:
        prompt_token_ids(body, kind, None)
    assert err.value.reason == reason


def test_chats_the_router_cannot_render_say_why(tmp_path):
    plain = PromptTokenizer(TINY)  # the tiny MoE's folder has no chat template
    msg = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(Untokenizable) as err:
        prompt_token_ids(msg, "chat", plain)
    assert err.value.reason == "no_chat_template"
    image = {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "x"}}]}]}
    failing = _tok(tmp_path, "{{ raise_exception('no system role') }}")
    for body, tok in ((image, _tok(tmp_path)), (msg, failing), ({"messages": []}, plain)):
        with pytest.raises(Untokenizable) as err:
            prompt_token_ids(body, "chat", tok)
        assert err.value.reason == "untokenizable"


def test_a_request_is_tokenized_once():
    calls = []

    class Counting(PromptTokenizer):
        def encode(self, text, *, add_special_tokens=True):
            calls.append(text)
            return super().encode(text, add_special_tokens=add_special_tokens)

    tok = Counting(TINY)
    prompt = RequestPrompt({"prompt": "one two"}, "completions")
    first = prompt.token_ids(tok)
    assert prompt.token_ids(tok)[0] is first[0] and first[1] == "ok" and len(calls) == 1


def test_tokenizer_folders_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        PromptTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizers file"):
        PromptTokenizer(tmp_path)
    assert tokenizer_dir_for("some/other/model") is None
    assert tokenizer_dir_for(TINY) == TINY


# -- the artifact's predictor and the router's tokenizer -----------------------------------
class _Predictor:
    def __init__(self, fingerprint: str) -> None:
        self.tokenizer_fingerprint = fingerprint
        self.vocab_size = 4096


class _Artifact:
    model = "tiny_moe"

    def __init__(self, fingerprint: str) -> None:
        self.prompt_predictor = _Predictor(fingerprint)

    def route_inputs_from_prompt(self, ids):
        return _predict(ids)


def _config(**kw) -> ServeConfig:
    return ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",), **kw)


def test_a_tokenizer_of_another_vocabulary_is_refused():
    ours = PromptTokenizer(TINY).fingerprint
    routing = prompt_routing(_Artifact(ours), _config())
    assert routing.tokenizer is not None and routing.fingerprint == ours
    with pytest.raises(ValueError, match="not the one the artifact's prompt predictor"):
        prompt_routing(_Artifact("0" * 64), _config(tokenizer=TINY))
    assert prompt_routing(object(), _config()) is None  # no predictor: no prompt routing


def test_without_a_known_tokenizer_only_token_id_prompts_are_predicted():
    art = _Artifact("")
    art.model = "elsewhere"
    routing = prompt_routing(art, _config())
    assert routing.tokenizer is None


# -- the flow: the prediction where the prefill has no signature ----------------------------
def _predict(ids):
    """The fake model's inputs: prompts holding token 11 look like code."""
    counts = domain_counts("code" if 11 in np.asarray(ids).tolist() else "law")
    if np.asarray(ids).max() >= 4096:
        raise ValueError("token id outside the vocabulary")
    signature = fake_encoder().transform(counts).reshape(-1)
    profile = (counts / counts.sum(axis=1, keepdims=True) * 4).astype(np.float32)
    return signature.astype(np.float32), profile


def with_prompt(router, tokenizer=None) -> None:
    router.swap(dataclasses.replace(router.state, prompt=PromptRouting(
        predict=_predict, tokenizer=tokenizer, fingerprint="")))


async def tokenizer_ready(router, tokenizer) -> None:
    """Wait until the router's tokenizer processes have loaded ``tokenizer``."""
    import asyncio

    await asyncio.gather(*map(asyncio.wrap_future, router.flow.prompts.prepare(tokenizer)))


def _m(router, name, **labels):
    return getattr(router.metrics, name).get(**labels)


def test_stock_prefills_are_routed_on_the_prompt():
    """Prefills answer no expert counts (vLLM without the plugin): the prediction routes."""
    async def go():
        async with cluster(engine_kw={"payload": "none"}) as (router, client, _, decoders):
            with_prompt(router)
            got = []
            for ids in (CODE_IDS, LAW_IDS, CODE_IDS):
                r = await client.post("/v1/completions", json={"model": "tiny", "prompt": ids})
                got.append((r.status, r.headers["X-Eldr-Decoder"]))
            return router, got, decoders

    router, got, decoders = run(go())
    assert got == [(200, "w-code"), (200, "w-other"), (200, "w-code")]
    assert _m(router, "route_inputs", source="prompt") == 3
    assert _m(router, "route_inputs", source="prefill") == 0
    assert _m(router, "predictions", result="ok") == 3
    assert _m(router, "signatures", source="none") == 3  # the prefill had none
    assert _m(router, "fallbacks", reason="missing") == 0
    assert all("eldr" not in d["kv_transfer_params"] for d in decoders[0].requests)


def test_a_prefill_signature_wins_over_the_prediction():
    async def go():
        async with cluster() as (router, client, _, _d):
            with_prompt(router)
            # the prompt's ids look like law, its text (the fake prefill's counts) like code
            r = await client.post("/v1/completions",
                                  json={"model": "tiny", "prompt": "write code now"})
            return router, r.headers["X-Eldr-Decoder"]

    router, decoder = run(go())
    assert decoder == "w-code"
    assert _m(router, "route_inputs", source="prefill") == 1
    assert _m(router, "predictions", result="ok") == 0  # never tokenized


def test_text_prompts_are_tokenized_by_the_router():
    code_text = PromptTokenizer(TINY)

    async def go():
        async with cluster(engine_kw={"payload": "none"}) as (router, client, _, _d):
            with_prompt(router, code_text)  # its tokenizer process starts
            await tokenizer_ready(router, code_text)
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "a b"})
            return router, r.status

    router, status = run(go())
    assert status == 200 and _m(router, "predictions", result="ok") == 1
    assert _m(router, "route_inputs", source="prompt") == 1


def test_short_prompts_are_routed_on_the_prompt_too():
    async def go():
        async with cluster(short_prompt_tokens=8) as (router, client, prefills, _d):
            with_prompt(router)
            got = []
            for ids in (LAW_IDS, CODE_IDS):
                r = await client.post("/v1/completions", json={"model": "tiny", "prompt": ids})
                got.append(r.headers["X-Eldr-Decoder"])
            return router, got, prefills

    router, got, prefills = run(go())
    assert got == ["w-other", "w-code"] and not prefills[0].requests  # no prefill
    assert _m(router, "short_prompts") == 2
    assert _m(router, "fallbacks", reason="short_prompt") == 0
    assert _m(router, "route_inputs", source="prompt") == 2


@pytest.mark.parametrize(("body", "result"), [
    ({"prompt": [1, 99999]}, "invalid"),  # outside the predictor's vocabulary
    ({"prompt": "text, and no tokenizer"}, "no_tokenizer"),
    ({"prompt": [[1], [2]]}, "untokenizable"),
])
def test_unpredictable_prompts_are_routed_by_load_and_counted(body, result):
    async def go():
        async with cluster(engine_kw={"payload": "none"}) as (router, client, _, _d):
            with_prompt(router)
            r = await client.post("/v1/completions", json={"model": "tiny", **body})
            return router, r.status

    router, status = run(go())
    assert status == 200
    assert _m(router, "predictions", result=result) == 1
    assert _m(router, "fallbacks", reason="missing") == 1
    assert _m(router, "route_inputs", source="none") == 1


def test_load_only_policies_never_tokenize():
    async def go():
        async with cluster(policy="jsq", engine_kw={"payload": "none"}) as (router, client,
                                                                            _, _d):
            with_prompt(router)
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x y"})
            return router, r.status

    router, status = run(go())
    assert status == 200 and _m(router, "route_inputs", source="none") == 1
    assert sum(_m(router, "predictions", result=r) for r in ("ok", "no_tokenizer")) == 0


def test_metrics_page_lists_route_inputs():
    async def go():
        async with cluster() as (_, client, _p, _d):
            await client.post("/v1/completions", json={"model": "tiny", "prompt": "code x"})
            return await (await client.get("/metrics")).text()

    page = run(go())
    assert 'eldr_route_inputs_total{source="prefill"} 1.0' in page
    assert 'eldr_prompt_predictions_total{result="ok"} 0.0' in page


# -- a real artifact with a prompt predictor --------------------------------------------------
@pytest.fixture(scope="module")
def predicting_artifact(tmp_path_factory):
    art_mod = pytest.importorskip("eldr.fit.artifact")
    pytest.importorskip("eldr.fit.prompt")
    art = art_mod.fit_artifact(two_domain_trace(), worker_ids=("w-code", "w-other"), tau=0.0,
                               tokenizer=TINY, random_state=0)
    if getattr(art, "prompt_predictor", None) is None:
        pytest.skip("this eldr fits no prompt predictor")
    out = tmp_path_factory.mktemp("art") / "artifact"
    art_mod.save(art, out)
    return out


def test_serve_refuses_a_tokenizer_the_predictor_was_not_fitted_with(predicting_artifact,
                                                                     tmp_path, capsys):
    import json as _json

    from eldr.cli import main

    other = tmp_path / "other"
    other.mkdir()
    doc = _json.loads((TINY_PATH / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)  # one token renamed: another vocabulary
    (other / "tokenizer.json").write_text(_json.dumps(doc))
    rc = main(["serve", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10",
               "--decode", "http://127.0.0.1:11", "--artifact", str(predicting_artifact),
               "--policy", "eldr", "--tokenizer", str(other), "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "not the one the artifact's prompt predictor was fitted with" in err[0]


def test_a_real_predictor_routes_stock_prefills(predicting_artifact):
    """The artifact's own predictor behind the router: each prompt (token ids) reaches the
    decoder whose centroid is nearest its predicted signature."""
    from eldr.fit import artifact as art_mod
    from eldr.proxy.request.decision import build_state

    art = art_mod.load(predicting_artifact)
    prompts = [list(range(i, i + 12)) for i in (0, 45, 20, 60)]
    want = []
    for ids in prompts:
        sig, _ = art.route_inputs_from_prompt(np.asarray(ids))
        want.append(("w-code", "w-other")[int(np.argmax(
            np.asarray(art.centroids) @ np.asarray(sig).reshape(-1)))])

    async def go():
        async with cluster(engine_kw={"payload": "none"}) as (router, client, _, _d):
            config = dataclasses.replace(router.config, artifact=str(predicting_artifact),
                                         tokenizer=TINY)
            state = build_state(config)
            router.swap(state, config)
            got = []
            for ids in prompts:
                r = await client.post("/v1/completions", json={"model": "tiny", "prompt": ids})
                got.append(r.headers["X-Eldr-Decoder"])
            return router, got

    router, got = run(go())
    assert got == want and set(got) == {"w-code", "w-other"}
    assert _m(router, "route_inputs", source="prompt") == len(prompts)


@pytest.mark.parametrize("cached, decoder, source", [
    (2, "w-code", "prompt"),  # 1 of 3 tokens counted: the prediction routes
    (1, "w-other", "prefill"),  # 2 of 3 counted: the (partial) signature still routes
])
def test_a_signature_of_less_than_half_the_prompt_gives_way_to_the_prediction(
        cached, decoder, source):
    """The prefill took part of the prompt from a cache (a KV connector's store) and counted
    only the rest; its counts say law, the prompt's ids say code."""
    async def go():
        async with cluster() as (router, client, prefills, _d):
            with_prompt(router)
            prefills[0].cached_tokens = cached
            r = await client.post("/v1/completions", json={"model": "tiny",
                                                           "prompt": CODE_IDS})
            return router, r.status, r.headers["X-Eldr-Decoder"]

    router, status, got = run(go())
    assert status == 200 and got == decoder
    assert _m(router, "route_inputs", source=source) == 1
    assert _m(router, "partial") == 1  # counted as partial either way
