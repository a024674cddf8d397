"""eldr.proxy.request.prefill: the prefill leg's request, its kv_transfer_params, and
what its answer says (the leg through stand-in engines is in tests/test_proxy_flow.py)."""

import dataclasses
import json

import pytest

from _proxy_fakes import cluster, run
from eldr.proxy.bodies import parse_body
from eldr.proxy.request.prefill import (
    PREFILL_KV_PARAMS,
    mostly_missing,
    prefill_body,
    prompt_key,
)


def test_prompt_key():
    assert prompt_key({"prompt": "héllo"}, "completions") == "héllo".encode()
    assert prompt_key({"messages": [{"role": "user", "content": "hi"}]}, "chat") == \
        b'[{"role":"user","content":"hi"}]'


def test_prefill_body():
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 4, "max_tokens": 50, "temperature": 0}
    pre = json.loads(prefill_body(body, "chat", PREFILL_KV_PARAMS))
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert pre["stream"] is False and "stream_options" not in pre and "min_tokens" not in pre
    assert pre["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert pre["temperature"] == 0 and body["max_tokens"] == 50  # the original is untouched
    assert "return_token_ids" not in pre and "return_token_ids" not in body
    # a learning router asks the prefill for the prompt's token ids (never the client's body)
    learning = json.loads(prefill_body(body, "completion", PREFILL_KV_PARAMS, token_ids=True))
    assert learning["return_token_ids"] is True and "return_token_ids" not in body


def test_a_payload_of_less_than_half_the_prompt_is_mostly_missing():
    assert mostly_missing({"tokens": 3}, 8) and not mostly_missing({"tokens": 4}, 8)
    assert not mostly_missing({"tokens": 3}, None) and not mostly_missing(None, 8)
    assert not mostly_missing({"tokens": "3"}, 8)


def test_kv_params_carry_the_mask_unless_learning_and_are_computed_once_per_state():
    async def go():
        async with cluster(policy="eldr") as (router, _client, _p, _d):
            leg, state = router.flow.prefill, router.live.state
            masked = leg.kv_params(state, False)
            again = leg.kv_params(state, False)
            whole = leg.kv_params(state, True)
            other = leg.kv_params(dataclasses.replace(state), False)
            return masked, again, whole, other

    masked, again, whole, other = run(go())
    assert masked is again and masked == other and masked is not other
    assert masked["eldr_layers"] and {**masked, "eldr_layers": None} != PREFILL_KV_PARAMS
    assert whole is PREFILL_KV_PARAMS  # a learner collects every layer


def test_decode_first_names_the_held_decoder_only_when_told_how():
    async def go():
        async with cluster(policy="jsq", decode_first=True,
                           decode_kv_params=(("w-code", '{"remote_host": "10.0.0.7"}'),)
                           ) as (router, _client, _p, _d):
            leg, state = router.flow.prefill, router.live.state
            body = {"model": "tiny", "prompt": "x"}
            return (leg.naming(body, "completions", state, "w-code", False),
                    leg.naming(body, "completions", state, "w-other", False))

    named, unnamed = run(go())
    assert unnamed is None
    kv = json.loads(named)["kv_transfer_params"]
    assert kv == {**PREFILL_KV_PARAMS, "remote_host": "10.0.0.7"}


# -- the prefill request spliced into the client's bytes ----------------------------------------
_RAWS = [  # (the client's JSON as sent, kind)
    (b'{"model": "m", "prompt": "x"}', "completions"),
    (b'{"prompt": [1, 2, 3], "max_tokens": 50, "stream": "yes", "stream_options": '
     b'{"include_usage": true}, "min_tokens": 4, "temperature": 0}\n  ', "completions"),
    (b'{"prompt":"caf\\u00e9 \xc3\xa9t\xc3\xa9","max_tokens":"7","kv_transfer_params":'
     b'{"client": 1},"max_tokens":9}', "completions"),  # a duplicate, and the client's params
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, '
     b'"max_tokens": 6, "stream": true}', "chat"),
    (b'\xef\xbb\xbf{"prompt": "with a BOM", "max_tokens": 3}', "completions"),
]
_DEFAULTS = {"stream_options": None, "min_tokens": 0}  # what a spliced request sends instead


def _parsed_alike(spliced: bytes, whole: bytes) -> tuple[dict, dict]:
    """Both requests as a JSON parser that keeps the last duplicate (Python's, vLLM's)
    reads them, the dropped fields' defaults taken out of the spliced one."""
    got = json.loads(spliced)
    got = {k: v for k, v in got.items() if not (k in _DEFAULTS and v == _DEFAULTS[k])}
    return got, json.loads(whole)


@pytest.mark.parametrize("raw,kind", _RAWS)
@pytest.mark.parametrize("token_ids", [False, True])
def test_a_spliced_prefill_request_reads_as_the_re_serialised_one(raw, kind, token_ids):
    """With the client's bytes the prefill request is those bytes plus the changed fields
    (the prompt is never encoded again), and it parses to what re-serialising the body
    gave."""
    body = parse_body(raw, kind)
    spliced = prefill_body(body, kind, PREFILL_KV_PARAMS, token_ids=token_ids, raw=raw)
    whole = prefill_body(body, kind, PREFILL_KV_PARAMS, token_ids=token_ids)
    assert spliced.startswith(raw.rstrip()[:-1] + b", ")  # the client's bytes, kept
    got, want = _parsed_alike(spliced, whole)
    assert got == want
    assert got["max_tokens"] == 1 and got["stream"] is False
    assert got["kv_transfer_params"] == PREFILL_KV_PARAMS


def test_the_spliced_tail_is_kept_per_params_object_and_bounded():
    """The encoded tail is kept per ``kv_params`` object (one per routing state): requests
    alternating between two states each get their own parameters, and a stream of new
    objects (decode-first's per-decoder params) keeps at most ``_SPLICED_KEPT`` tails."""
    from eldr.proxy.request import prefill as module

    raw = b'{"prompt": "x", "min_tokens": 2}'
    body = parse_body(raw, "completions")
    one, two = {**PREFILL_KV_PARAMS, "eldr_layers": [0]}, {**PREFILL_KV_PARAMS}
    for _ in range(2):
        for params in (one, two):
            got = json.loads(prefill_body(body, "completions", params, raw=raw))
            assert got["kv_transfer_params"] == params and got["min_tokens"] == 0
    for i in range(3 * module._SPLICED_KEPT):
        params = {**PREFILL_KV_PARAMS, "n": i}
        assert json.loads(prefill_body(body, "completions", params, raw=raw))[
            "kv_transfer_params"]["n"] == i
        assert len(module._spliced_tails) <= module._SPLICED_KEPT


def test_a_body_that_cannot_be_spliced_is_re_serialised():
    body = {"prompt": "x", "max_tokens": 5}
    whole = prefill_body(body, "completions", PREFILL_KV_PARAMS)
    utf16 = json.dumps(body).encode("utf-16")
    assert prefill_body(parse_body(utf16, "completions"), "completions", PREFILL_KV_PARAMS,
                        raw=utf16) == whole  # ASCII spliced into UTF-16 would be garbage
    assert prefill_body(body, "completions", PREFILL_KV_PARAMS, raw=None) == whole
    assert prefill_body({}, "completions", PREFILL_KV_PARAMS, raw=b"{}") == \
        prefill_body({}, "completions", PREFILL_KV_PARAMS)  # no member to follow


def test_vllm_reads_a_spliced_prefill_request_as_the_re_serialised_one():
    """vLLM 0.32's own request models (pydantic) give the same request, field for field
    (its random request id aside), for both kinds."""
    completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    for raw, kind in _RAWS:
        model = chat.ChatCompletionRequest if kind == "chat" else \
            completion.CompletionRequest
        body = parse_body(raw, kind)
        docs = [json.loads(prefill_body(body, kind, PREFILL_KV_PARAMS, raw=r))
                for r in (raw, None)]
        spliced, whole = (model.model_validate({"model": "m", **d}).model_dump(
            exclude={"request_id"}) for d in docs)
        assert spliced == whole, kind
