import asyncio
import json
from pathlib import Path

import pytest

from eldr.proxy.bodies import (
    BadEvent,
    ByteBudget,
    SSEUsage,
    decode_body,
    fix_usage,
    ints_only,
    json_object,
    parse_body,
    prompt_token_bound,
)
from eldr.proxy.errors import ProxyError


def run(coro):
    return asyncio.run(coro)


def test_fix_usage():
    u = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert fix_usage(u, 7) and u == {"prompt_tokens": 7, "completion_tokens": 3,
                                     "total_tokens": 10}
    assert not fix_usage(u, 7)
    assert not fix_usage(None, 7) and not fix_usage(u, None)


def test_sse_usage_rewrites_events_split_across_chunks():
    ev1 = b'data: {"choices": [{"text": "a"}]}\n\n'
    ev2 = b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}\n\n'
    stream = ev1 + ev2 + b"data: [DONE]\n\n"
    fixer = SSEUsage(5)
    out = b"".join(fixer.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))
    out += fixer.flush()
    events = out.split(b"\n\n")
    assert events[0] + b"\n\n" == ev1 and events[2] == b"data: [DONE]"
    assert json.loads(events[1][6:])["usage"] == {"prompt_tokens": 5, "completion_tokens": 2,
                                                  "total_tokens": 7}
    assert SSEUsage(None).feed(b"x") == b"x"


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "n": 1} \n', b'{"prompt":"x","n":1}'])
def test_decode_body_splices_or_reserialises(raw):
    body = json.loads(raw)
    kvp = {"remote_engine_id": "e", "remote_block_ids": [1]}
    assert json.loads(decode_body(body, raw, kvp)) == {**body, "kv_transfer_params": kvp}
    assert decode_body(body, raw, None) == raw
    old = {**body, "kv_transfer_params": {"stale": True}}
    assert json.loads(decode_body(old, json.dumps(old).encode(), kvp)) == \
        {**body, "kv_transfer_params": kvp}
    assert json.loads(decode_body(old, None, None)) == body


def test_byte_budget_waits_in_order_and_survives_cancellation():
    async def go():
        b = ByteBudget(10)
        await b.acquire(6)
        second = asyncio.ensure_future(b.acquire(6))
        third = asyncio.ensure_future(b.acquire(1))  # fits, but waits its turn (FIFO)
        await asyncio.sleep(0.01)
        states = [second.done(), third.done()]
        second.cancel()
        await asyncio.sleep(0.01)  # the cancelled head no longer blocks the queue
        states.append(third.done())
        b.release(6)
        b.release(1)
        return states, b.used

    assert run(go()) == ([False, False, True], 0)


def test_json_object_is_none_for_anything_but_an_object():
    assert json_object(b'{"a": 1}') == {"a": 1}
    for raw in (b"[1]", b"<html>", b'"x"', b"[" * 100_000 + b"]" * 100_000, b"\xff"):
        assert json_object(raw) is None


def test_a_usage_event_that_does_not_parse_is_a_bad_event():
    fixer = SSEUsage(5)
    with pytest.raises(BadEvent):
        fixer.feed(b'data: {"usage": {"prompt_tokens": 1}, "x": [}\n\n')
    with pytest.raises(BadEvent, match="longer than"):
        SSEUsage(5).feed(b"data: " + b"y" * (5 << 20))


# -- parse_body: vLLM's refusals, recorded from vLLM 0.32 by scripts/record_vllm_errors.py --
VLLM = json.loads((Path(__file__).parent / "data" / "vllm_error_bodies.json").read_text())
ROUTER_CHECKED = {"body", "body.stream", "body.max_tokens", "body.max_completion_tokens",
                  "max_tokens", "max_completion_tokens"}


def _probe_id(row):
    return f"{row['endpoint']}-{json.dumps(row['body'])[:60]}"


@pytest.mark.parametrize("row", VLLM, ids=_probe_id)
def test_parse_body_refuses_what_vllm_refuses_and_nothing_it_accepts(row):
    kind = "chat" if row["endpoint"] == "chat" else "completions"
    raw = row["body"].encode("latin-1") if row["raw"] else json.dumps(row["body"]).encode()
    try:
        parse_body(raw, kind)
    except ProxyError as exc:
        assert row["status"] == exc.status == 400, "the router refused what vLLM accepts"
        answer = row["answer"]
        if "error" in answer:  # else FastAPI's own {"detail"} for undecodable bytes
            assert json.loads(exc.body()) == answer  # field for field, message included
        return
    # accepted: vLLM accepted too, or refuses it itself at the prefill (relayed verbatim),
    # or it is the context-length check the application makes with the engine's limit
    if row["status"] != 200:
        err = row["answer"]["error"]
        assert err["param"] not in ROUTER_CHECKED or "max_model_len" in err["message"], err


def test_error_parity_examples_from_issue_14():
    with pytest.raises(ProxyError) as info:
        parse_body(b'{"prompt": "x", "max_tokens": -5}', "completions")
    assert json.loads(info.value.body()) == {"error": {
        "message": "max_tokens must be at least 1, got -5. (parameter=max_tokens, value=-5)",
        "type": "BadRequestError", "param": "max_tokens", "code": 400}}
    body = parse_body(b'{"prompt": "x", "stream": "yes", "max_tokens": "5"}', "completions")
    assert body["stream"] is True and body["max_tokens"] == 5  # read as vLLM reads them
    body = parse_body(b'{"messages": [], "max_tokens": -5, "max_completion_tokens": 3}', "chat")
    assert body["max_completion_tokens"] == 3  # the one vLLM uses


def test_parse_body_matches_pydantic_lax_reading():
    pydantic = pytest.importorskip("pydantic")
    as_int = pydantic.TypeAdapter(int | None)
    as_bool = pydantic.TypeAdapter(bool | None)
    values = ["5", " 5 ", "+5", "-5", "5.0", "5.00", "5.5", "1e3", "0x10", "5_000", "5__0", "",
              "٥", "yes", "YES", " yes", "t", "on", "off", "n", "0", "1", "1.0", 5.0, 5.5, 0.0,
              1.0, 2, -1, 0, 1, True, False, None, [], {}, float("inf"), 10 ** 30]
    for key, adapter in (("max_tokens", as_int), ("stream", as_bool)):
        for v in values:
            try:
                want = adapter.validate_python(v)
            except pydantic.ValidationError as exc:
                want = exc.errors()[0]["type"]
            try:
                got = parse_body(json.dumps({"prompt": "x", "echo": True, key: v}).encode(),
                                 "completions")[key]
            except ProxyError as exc:
                got = exc.message.split("'type': '")[1].split("'")[0] \
                    if "validation error" in exc.message else "range"
            if want is not None and key == "max_tokens" and not isinstance(want, str) \
                    and want < 0:
                want = "range"
            assert got == want, (key, v)


def test_utf16_bodies_are_accepted_and_reencoded_for_the_decoder():
    raw = json.dumps({"prompt": "héllo"}).encode("utf-16")
    body = parse_body(raw, "completions")
    out = decode_body(body, raw, {"k": 1})
    assert json.loads(out) == {"prompt": "héllo", "kv_transfer_params": {"k": 1}}


@pytest.mark.parametrize("body, kind, bound", [
    ({"prompt": "hi"}, "completions", 2),
    ({"prompt": "héllo"}, "completions", 6),  # UTF-8 bytes: >= byte-level BPE tokens
    ({"prompt": [1, 2, 3]}, "completions", 3),  # token ids: exact
    ({"prompt": [[1, 2], [3]]}, "completions", None),  # a batch: never short
    ({"prompt": ["a", "b"]}, "completions", None),
    ({"prompt": [1, True]}, "completions", None),
    ({"prompt": "x", "prompt_embeds": "AAAA"}, "completions", None),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "yo"}]}, "chat", 4),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}, "chat", 3),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "chat", None),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, "chat", 0),
    ({"messages": None}, "chat", None),
    ({"messages": [{"role": "user", "content": 5}]}, "chat", None),
])
def test_prompt_token_bound(body, kind, bound):
    assert prompt_token_bound(body, kind) == bound


def test_prompt_token_bound_stops_counting_at_its_cap():
    assert prompt_token_bound({"prompt": "x" * 10_000}, "completions", cap=32) == 32
    assert prompt_token_bound({"prompt": "é" * 20}, "completions", cap=32) == 32
    assert prompt_token_bound({"prompt": "é" * 10}, "completions", cap=32) == 20
    assert prompt_token_bound({"prompt": list(range(100))}, "completions", cap=32) == 32
    chat = {"messages": [{"role": "user", "content": "x" * 20}] * 3}
    assert prompt_token_bound(chat, "chat", cap=32) == 32


class _Int(int):
    """An int subclass: an int to isinstance, not to type()."""


@pytest.mark.parametrize("values", [
    [], [0], [1, 2, 3], list(range(5000)), [1, True], [True], [1, 2.0], [1, "2"],
    [1, None], [1, [2]], [_Int(3), 4], [_Int(3)], [False, 0], [1 << 70, -5],
])
def test_ints_only_answers_as_the_isinstance_generator(values):
    expected = all(isinstance(t, int) and not isinstance(t, bool) for t in values)
    assert ints_only(values) is expected
    parsed = json.loads(json.dumps(values))  # as a body gives them: plain ints and bools
    assert ints_only(parsed) is all(type(t) is int for t in parsed)


def test_byte_budget_try_acquire_takes_only_what_fits_with_nobody_waiting():
    async def go():
        b = ByteBudget(10)
        took = [b.try_acquire(6), b.try_acquire(6)]  # the second does not fit
        waiter = asyncio.ensure_future(b.acquire(3))  # 6 + 3 fits: granted at once
        await asyncio.sleep(0)
        took.append(waiter.done())
        late = asyncio.ensure_future(b.acquire(4))  # does not fit: waits
        await asyncio.sleep(0)
        took.append(b.try_acquire(1))  # fits, but someone waits first (FIFO)
        b.release(6)
        await late
        return took, b.used

    assert run(go()) == ([True, False, True, False], 7)
