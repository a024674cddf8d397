import asyncio
import json

import pytest

from eldr.proxy.bodies import BadEvent, ByteBudget, SSEUsage, decode_body, fix_usage, json_object


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
