"""eldr.proxy.selection.routes: the selection API's bodies checked into a Query, and every
bad field refused with a 400 that names it (the HTTP routes themselves are exercised in
tests/test_proxy_selection.py)."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.capture.payload import PAYLOAD_KEY
from eldr.proxy.errors import ProxyError
from eldr.proxy.selection.routes import parse_query

PAYLOAD = {"v": 2, "shape": [2, 4]}  # only its being an object is checked here


def test_a_select_body_becomes_its_query():
    q = parse_query({"token_ids": [5, 0, 7], PAYLOAD_KEY: PAYLOAD, "prompt_tokens": 3,
                     "candidates": ["d1", "d0", "d1"]}, reserve=False)
    assert q.token_ids.dtype == np.int64 and q.token_ids.tolist() == [5, 0, 7]
    assert q.payload == PAYLOAD and q.prompt_tokens == 3
    assert q.candidates == ("d1", "d0")  # repeats dropped, order kept
    assert (q.text, q.request_id, q.ttl) == (None, None, None)


def test_a_reserve_body_takes_an_id_and_a_ttl():
    q = parse_query({"prompt": "hello", "request_id": "r-1", "ttl": 2}, reserve=True)
    assert q.text == {"prompt": "hello"} and q.token_ids is None
    assert (q.request_id, q.ttl) == ("r-1", 2.0)


def test_the_payload_may_come_inside_kv_transfer_params():
    q = parse_query({"messages": [{"role": "user", "content": "hi"}],
                     "kv_transfer_params": {PAYLOAD_KEY: PAYLOAD, "remote": 1}},
                    reserve=False)
    assert q.payload == PAYLOAD and q.text == {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_query({}, reserve=False).payload is None  # nothing: routed by load


@pytest.mark.parametrize(("body", "reserve", "param"), [
    ({"request_id": "r"}, False, "request_id"),  # reserve's fields are not select's
    ({"ttl": 1}, False, "ttl"),
    ({"bogus": 1}, True, "bogus"),
    ({"token_ids": []}, False, "token_ids"),
    ({"token_ids": "1 2"}, False, "token_ids"),
    ({"token_ids": [1, -2]}, False, "token_ids"),
    ({"token_ids": [1, True]}, False, "token_ids"),
    ({"token_ids": [1, 2.0]}, False, "token_ids"),
    ({"token_ids": [1], "prompt": "x"}, False, "prompt"),  # one prompt at a time
    ({"prompt": "x", "messages": [{}]}, False, "messages"),
    ({"prompt": ""}, False, "prompt"),
    ({"prompt": [1, "a"]}, False, "prompt"),
    ({"messages": []}, False, "messages"),
    ({"messages": ["hi"]}, False, "messages"),
    ({"kv_transfer_params": [1]}, False, "kv_transfer_params"),
    ({PAYLOAD_KEY: PAYLOAD, "kv_transfer_params": {PAYLOAD_KEY: PAYLOAD}}, False, PAYLOAD_KEY),
    ({PAYLOAD_KEY: "abc"}, False, PAYLOAD_KEY),
    ({"kv_transfer_params": {PAYLOAD_KEY: [1]}}, False, PAYLOAD_KEY),
    ({"prompt_tokens": -1}, False, "prompt_tokens"),
    ({"prompt_tokens": True}, False, "prompt_tokens"),
    ({"candidates": []}, False, "candidates"),
    ({"candidates": ["d0", ""]}, False, "candidates"),
    ({"candidates": "d0"}, False, "candidates"),
    ({"request_id": ""}, True, "request_id"),
    ({"request_id": "x" * 257}, True, "request_id"),
    ({"request_id": 7}, True, "request_id"),
    ({"ttl": 0}, True, "ttl"),
    ({"ttl": float("inf")}, True, "ttl"),
    ({"ttl": float("nan")}, True, "ttl"),
    ({"ttl": True}, True, "ttl"),
    ({"ttl": "5"}, True, "ttl"),
])
def test_a_bad_field_is_a_400_naming_it(body, reserve, param):
    with pytest.raises(ProxyError) as err:
        parse_query(body, reserve=reserve)
    assert (err.value.status, err.value.param, err.value.code) == (400, param,
                                                                    "invalid_request")
    assert param in err.value.message


def test_too_many_token_ids_are_refused_before_they_are_converted(monkeypatch):
    import eldr.proxy.selection.routes as routes

    monkeypatch.setattr(routes, "_MAX_TOKEN_IDS", 4)
    assert parse_query({"token_ids": [1, 2, 3, 4]}, reserve=False).token_ids.size == 4
    with pytest.raises(ProxyError, match="more than 4 ids"):
        parse_query({"token_ids": [1, 2, 3, 4, 5]}, reserve=False)
