"""Bodies between clients, the router and the engines: bounded reads, timed writes, usage.

What the request flow (:mod:`eldr.proxy.request.flow`) does with bytes, kept apart from the flow:

- :func:`read_upto` reads an engine's body up to a cap (never the whole of a runaway one);
- :class:`ByteBudget` bounds the bytes of all buffered answers together;
- :func:`within` awaits with a deadline (the write timeout for clients that never read);
- :func:`json_object` parses an upstream answer, ``None`` for anything that is not a JSON
  object (``RecursionError`` included);
- :class:`SSEUsage` and :func:`fix_usage` make ``usage`` count the whole prompt;
- :func:`decode_body` builds the decoder's request from the client's bytes;
- :func:`parse_body` checks a client's request body, refusing what vLLM refuses (a 400 in
  vLLM's error shape) and nothing it accepts;
- :func:`prompt_token_bound` bounds a prompt's tokens (short prompts skip the prefill).
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import re
import sys

from eldr.proxy import jsontext
from eldr.proxy.errors import ProxyError

__all__ = ["MAX_EVENT_BYTES", "SMALL_ANSWER", "BadEvent", "ByteBudget", "SSEUsage",
           "decode_body", "fix_usage", "ints_only", "is_utf8", "json_object", "parse_body",
           "prompt_token_bound", "read_upto", "within"]


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

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` bytes now if they fit and nobody waits (True), else nothing (False).
        The common case, without the coroutine and timer an awaited :meth:`acquire` costs."""
        if not self._waiters and self.used + n <= self.total:
            self.used += n
            return True
        return False

    async def acquire(self, n: int) -> None:
        if self.try_acquire(n):
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

    Upstream answers are parsed here only (:func:`eldr.proxy.jsontext.loads`: ``json``'s
    values, faster): ``json.loads`` raises ``RecursionError`` (not a
    ``ValueError``) on deep nesting, and an engine's answer must never turn into a 500.
    """
    try:
        doc = jsontext.loads(raw)
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


def is_utf8(raw: bytes) -> bool:
    """True unless ``raw`` is UTF-16/32 JSON (a NUL in its first four bytes, or their BOM)."""
    return b"\x00" not in raw[:4] and not raw.startswith((b"\xff\xfe", b"\xfe\xff"))


def decode_body(body: dict, raw: bytes | None, kv_params: dict | None) -> bytes:
    """The decode request: the client's body plus the relayed ``kv_transfer_params``.

    When the client's JSON (``raw``, already parsed into ``body``) has no
    ``kv_transfer_params`` key, the field is spliced in before its closing brace instead of
    re-serialising the whole body: a long prompt is then never encoded twice. A UTF-16 or
    -32 body is re-serialised (as UTF-8): ASCII spliced into it would be garbage.
    """
    if raw is not None and "kv_transfer_params" not in body and body and is_utf8(raw):
        if kv_params is None:
            return raw
        end = raw.rstrip()
        if end.endswith(b"}"):
            return end[:-1] + b', "kv_transfer_params": ' + jsontext.dumps(kv_params) + b"}"
    dec = dict(body)
    if kv_params is None:
        dec.pop("kv_transfer_params", None)
    else:
        dec["kv_transfer_params"] = kv_params
    return json.dumps(dec).encode()


def _summary(value: object) -> str:
    """The ``input`` vLLM shows in a validation error (bounded, containers described)."""
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def _invalid(kind: str, loc: str, msg: str, value: object, **extra: object) -> ProxyError:
    """The 400 vLLM answers when pydantic refuses one field: type "Bad Request", param
    ``body.<field>``, the message listing the error as vLLM formats it."""
    err = {"type": kind, "loc": loc, "msg": msg, "input": _summary(value), **extra}
    return ProxyError(400, f"1 validation error:\n  {err}", param=loc, err_type="Bad Request",
                      code="invalid_request")


_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0*)?")
_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))


def _lax_int(key: str, value: object) -> int | None:
    """``value`` as pydantic's lax ``int | None`` reads it (vLLM's request models)."""
    if value is None or isinstance(value, int):  # bool included: True is 1
        return None if value is None else int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _invalid("finite_number", f"body.{key}", "Input should be a finite number",
                           value)
        if not value.is_integer():
            raise _invalid("int_from_float", f"body.{key}", "Input should be a valid integer, "
                           "got a number with a fractional part", value)
        return int(value)
    if isinstance(value, str):
        text = value.strip(" \t\n\r")
        if _INT_TEXT.fullmatch(text):
            return int(text.split(".")[0])
        raise _invalid("int_parsing", f"body.{key}", "Input should be a valid integer, unable "
                       "to parse string as an integer", value)
    raise _invalid("int_type", f"body.{key}", "Input should be a valid integer", value)


def _lax_bool(key: str, value: object) -> bool | None:
    """``value`` as pydantic's lax ``bool | None`` reads it: "yes", 1, 0.0... are accepted."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value in (0, 1):
            return bool(value)
        if abs(value) >= 2 ** 63:  # past pydantic's i64: not a number it parses
            raise _invalid("bool_type", f"body.{key}", "Input should be a valid boolean",
                           value)
    elif isinstance(value, float):
        if value in (0.0, 1.0):
            return bool(value)
        if not value.is_integer():  # 2.0 is read as the integer 2: a parsing error below
            raise _invalid("bool_type", f"body.{key}", "Input should be a valid boolean",
                           value)
    elif isinstance(value, str):
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
    else:
        raise _invalid("bool_type", f"body.{key}", "Input should be a valid boolean", value)
    raise _invalid("bool_parsing", f"body.{key}", "Input should be a valid boolean, unable to "
                   "interpret input", value)


def parse_body(raw: bytes, kind: str) -> dict:
    """The request JSON object, refused (a 400) exactly when vLLM would refuse it.

    The router checks only what it must before the prefill: that the body is a JSON object,
    ``stream`` (it decides how to relay the answer), ``max_tokens`` /
    ``max_completion_tokens`` (the prefill runs with 1, so the decoder alone would see
    them), and the prompt or messages vLLM requires (a prefill saved). It reads them as
    vLLM's request models do (pydantic's lax mode: ``"yes"`` is true, ``"5"`` and ``5.0``
    are 5, a chat's ``max_completion_tokens`` wins over ``max_tokens``, ``max_tokens`` 0 is
    allowed with ``echo``) and writes the values read back into the returned dict; its
    refusals carry vLLM's body field for field (tests/data/vllm_error_bodies.json was
    recorded from vLLM 0.32). Everything else (a prompt of the wrong type, empty
    messages...) is left to the prefill engine, whose 4xx is relayed verbatim. Encodings
    are JSON's (UTF-8, -16 or -32, as ``json.loads`` detects them); nesting deeper than the
    parser's recursion limit is a client error too.
    """
    if not raw:
        raise _invalid("missing", "body", "Field required", None)
    try:
        body = jsontext.loads(raw)
    except UnicodeDecodeError:
        raise ProxyError(400, "There was an error parsing the body: it is not UTF-8, -16 or "
                              "-32 encoded JSON", code="invalid_json") from None
    except ValueError as exc:
        pos = getattr(exc, "pos", 0)
        raise _invalid("json_invalid", f"body.{pos}", "JSON decode error", {},
                       ctx={"error": getattr(exc, "msg", str(exc))}) from None
    except RecursionError:
        raise ProxyError(400, "request body is not valid JSON: nested too deeply",
                         code="invalid_json") from None
    if not isinstance(body, dict):
        raise _invalid("model_attributes_type", "body", "Input should be a valid dictionary "
                       "or object to extract fields from", body)
    if "stream" in body:
        body["stream"] = _lax_bool("stream", body["stream"])
    max_tokens = _lax_int("max_tokens", body.get("max_tokens"))
    effective, name = max_tokens, "max_tokens"
    if "max_tokens" in body:
        body["max_tokens"] = max_tokens
    if kind == "chat":
        completion = _lax_int("max_completion_tokens", body.get("max_completion_tokens"))
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = completion
        if completion is not None:
            effective = completion
    if kind == "chat":
        if "messages" not in body:
            raise _invalid("missing", "body.messages", "Field required", body)
        if body["messages"] is not None and not isinstance(body["messages"], list):
            raise _invalid("list_type", "body.messages", "Input should be a valid list",
                           body["messages"])
    elif body.get("prompt") in (None, "") and body.get("prompt_embeds") in (None, []):
        raise ProxyError(400, "Either prompt or prompt_embeds must be provided and non-empty. "
                              "(parameter=prompt)", param="prompt", code="invalid_request")
    echo = kind != "chat" and _lax_bool("echo", body.get("echo")) is True
    if effective is not None and effective < 1 and not (effective == 0 and echo):
        raise ProxyError(400, f"{name} must be at least 1, got {effective}. "
                              f"(parameter={name}, value={effective})", param=name,
                         code="invalid_request")
    return body


def ints_only(values: list) -> bool:
    """Whether every item of ``values`` is an ``int`` and none a ``bool`` (True for an
    empty list): the token-id check of a prompt, ``all(isinstance(t, int) and not
    isinstance(t, bool) for t in values)``, with the same answer for every input.

    A prompt of ids parsed from JSON holds plain ints only, and for that case the types
    are collected in one pass in C, a few times faster than the generator (both hold the
    GIL: docs/serve.md, "Off the event loop", has the figures); anything else (a bool, a
    float, an int subclass) takes the generator."""
    kinds = set(map(type, values))
    if kinds <= {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def prompt_token_bound(body: dict, kind: str, cap: int | None = None) -> int | None:
    """An upper bound on the prompt's tokens read off the request, or None (unknown).

    Exact for a completion prompt of token ids. For text it is the UTF-8 byte count: a
    byte-level BPE tokenizer (GPT-2, Qwen, Llama 3, the tiny MoE's) never makes a token of
    less than one byte, so a text of n bytes has at most n tokens. A chat counts the bytes
    of its messages' text; the template's own tokens and a BOS are not counted, so a prompt
    judged short may really be a few tokens longer (it is then served whole anyway: a
    choice of speed, never of correctness, docs/failures.md). Anything else (a batch of
    prompts, prompt embeddings, images) is None: never judged short.

    ``cap``: the caller only asks whether the bound is below it; counting stops there (a
    long prompt is never encoded just to be measured), and any bound >= ``cap`` comes
    back as ``cap``.
    """
    cap = sys.maxsize if cap is None else cap

    def size(text: str) -> int:
        # a character is at least one byte: a text of >= cap characters is long already
        return cap if len(text) >= cap else min(cap, len(text.encode("utf-8",
                                                                      "surrogatepass")))

    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        total = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += size(content)
            elif isinstance(content, list):  # parts: text only, else unknown
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    if not isinstance(text, str) or part.get("type", "text") != "text":
                        return None
                    total += size(text)
            elif content is not None:
                return None
            if total >= cap:
                return cap
        return total
    if body.get("prompt_embeds") not in (None, []):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return size(prompt)
    if isinstance(prompt, list) and len(prompt) >= cap:
        return cap if all(isinstance(t, int) and not isinstance(t, bool)
                          for t in prompt[:1]) else None
    if isinstance(prompt, list) and ints_only(prompt):
        return len(prompt)
    return None
