"""Bodies between clients, the router and the engines: bounded reads, timed writes, usage.

What the request flow (:mod:`eldr.proxy.flow`) does with bytes, kept apart from the flow:

- :func:`read_upto` reads an engine's body up to a cap (never the whole of a runaway one);
- :class:`ByteBudget` bounds the bytes of all buffered answers together;
- :func:`within` awaits with a deadline (the write timeout for clients that never read);
- :func:`json_object` parses an upstream answer, ``None`` for anything that is not a JSON
  object (``RecursionError`` included);
- :class:`SSEUsage` and :func:`fix_usage` make ``usage`` count the whole prompt;
- :func:`decode_body` builds the decoder's request from the client's bytes;
- :func:`parse_body` checks a client's request body (a 400 naming what is wrong).
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys

from eldr.proxy.errors import ProxyError

__all__ = ["MAX_EVENT_BYTES", "SMALL_ANSWER", "BadEvent", "ByteBudget", "SSEUsage",
           "decode_body", "fix_usage", "json_object", "parse_body", "read_upto", "within"]


def fix_usage(usage: object, prompt_tokens: int | None) -> bool:
    """Make ``usage`` count the whole prompt; True if it changed (in place).

    The decoder receives the whole prompt and counts it, so this rarely changes anything;
    it guards against connectors that report only the tokens they computed.
    """
    if prompt_tokens is None or not isinstance(usage, dict):
        return False
    pt = usage.get("prompt_tokens")
    if isinstance(pt, int) and pt >= prompt_tokens:
        return False
    completion = usage.get("completion_tokens")
    usage["prompt_tokens"] = prompt_tokens
    usage["total_tokens"] = prompt_tokens + (completion if isinstance(completion, int) else 0)
    return True


# an answer this small fits below the transport's 64 KiB high-water mark, so writing it
# never waits for the client to read: at most this much can be left with a slow client
SMALL_ANSWER = 32 * 1024
MAX_EVENT_BYTES = 4 * 1024 * 1024  # an SSE event held whole (to fix its usage) above: error


class ByteBudget:
    """Bytes of buffered answers the router may hold at once, handed out first come, first
    served: a reservation that does not fit waits (the decoder's answer then waits in its
    socket: TCP backpressure) instead of growing the router without bound."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    async def acquire(self, n: int) -> None:
        if not self._waiters and self.used + n <= self.total:
            self.used += n
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as it was cancelled
            else:
                self._waiters.remove((n, fut))
                self.release(0)  # the next waiter may fit now
            raise

    def release(self, n: int) -> None:
        self.used -= n
        while self._waiters and self.used + self._waiters[0][0] <= self.total:
            size, fut = self._waiters.popleft()
            self.used += size
            fut.set_result(None)


async def read_upto(resp, limit: int) -> tuple[bytes, bool]:
    """(at most ``limit`` bytes of the body of ``resp``, whether it ended within them).

    Bodies from engines are read through this only, so an engine's answer never takes more
    memory than its cap (``max_prefill_bytes``, ``max_response_bytes``, error bodies). A
    declared length within the cap is read in one call (the common case, and faster).
    """
    size = resp.content_length
    if size is not None and size <= limit:
        return await resp.read(), True
    stream = resp.content
    buf = bytearray()
    async for chunk in stream.iter_any():
        buf += chunk
        if len(buf) > limit:
            del buf[limit:]
            return buf, False
    return buf, True  # a bytearray: no second copy of a large answer


async def within(awaitable, seconds: float):
    """``await awaitable`` with a deadline (``asyncio.TimeoutError`` past it)."""
    if sys.version_info >= (3, 11):  # a timer, not a task per call
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


class BadEvent(ValueError):
    """An SSE event the router must read (usage) does not parse: an upstream protocol error."""


def json_object(raw: bytes) -> dict | None:
    """``raw`` parsed as a JSON object, or None (invalid, nested too deep, not an object).

    Upstream answers are parsed here only: ``json.loads`` raises ``RecursionError`` (not a
    ``ValueError``) on deep nesting, and an engine's answer must never turn into a 500.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


class SSEUsage:
    """Rewrites the usage of SSE events in a byte stream; other events pass untouched.

    ``feed`` raises :class:`BadEvent` when a usage event does not parse.
    """

    def __init__(self, prompt_tokens: int | None) -> None:
        self.prompt_tokens = prompt_tokens
        self._tail = b""  # an incomplete event held until its blank line arrives

    def feed(self, chunk: bytes) -> bytes:
        if self.prompt_tokens is None:
            return chunk
        data = self._tail + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > MAX_EVENT_BYTES:  # never a blank line: bounded, not buffered on
                raise BadEvent(f"an SSE event longer than {MAX_EVENT_BYTES} bytes")
            self._tail = data
            return b""
        head, self._tail = data[: cut + 2], data[cut + 2:]
        if b'"prompt_tokens"' not in head:
            return head
        return b"".join(self._fix(ev) for ev in head.split(b"\n\n")[:-1])

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail

    def _fix(self, event: bytes) -> bytes:
        if b'"prompt_tokens"' in event and event.startswith(b"data: "):
            doc = json_object(event[6:])
            if doc is None:
                raise BadEvent("an SSE usage event is not a JSON object")
            if isinstance(doc, dict) and fix_usage(doc.get("usage"), self.prompt_tokens):
                return b"data: " + json.dumps(doc).encode() + b"\n\n"
        return event + b"\n\n"


def decode_body(body: dict, raw: bytes | None, kv_params: dict | None) -> bytes:
    """The decode request: the client's body plus the relayed ``kv_transfer_params``.

    When the client's JSON (``raw``, already parsed into ``body``) has no
    ``kv_transfer_params`` key, the field is spliced in before its closing brace instead of
    re-serialising the whole body: a long prompt is then never encoded twice.
    """
    if raw is not None and "kv_transfer_params" not in body and body:
        if kv_params is None:
            return raw
        end = raw.rstrip()
        if end.endswith(b"}"):
            return end[:-1] + b', "kv_transfer_params": ' + json.dumps(kv_params).encode() + b"}"
    dec = dict(body)
    if kv_params is None:
        dec.pop("kv_transfer_params", None)
    else:
        dec["kv_transfer_params"] = kv_params
    return json.dumps(dec).encode()


def parse_body(raw: bytes, kind: str) -> dict:
    """The request JSON object, or a 400 naming what is wrong with it.

    UTF-8 only (RFC 8259 §8.1): ``json.loads`` would also take UTF-16/32 bytes, but the
    router splices the client's raw bytes into the decoder's body next to ASCII, and a
    mixed-encoding body is rejected by the decoder after a prefill was spent. Nesting
    deeper than the parser's recursion limit is a client error too (``RecursionError``
    is not a ``ValueError``).
    """
    if b"\x00" in raw[:4]:  # UTF-16/32 without a BOM: JSON text starts with two ASCII chars
        raise ProxyError(400, "request body looks UTF-16 or UTF-32 encoded: only UTF-8 is "
                              "accepted", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProxyError(400, f"request body is not UTF-8 encoded JSON (byte {exc.start}): "
                              f"only UTF-8 is accepted", code="invalid_json") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}",
                         code="invalid_json") from None
    except RecursionError:
        raise ProxyError(400, "request body is not valid JSON: nested too deeply",
                         code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"request body must be a JSON object, got {type(body).__name__}",
                         code="invalid_json")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ProxyError(400, "'stream' must be true or false", param="stream")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ProxyError(400, f"'{key}' must be a positive integer, got {value!r}",
                             param=key)
    field = "messages" if kind == "chat" else "prompt"
    if field not in body:
        raise ProxyError(400, f"'{field}' is required", param=field)
    if kind == "chat" and not isinstance(body["messages"], list):
        raise ProxyError(400, "'messages' must be a list", param="messages")
    return body
