"""Base-91 fixed-width digits: non-negative integers as a JSON-safe ASCII string.

The payload of version 2 (:mod:`eldr.capture.payload`) carries its counts as text inside a
JSON document. Base64 plus zlib (version 1) cost the router several times more per payload
(docs/capture.md times both versions): CPython's base64 decoder walks the string a
character at a time and inflating adds more.
Here a value is ``w`` digits of base 91 whose alphabet is the printable ASCII characters
``#`` (35) to ``~`` (126) without ``\\`` (92): none needs escaping in JSON, so the string
crosses the wire and the JSON parser untouched, and decoding is vectorised numpy:

- w = 1 (values < 91): one ``np.take`` through a 256-entry table;
- w = 2 (values < 8,281): the string's bytes read as little-endian uint16 pairs, one
  ``np.take`` through a 65,536-entry table (256 KiB, built once);
- w = 3 (values < 753,571): three digit columns combined arithmetically.

Characters outside the alphabet decode to :data:`INVALID` (larger than any value), so one
``max`` both bounds the values and rejects foreign characters.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BASE", "INVALID", "MAX_WIDTH", "decode_digits", "encode_digits", "width_for"]

BASE = 91
MAX_WIDTH = 3
INVALID = 1 << 30  # what a character outside the alphabet decodes to
_ALPHABET = np.array([c for c in range(35, 127) if c != 92], dtype=np.uint8)  # (91,)
_LIMITS = (BASE, BASE**2, BASE**3)  # exclusive bound of a w-digit value, w = 1, 2, 3

_DIGIT = np.full(256, INVALID, dtype=np.int32)  # byte -> digit value (INVALID if foreign)
_DIGIT[_ALPHABET] = np.arange(BASE)
_PAIR: np.ndarray | None = None  # (65536,) int32: uint16 of two characters -> value
_ENCODE2: np.ndarray | None = None  # (8281,) '<u2': value -> its two characters


def width_for(max_value: int) -> int:
    """The fewest digits (1..3) that hold ``max_value``; ValueError if none does."""
    for w, limit in enumerate(_LIMITS, start=1):
        if max_value < limit:
            return w
    raise ValueError(f"value {max_value} needs more than {MAX_WIDTH} base-{BASE} digits "
                     f"(at most {_LIMITS[-1] - 1})")


def _pair_tables() -> tuple[np.ndarray, np.ndarray]:
    global _PAIR, _ENCODE2
    if _PAIR is None or _ENCODE2 is None:
        code = np.arange(1 << 16)
        first = _DIGIT[code & 0xFF].astype(np.int64)  # little-endian: 1st char = low byte
        second = _DIGIT[code >> 8].astype(np.int64)
        pair = first * BASE + second
        pair[(first == INVALID) | (second == INVALID)] = INVALID
        pair = pair.astype(np.int32)
        value = np.arange(BASE * BASE)
        hi, lo = np.divmod(value, BASE)
        enc = _ALPHABET[hi].astype("<u2") | (_ALPHABET[lo].astype("<u2") << 8)
        _PAIR, _ENCODE2 = pair, enc.astype("<u2")
    return _PAIR, _ENCODE2


def encode_digits(values: np.ndarray, width: int) -> str:
    """``width`` base-91 digits per value of a flat non-negative integer array.

    The caller picks ``width`` with :func:`width_for` (values are not re-checked here:
    a value ≥ 91**width or < 0 is the caller's bug and raises IndexError from numpy).
    """
    v = np.asarray(values).ravel()
    if width == 1:
        return np.take(_ALPHABET, v).tobytes().decode("ascii")
    if width == 2:
        return np.take(_pair_tables()[1], v).tobytes().decode("ascii")
    if width == 3:
        hi, rest = np.divmod(v.astype(np.int64), BASE * BASE)
        mid, lo = np.divmod(rest, BASE)
        out = np.empty((v.size, 3), dtype=np.uint8)
        out[:, 0], out[:, 1], out[:, 2] = _ALPHABET[hi], _ALPHABET[mid], _ALPHABET[lo]
        return out.tobytes().decode("ascii")
    raise ValueError(f"width must be 1, 2 or 3, got {width!r}")


def decode_digits(text: str, width: int) -> np.ndarray:
    """(len(text) // width,) int32 values; a foreign character gives :data:`INVALID`.

    ``len(text)`` must be a multiple of ``width`` and ``text`` ASCII (ValueError else).
    """
    if width not in (1, 2, 3):
        raise ValueError(f"width must be 1, 2 or 3, got {width!r}")
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("digits: non-ASCII character") from None
    if len(raw) % width:
        raise ValueError(f"digits: {len(raw)} characters is not a multiple of {width}")
    # the tables' own take: np.take's dispatch adds a microsecond to a 6,144-value payload
    if width == 2:
        return _pair_tables()[0].take(np.frombuffer(raw, dtype="<u2"))
    digits = _DIGIT.take(np.frombuffer(raw, dtype=np.uint8))
    if width == 1:
        return digits
    d = digits.reshape(-1, 3).astype(np.int64)
    out = (d[:, 0] * BASE + d[:, 1]) * BASE + d[:, 2]
    out[(d == INVALID).any(axis=1)] = INVALID
    return out.astype(np.int32)
