"""The decode engines' payload in a decode answer: read it, strip it (docs/capture.md).

A decode engine with the eldr plugin ends each decode leg's answer with its decode counts
(:mod:`eldr.capture.decode`): in a JSON answer as ``kv_transfer_params["eldr_decode"]``,
in a stream as one extra event ``data: {"eldr_decode": {...}}`` before ``data: [DONE]``.
The router takes it out before the client sees a byte of it, so the client's answer is
the one a plain instance gives: the JSON key is cut out of the raw bytes (no
re-serialisation; ``kv_transfer_params`` the plugin created itself, marked ``own``,
becomes ``null`` again, as a plain decode answers), and the event is dropped.

A payload that does not validate is still stripped, counted (``result="invalid"``) and
ignored: it never fails the request.
"""

from __future__ import annotations

import functools
import json
import re

from eldr.capture.decode import DECODE_KEY, DecodeReport, decode_decode_payload
from eldr.proxy import jsontext
from eldr.proxy.bodies import MAX_EVENT_BYTES, BadEvent

__all__ = ["DecodeStripper", "decode_report", "read_report", "record_payload", "strip_json"]

_KEY = b'"' + DECODE_KEY.encode() + b'"'
_EVENT = b"data: {" + _KEY + b":"
_KV = re.compile(rb'"kv_transfer_params"\s*:\s*\{\s*$')


def read_report(obj: object) -> DecodeReport | None:
    """The validated report of a payload object, or None when it does not validate."""
    try:
        return decode_decode_payload(obj)
    except ValueError:
        return None


@functools.cache
def _report_key():
    from aiohttp import web

    return (web.RequestKey("eldr_decode_report", object) if hasattr(web, "RequestKey")
            else "eldr_decode_report")


def record_payload(request, metrics, inst, payload: object) -> DecodeReport | None:
    """Read a stripped payload: count it, observe its measured distinct experts for the
    decoder, and keep the report on the client's request for the learner."""
    report = read_report(payload)
    metrics.decode_payloads.inc(result="invalid" if report is None else "read")
    if report is not None:
        if report.steps:
            metrics.decode_distinct.observe(report.mean_distinct, decoder=inst.name)
        request[_report_key()] = report
    return report


def decode_report(request) -> DecodeReport | None:
    """The decode report the decoder's answer to ``request`` carried, if any."""
    return request.get(_report_key())


def _value_end(raw: bytes, i: int) -> int:
    """Index just past the JSON value starting at ``raw[i]`` (an object, string...)."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(raw)):
        c = raw[j]
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:  # backslash
                esc = True
            elif c == 0x22:
                in_str = False
            continue
        if c == 0x22:
            in_str = True
        elif c in b"{[":
            depth += 1
        elif c in b"}]":
            depth -= 1
            if depth == 0:
                return j + 1
        elif depth == 0 and c in b",}":
            return j
    raise ValueError("unterminated JSON value")


def strip_json(raw: bytes) -> tuple[bytes, object]:
    """(the answer without the payload, the payload object or None when there was none).

    The key is found in the raw bytes and cut out with its comma; the rest of the bytes are
    untouched. A ``kv_transfer_params`` left holding nothing, when the payload says the
    plugin created it (``own``), becomes ``null``. Bytes it cannot cut cleanly (a
    malformed answer) are parsed and re-serialised without the key instead.
    """
    at = raw.rfind(_KEY)
    if at < 0:
        return raw, None
    try:
        colon = raw.index(b":", at + len(_KEY))
        start = colon + 1
        while raw[start] in b" \t\r\n":
            start += 1
        end = _value_end(raw, start)
        payload_raw = raw[start:end]
        try:
            payload = jsontext.loads(payload_raw)
        except ValueError:
            payload = payload_raw  # invalid: still stripped
        before, after = raw[:at], raw[end:]
        stripped_before = before.rstrip()
        if stripped_before.endswith(b","):  # "...", "eldr_decode": {...}
            out = stripped_before[:-1] + after
        else:  # first key: drop the comma after it, if any
            rest = after.lstrip()
            out = before + (rest[1:].lstrip() if rest.startswith(b",") else rest)
            m = _KV.search(before)
            own = isinstance(payload, dict) and payload.get("own") == 1
            if m is not None and own and rest.startswith(b"}"):
                out = before[:m.start()] + b'"kv_transfer_params":null' + rest[1:]
        return out, payload
    except (ValueError, IndexError):
        return _strip_parsed(raw)


def _strip_parsed(raw: bytes) -> tuple[bytes, object]:
    try:
        doc = jsontext.loads(raw)
        params = doc.get("kv_transfer_params")
        payload = params.pop(DECODE_KEY)
    except (ValueError, AttributeError, KeyError, TypeError, RecursionError):
        return raw, None  # no key after all (it was inside a text): nothing to take out
    if not params and isinstance(payload, dict) and payload.get("own") == 1:
        doc["kv_transfer_params"] = None
    return json.dumps(doc).encode(), payload


class DecodeStripper:
    """Drops the payload event from an SSE byte stream and keeps its object.

    Whole events (up to the last blank line) pass through at once; a partial event is held
    until its blank line only when it could be the payload event (its start matches).
    """

    def __init__(self) -> None:
        self.payload: object = None
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._tail + chunk
        self._tail = b""
        if _KEY not in data and not self._maybe_partial(data):
            return data
        out = []
        pos = 0
        while True:
            at = data.find(_EVENT, pos)
            if at < 0 or (at > 0 and not data[:at].endswith(b"\n\n")):
                if at < 0:
                    break
                pos = at + 1  # inside another event: not ours
                continue
            end = data.find(b"\n\n", at)
            if end < 0:
                if len(data) - at > MAX_EVENT_BYTES:
                    raise BadEvent(f"an SSE event longer than {MAX_EVENT_BYTES} bytes")
                out.append(data[:at])
                self._tail = data[at:]
                return b"".join(out)
            out.append(data[:at])
            try:
                self.payload = jsontext.loads(data[at + 6:end]).get(DECODE_KEY)
            except (ValueError, AttributeError):
                self.payload = data[at + 6:end]  # invalid: stripped, reported as such
            data, pos = data[end + 2:], 0
        keep = self._partial_len(data)
        if keep:
            self._tail = data[-keep:]
            data = data[:-keep]
        out.append(data)
        return b"".join(out)

    @staticmethod
    def _partial_len(data: bytes) -> int:
        """Length of a tail of ``data`` that may be the start of the payload event: the bytes
        after its last blank line (or all of it), when they are a proper start of it.

        Only the last event can be a candidate: ``_EVENT`` holds no newline, so a longer
        tail, which holds a blank line, never starts it. One search per chunk; the loop
        over every tail length this replaced cost about 10 µs per streamed chunk."""
        tail = len(data) - data.rfind(b"\n\n") - 2 if b"\n\n" in data else len(data)
        if 0 < tail <= len(_EVENT) and _EVENT.startswith(data[len(data) - tail:]):
            return tail
        return 0

    def _maybe_partial(self, data: bytes) -> bool:
        return self._partial_len(data) > 0

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail
