"""JSON text to Python values on the request path: ``orjson`` where it gives the same
value as the standard library, ``json`` everywhere else.

Why. Every request parses three JSON texts: the client's body, the prefill's answer (with
its expert payload, 2.6–6.6 kB) and the decoder's answer. ``json.loads`` took 6.2, 2.5
and 2.4 µs of them on the benchmark's bodies (``benchmarks/bench_serve.py``, 2-core AMD
EPYC), and JSON a seventh of the router's CPU per request under load (a py-spy profile of
``jsq``, docs/serve.md); ``orjson.loads`` with the check below takes 4.2, 0.6 and 1.4 µs.

The same values, exactly. ``orjson`` refuses some texts ``json`` accepts (``NaN`` and
``Infinity``, lone surrogate escapes, UTF-16/-32 and a UTF-8 byte-order mark, nesting past
1,024 levels, numbers beyond float range); those, and every text it refuses, are parsed
again by ``json``, so what is refused and how (the error's message and position, a
``RecursionError``) is ``json``'s. It reads one thing differently: an integer outside
64 bits becomes a float. So a value holding a float of magnitude 2**63 or more (an
integer read as a float, or a float literal that large: rare either way) is parsed again
by ``json`` too. ``tests/test_proxy_jsontext.py`` checks that the two agree on generated
documents and byte strings.

``orjson`` is an optional extra (``pip install -e '.[serve]'``); without it every text goes
to ``json``.
"""

from __future__ import annotations

import json

try:  # optional (the serve extra); the standard library parses everything without it
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = ["fast", "loads"]

_BIG = float(2**63)  # orjson reads integers outside 64 bits as floats at least this large


def fast() -> bool:
    """Whether ``orjson`` is there to parse (for the logs and the benchmark)."""
    return _orjson is not None


def loads(raw: bytes | bytearray | str):
    """``json.loads(raw)``'s value, or its exception (module docstring)."""
    if _orjson is not None:
        try:
            value = _orjson.loads(raw)
        except _orjson.JSONDecodeError:  # json refuses it too, or reads what orjson cannot
            pass
        else:
            if not _has_big_float(value):
                return value
    return json.loads(raw)


def _has_big_float(value) -> bool:
    """Whether ``value`` (orjson's: dicts, lists, str, int, float, bool, None) holds a
    float of magnitude 2**63 or more. Elements are checked in the loop, without a function
    call each (a prompt of token ids is a list of thousands of ints)."""
    kind = type(value)
    if kind is float:
        return not -_BIG < value < _BIG
    if kind is dict:
        items = value.values()
    elif kind is list:
        items = value
    else:
        return False
    for item in items:
        kind = type(item)
        if kind is float:
            if not -_BIG < item < _BIG:
                return True
        elif (kind is dict or kind is list) and _has_big_float(item):
            return True
    return False
