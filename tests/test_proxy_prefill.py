"""eldr.proxy.request.prefill: the prefill leg's request, its kv_transfer_params, and
what its answer says (the leg through stand-in engines is in tests/test_proxy_flow.py)."""

import dataclasses
import json

from _proxy_fakes import cluster, run
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
