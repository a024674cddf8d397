"""JSON on the request path: ``orjson`` where it gives the same values as the standard
library, ``json`` everywhere else.

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

:func:`dumps` writes a value the same way round: ``orjson``'s text (compact, UTF-8) reads
back as the value ``json.dumps``'s text does, and a value ``orjson`` cannot write so (a
float that is not finite, which it writes as ``null``; an integer outside 64 bits, a
string that is not valid UTF-8, a key that is not a string) goes to ``json.dumps``. It
writes the ``kv_transfer_params`` the decode request carries: 3–5 µs of ``json`` per
request, 0.5 with ``orjson``.

``orjson`` is an optional extra (``pip install -e '.[serve]'``); without it every text goes
to ``json``.
"""

from __future__ import annotations

import json

try:  # optional (the serve extra); the standard library parses everything without it
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = ["dumps", "fast", "loads"]

_BIG = float(2**63)  # orjson reads integers outside 64 bits as floats at least this large
_SCALARS = frozenset({str, int, bool, type(None)})


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
            if not _not_plain(value):
                return value
    return json.loads(raw)


def dumps(value) -> bytes:
    """JSON text (UTF-8) of ``value`` that reads back as ``json.dumps(value)`` does
    (module docstring); ``json``'s exceptions for what it cannot write."""
    if _orjson is not None and not _not_plain(value):
        try:
            return _orjson.dumps(value)
        except TypeError:  # a big int, a non-str key, a lone surrogate: json's business
            pass
    return json.dumps(value).encode()


def _not_plain(value) -> bool:
    """Whether ``value`` holds a float of magnitude 2**63 or more or not finite, or
    anything but dicts, lists, str, int, bool, None and floats (a tuple, a float or str
    subclass: ``orjson`` may write those otherwise than ``json``). Elements are checked in
    the loop, without a function call each (a prompt of token ids is a list of thousands
    of ints)."""
    kind = type(value)
    if kind is float:
        return not -_BIG < value < _BIG
    if kind is dict:
        items = value.values()
    elif kind is list:
        items = value
    else:
        return kind not in _SCALARS
    for item in items:
        kind = type(item)
        if kind is float:
            if not -_BIG < item < _BIG:
                return True
        elif kind is dict or kind is list:
            if _not_plain(item):
                return True
        elif kind not in _SCALARS:
            return True
    return False
