"""eldr.proxy.jsontext: msgspec's speed, json's values and refusals."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.proxy import jsontext

msgspec = pytest.importorskip("msgspec")


def _same(a, b) -> bool:
    """Equal values of equal types all the way down (1 and 1.0 differ; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


def _outcome(fn, raw):
    try:
        return "ok", fn(raw)
    except RecursionError:
        return "RecursionError", None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        return type(exc).__name__, str(exc)


def _agree(raw) -> None:
    want, got = _outcome(json.loads, raw), _outcome(jsontext.loads, raw)
    assert want[0] == got[0], (raw, want, got)
    if want[0] == "ok":
        assert _same(want[1], got[1]), (raw, want, got)
    else:
        assert want[1] == got[1]  # the same message, at the same position


def test_msgspec_is_used_when_installed():
    assert jsontext.fast()


@pytest.mark.parametrize("raw", [
    b'{"a": 1, "a": 2}',  # duplicate names: the last wins
    b'{"a": "\\ud800"}',  # a lone surrogate
    b'{"a": NaN, "b": Infinity, "c": -Infinity}',
    b'{"a": 1e400}',  # beyond float range
    b'{"max_tokens": 123456789012345678901234567890}',  # integers outside 64 bits
    b'{"a": -9223372036854775809}',
    b'{"a": 18446744073709551616}',
    b'{"a": 18446744073709551615, "b": -9223372036854775808}',  # the edges, inside
    b'{"a": 1e19, "b": -1e19, "c": 9.3e18}',  # large float literals
    b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte-order mark
    '{"a": "é"}'.encode("utf-16"), '{"a": 1}'.encode("utf-32-le"),
    b'{"a": "\xff"}',  # not UTF-8
    b"[" * 5000 + b"]" * 5000,  # deeper than either parser goes
    b"[" * 1100 + b"]" * 1100,  # deep, within json's reach
    b'{"a": -0.0, "b": 0.1e-400, "c": 2.5e-324, "d": 1E2}',
    b' {"a": [1, 2.5, "x", null, true, false, {}]} \n',
    b'{"a": 1,}', b"{'a': 1}", b"", b"nul", b'{"a": 01}', b'"just a string"', b"[1, 2",
])
def test_edge_cases_read_as_json_reads_them(raw):
    _agree(raw)


def test_a_prompt_of_token_ids_with_one_huge_id_is_read_exactly():
    ids = list(range(2048))
    ids[1500] = 2**70
    raw = json.dumps({"prompt": ids}).encode()
    assert jsontext.loads(raw)["prompt"][1500] == 2**70


_scalars = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
                     st.integers(min_value=-(2**80), max_value=2**80), st.text(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=5), inner, max_size=5)),
    max_leaves=25)


@settings(max_examples=400, deadline=None)
@given(_values)
def test_generated_documents_read_as_json_reads_them(value):
    _agree(json.dumps(value).encode())


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([b"{", b"}", b"[", b"]", b'"a"', b":", b",", b"1", b"-",
                                 b"0", b"e", b".", b"9" * 10, b"true", b"null", b"NaN",
                                 b" ", b"\\u00e9", b'"', b"\xc3\xa9", b"\xff"]),
                max_size=30).map(b"".join))
def test_generated_byte_strings_read_or_refused_as_json_does(raw):
    _agree(raw)


def test_without_msgspec_everything_goes_to_json(monkeypatch):
    monkeypatch.setattr(jsontext, "_msgspec", None)
    assert not jsontext.fast()
    assert _same(jsontext.loads(b'{"a": [1, 2.5]}'), {"a": [1, 2.5]})
    _agree(b'{"a": NaN}')


_surrogates = st.text(alphabet=st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010),
                      max_size=3)  # lone surrogates among them
_writable = st.recursive(
    st.one_of(_scalars, _surrogates),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 3)),
                                            inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(_writable)
def test_dumps_reads_back_as_json_dumps_does(value):
    want = json.dumps(value)
    got = jsontext.dumps(value)
    assert isinstance(got, bytes)
    assert _same(json.loads(want), json.loads(got)), (want, got)


@pytest.mark.parametrize("value", [
    {"a": float("nan")}, {"a": [float("inf")]}, {"a": -float("inf")},  # msgspec: null
    {1: "int key"}, {None: 1}, {True: 1}, {"a": "\ud800"}, (1, float("nan")), [(1, 2)],
])
def test_dumps_leaves_to_json_what_msgspec_would_write_otherwise(value):
    assert jsontext.dumps(value) == json.dumps(value).encode()


def test_dumps_refuses_as_json_does():
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        jsontext.dumps({"a": {1, 2}})  # msgspec would write a list


def test_dumps_writes_big_integers_exactly():
    assert json.loads(jsontext.dumps({"a": [2**70, -(2**64)]})) == {"a": [2**70, -(2**64)]}
