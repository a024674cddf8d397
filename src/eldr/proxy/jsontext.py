"""JSON on the request path: ``msgspec`` where it gives the same values as the standard
library's ``json``, ``json`` everywhere else.

Why. Every request parses three JSON texts: the client's body, the prefill's answer (with
its expert payload, 2.6–6.6 kB) and the decoder's answer, and writes the relayed
``kv_transfer_params`` into the decode request. ``json`` took 6.5, 2.6, 2.6 and 3 µs of
them on the benchmark's bodies (``benchmarks/bench_serve.py``, 2-core AMD EPYC), about a
seventh of the router's CPU per request under load in a py-spy profile of ``jsq``
(docs/serve.md, "The router's own time"); ``msgspec`` takes 2.4, 0.4, 0.5 and 0.6.

The same values, exactly. :func:`loads`: ``msgspec`` refuses some texts ``json`` accepts
(``NaN`` and ``Infinity``, numbers beyond float range, lone surrogate escapes, UTF-16/-32
and a UTF-8 byte-order mark); those, and every text it refuses, are parsed again by
``json``, so what is refused and how (the error's message and position, a
``RecursionError``) is ``json``'s. What it accepts it reads as ``json`` does, integers of
any size included (``orjson`` reads those outside 64 bits as floats, which is why it is not
used). :func:`dumps`: ``msgspec``'s text (compact, UTF-8) reads back as the value
``json.dumps``'s text does; a value it would write otherwise (a float that is not finite,
which it writes as ``null``; a set; a key that is not a string) or cannot write (a lone
surrogate) goes to ``json.dumps``. ``tests/test_proxy_jsontext.py`` checks both against
``json`` on generated documents and byte strings.

``msgspec`` is an optional extra (``pip install -e '.[serve]'``); without it everything
goes to ``json``.
"""

from __future__ import annotations

import json

try:  # optional (the serve extra); the standard library does everything without it
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - depends on the environment
    _msgspec = None

__all__ = ["dumps", "fast", "loads"]

if _msgspec is not None:
    _decode = _msgspec.json.Decoder().decode
    _encode = _msgspec.json.Encoder().encode
    _REFUSED = _msgspec.DecodeError
_SCALARS = frozenset({str, int, bool, type(None)})


def fast() -> bool:
    """Whether ``msgspec`` is there (else everything goes to ``json``)."""
    return _msgspec is not None


def loads(raw: bytes | bytearray | str):
    """``json.loads(raw)``'s value, or its exception (module docstring)."""
    if _msgspec is not None:
        try:
            return _decode(raw)
        except _REFUSED:  # json refuses it too, or reads what msgspec does not
            pass
    return json.loads(raw)


def dumps(value) -> bytes:
    """JSON text (UTF-8) of ``value`` that reads back as ``json.dumps(value)``'s does
    (module docstring); ``json``'s exceptions for what it cannot write."""
    if _msgspec is not None and _plain(value):
        try:
            return _encode(value)
        except (TypeError, ValueError):  # a lone surrogate: json writes it escaped
            pass
    return json.dumps(value).encode()


def _plain(value) -> bool:
    """Whether ``value`` is made of dicts with string keys, lists, str, int, bool, None
    and finite floats only: what ``msgspec`` writes as ``json`` does. Elements are
    checked in the loop, without a function call each."""
    kind = type(value)
    if kind is float:
        return value - value == 0.0  # finite (inf - inf and NaN are NaN)
    if kind is dict:
        for key in value:
            if type(key) is not str:
                return False
        items = value.values()
    elif kind is list:
        items = value
    else:
        return kind in _SCALARS
    for item in items:
        kind = type(item)
        if kind is float:
            if item - item != 0.0:
                return False
        elif kind is dict or kind is list:
            if not _plain(item):
                return False
        elif kind not in _SCALARS:
            return False
    return True
