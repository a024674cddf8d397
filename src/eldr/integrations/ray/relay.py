"""The ingress's request path: prefill first, decode chosen on its expert counts, relayed.

Per request (``/v1/completions`` and ``/v1/chat/completions``, JSON or SSE), as
``eldr serve`` runs it (docs/serve.md, "One request"):

1. **prefill** on the least-loaded live prefill engine of the decode table: the client's
   body with ``max_tokens: 1``, not streamed, and ``kv_transfer_params =
   {"do_remote_decode": true, ...}`` (vLLM's PD protocol), under a fresh ``X-Request-Id``
   per attempt, and the layers the table's policy reads (``eldr_layers``, as ``eldr
   serve`` asks: the band's mask, ``eldr_cost``'s priced rows; none: every layer). Its
   answer carries the capture plugin's expert counts (``kv_transfer_params["eldr"]``);
2. **reserve**: the counts, the rest of the answer and ``usage.prompt_tokens`` go to the
   table, whose policy chooses the decoder and counts it as loaded;
3. **decode**: the client's body plus the prefill's ``kv_transfer_params`` (less the eldr
   payload) to that decoder's engine; its bytes are relayed as they come (vLLM's own
   JSON, SSE, usage and errors; usage made to count the whole prompt as ``eldr serve``
   does);
4. **release** with ``completed``, ``failed`` or ``cancelled`` (the client left, or left
   a streamed answer unread for ``stream_write_timeout``), exactly once, whatever
   happens.

A decoder that cannot be reached, answers 5xx, or breaks before its first byte is marked
failed in the table and the request starts over on another decoder with a new prefill (a
consumed ``kv_transfer_params`` must never be reused), up to ``max_attempts``. After the
first byte a broken stream ends with an SSE error event (a JSON answer is never partly
sent: it is read whole first). An engine's 4xx is the client's fault: relayed unchanged,
never retried.

The relay knows no Ray: ``table`` is any object with the decode table's methods as
coroutines (the app passes a wrapper of the table deployment's handle), so it is tested
against stand-in engines in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

__all__ = ["Answer", "PDRelay", "RelayConfig"]

_log = logging.getLogger("eldr.ray")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
ERROR_BODY_LIMIT = 64 * 1024  # bytes of an engine's error answer relayed


@dataclass(frozen=True)
class RelayConfig:
    """Timeouts and retries of the ingress; validated on construction."""

    max_attempts: int = 3  # prefill+decode attempts per request (retries = attempts - 1)
    connect_timeout: float = 3.0  # seconds to open a connection to an engine
    prefill_timeout: float = 120.0  # seconds for a whole prefill answer
    decode_read_timeout: float = 120.0  # seconds without a byte from a decoder
    # seconds a streamed answer may wait for its client to take the next chunk; then its
    # decoder is released as cancelled and the decoder's stream closed (eldr serve drops
    # such a client after its write_timeout): a stream whose consumer neither reads nor
    # is cancelled (a left client whose cancellation Serve never delivered) would
    # otherwise hold its decoder for good
    stream_write_timeout: float = 60.0
    # seconds the table's list of live prefill engines is reused (one table call fewer
    # per request; a failed prefill refreshes it at once)
    prefill_refresh: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) \
                or not 1 <= self.max_attempts <= 10:
            raise ValueError(f"max_attempts must be an integer in [1, 10], got "
                             f"{self.max_attempts!r}")
        for name in ("connect_timeout", "prefill_timeout", "decode_read_timeout",
                     "stream_write_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.prefill_refresh >= 0:
            raise ValueError(f"prefill_refresh must be >= 0, got {self.prefill_refresh!r}")


@dataclass
class Answer:
    """What the ingress sends back: a whole body, or a stream of bytes."""

    status: int
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""  # the whole answer when ``stream`` is None
    stream: AsyncIterator[bytes] | None = None  # the answer's bytes as they come


def _error(status: int, message: str) -> Answer:
    from eldr.proxy.errors import error_body

    return Answer(status, "application/json", body=error_body(status, message))


class _Retry(Exception):
    """This attempt failed before any byte reached the client: try another decoder."""


class PDRelay:
    """One ingress replica's request path (see the module docstring)."""

    def __init__(self, table, config: RelayConfig | None = None) -> None:
        self.table = table  # async reserve / release / mark_failed / prefill_* / snapshot
        self.config = config or RelayConfig()
        self._session = None  # aiohttp.ClientSession, made in the serving loop
        self._tasks: set[asyncio.Task] = set()  # releases in flight (kept referenced)
        self._prefills: list[dict] = []  # the table's live prefill engines, as last read
        self._prefills_at = float("-inf")  # loop time they were read
        self._prefill_params: dict = {}  # the table's layer mask for prefills, read with them
        self._prefill_busy: Counter[str] = Counter()  # replica -> this ingress's prefills

    async def prefill_targets(self) -> list[dict]:
        """Live prefill engines, this ingress's least busy first (the table's list,
        reused for ``prefill_refresh`` seconds; the layers to ask them for are read with
        it: :meth:`DecodeTable.prefill_params`)."""
        now = asyncio.get_running_loop().time()
        if now - self._prefills_at > self.config.prefill_refresh or not self._prefills:
            self._prefills, self._prefill_params = await asyncio.gather(  # one round trip
                self.table.prefill_targets(), self.table.prefill_params())
            self._prefills_at = now
        return sorted(self._prefills, key=lambda t: self._prefill_busy[t["replica"]])

    async def session(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout,
                                              sock_read=self.config.decode_read_timeout),
                auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro) -> None:
        """Run ``coro`` to its end even when the request's task is being cancelled (a
        client that left must still release its decoder).

        It runs in a context of its own, not the request's: Serve takes a handle call
        made in a request's context for a child of that request, and when the request is
        cancelled it cancels the children still being assigned to a replica
        (``Replica._on_request_cancelled``, Ray 2.60). A release spawned by the
        cancellation itself is such a child until the table's replica takes it: without
        this it was cancelled now and then (more often on a busy machine), and the
        decoder stayed held until its reservation expired. Ray itself does the same to
        the actor calls made in a cancelled actor task's context (its
        ``ray._raylet.async_task_id``), which a new context leaves unset too."""
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- routes ----------------------------------------------------------------------------
    async def handle(self, method: str, path: str, body: bytes,
                     client_request_id: str | None = None) -> Answer:
        """Serve one HTTP request of the ingress."""
        if path in GENERATE_PATHS:
            if method != "POST":
                return Answer(405, "application/json",
                              body=b'{"detail": "Method Not Allowed"}')
            return await self.generate(path, body, client_request_id)
        if path == "/health":
            snap = await self.table.snapshot()
            ok = bool(snap["prefills"]) and any(d["healthy"] for d in snap["decoders"])
            return Answer(200 if ok else 503, "text/plain",
                          body=b"ok" if ok else b"unavailable")
        if path == "/eldr/table":
            return Answer(200, "application/json",
                          body=json.dumps(await self.table.snapshot()).encode())
        return await self.forward(method, path, body)

    async def forward(self, method: str, path: str, body: bytes) -> Answer:
        """Any other route (``/v1/models``, ``/tokenize``, ...): to a live prefill engine."""
        import aiohttp

        targets = await self.prefill_targets()
        session = await self.session()
        for target in targets:
            try:
                async with session.request(method, target["url"] + path, data=body or None,
                                           headers={"Content-Type": "application/json"}) as r:
                    return Answer(r.status, r.headers.get("Content-Type", "application/json"),
                                  body=await r.read())
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return _error(503, "no prefill engine answers")

    # -- the PD flow -----------------------------------------------------------------------
    async def generate(self, path: str, raw: bytes, client_request_id: str | None) -> Answer:
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        exclude: list[str] = []
        last = _error(503, "no decode engine could serve the request")
        for attempt in range(1, self.config.max_attempts + 1):
            rid = f"eldr-ray-{uuid.uuid4().hex}"
            t0 = time.perf_counter()
            try:
                pre = await self._prefill(path, body, rid)
            except _Retry as exc:
                last = _error(502, str(exc))
                continue
            if isinstance(pre, Answer):  # the engine refused the request (4xx): relayed
                return pre
            doc, prefill_replica = pre
            t1 = time.perf_counter()
            got = await self._reserve(rid, doc, exclude)
            if isinstance(got, Answer):
                return got
            t2 = time.perf_counter()
            headers = {"X-Request-Id": client_request_id or rid,
                       # this attempt's prefill and decision (the table call), in ms
                       "Server-Timing": f"prefill;dur={(t1 - t0) * 1e3:.1f}, "
                                        f"route;dur={(t2 - t1) * 1e3:.1f}",
                       "X-Eldr-Decoder": got["decoder"], "X-Eldr-Attempts": str(attempt),
                       "X-Eldr-Prefill": prefill_replica,
                       "X-Eldr-Input": got["input"] + (f"; fallback={got['fallback']}"
                                                       if got["fallback"] else "")}
            try:
                return await self._decode(path, body, doc, rid, got, headers)
            except _Retry as exc:
                _log.warning("decode attempt %d on %s failed before its first byte: %s",
                             attempt, got["decoder"], exc)
                exclude.append(got["decoder"])
                last = _error(502, f"decoder {got['decoder']}: {exc}")
        return last

    async def _prefill(self, path: str, body: dict, rid: str):
        """(prefill answer, prefill replica) or the engine's 4xx as an Answer; _Retry when
        no prefill engine answered."""
        import aiohttp

        targets = await self.prefill_targets()
        if not targets:
            raise _Retry("no live prefill engine")
        pre = dict(body, max_tokens=1, stream=False,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None,
                                       **self._prefill_params})
        for key in ("stream_options", "min_tokens"):
            pre.pop(key, None)
        if path.endswith("/chat/completions") or "max_completion_tokens" in body:
            pre["max_completion_tokens"] = 1
        session = await self.session()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout,
                                        connect=self.config.connect_timeout)
        for target in targets:
            self._prefill_busy[target["replica"]] += 1
            failed = True
            try:
                async with session.post(target["url"] + path, json=pre, timeout=timeout,
                                        headers={"X-Request-Id": rid}) as r:
                    raw = await r.read()
                    if 400 <= r.status < 500:
                        failed = False
                        return Answer(r.status, r.headers.get("Content-Type",
                                                              "application/json"),
                                      body=raw[:ERROR_BODY_LIMIT])
                    if r.status == 200:
                        doc = json.loads(raw)
                        if isinstance(doc, dict):
                            failed = False
                            return doc, target["replica"]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                _log.warning("prefill on %s failed: %s", target["url"], exc)
            finally:
                self._prefill_busy[target["replica"]] -= 1
                if failed:
                    self._prefills_at = float("-inf")  # read the table again next time
                    await self.table.prefill_failed(target["replica"])
        raise _Retry("no prefill engine gave an answer")

    async def _reserve(self, rid: str, doc: dict, exclude: list[str]):
        from eldr.proxy.request.signatures import split_kv_params

        _, payload = split_kv_params(doc)
        usage = doc.get("usage")
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        choices = doc.get("choices")
        rest = None  # vLLM's own routed_experts (GPU builds), the only other input read
        if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
                and "routed_experts" in choices[0]:
            rest = {"choices": [{"routed_experts": choices[0]["routed_experts"]}]}
        got = await self.table.reserve(
            rid, payload=payload, doc=rest,
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
            exclude=tuple(exclude))
        if "error" in got:
            return _error(503, got["error"])
        got["prompt_tokens"] = prompt_tokens if isinstance(prompt_tokens, int) else None
        return got

    async def _decode(self, path: str, body: dict, doc: dict, rid: str, got: dict,
                      headers: dict) -> Answer:
        import aiohttp

        from eldr.proxy.request.signatures import split_kv_params

        relay_kvp, _ = split_kv_params(doc)
        dec = dict(body)
        if relay_kvp:
            dec["kv_transfer_params"] = relay_kvp
        session = await self.session()
        released = False

        def release(outcome: str) -> None:
            nonlocal released
            if not released:
                released = True
                self._spawn(self.table.release(rid, outcome))

        try:
            resp = await session.post(got["url"] + path, json=dec,
                                      headers={"X-Request-Id": rid})
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            release("failed")
            await self.table.mark_failed(got["decoder"])
            raise _Retry(f"cannot reach its engine ({exc!r})") from None
        except asyncio.CancelledError:
            release("cancelled")
            raise
        try:
            ctype = resp.headers.get("Content-Type", "application/json")
            if resp.status >= 500:
                await self.table.mark_failed(got["decoder"])
                raise _Retry(f"its engine answered {resp.status}")
            if resp.status != 200:
                raw = (await resp.read())[:ERROR_BODY_LIMIT]
                release("failed")
                return Answer(resp.status, ctype, headers, body=raw)
            if not body.get("stream"):
                try:
                    raw = await resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    await self.table.mark_failed(got["decoder"])
                    raise _Retry(f"its answer broke off ({exc!r})") from None
                release("completed")
                return Answer(200, ctype, headers, body=_fixed_json(raw, got["prompt_tokens"]))
            try:
                first = await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                await self.table.mark_failed(got["decoder"])
                raise _Retry(f"its stream broke before the first byte ({exc!r})") from None
            if not first:
                await self.table.mark_failed(got["decoder"])
                raise _Retry("its stream ended before the first byte")
        except _Retry:
            release("failed")
            resp.release()
            raise
        except asyncio.CancelledError:
            release("cancelled")
            resp.release()
            raise
        except BaseException:
            release("failed")
            resp.release()
            raise
        released = True  # the stream's own finally releases from here on
        return Answer(200, ctype, headers,
                      stream=self._stream(resp, first, rid, got["prompt_tokens"]))

    async def _stream(self, resp, first: bytes, rid: str,
                      prompt_tokens: int | None) -> AsyncIterator[bytes]:
        """Relay the decoder's SSE bytes; release exactly once, by how it ended."""
        import aiohttp

        from eldr.proxy.bodies import BadEvent, SSEUsage
        from eldr.proxy.errors import error_body

        usage = SSEUsage(prompt_tokens)
        outcome = "failed"
        loop = asyncio.get_running_loop()
        abandoned = False

        def abandon() -> None:
            """The client took no chunk for ``stream_write_timeout``: release its decoder
            now (the generator may never run again) and close the decoder's stream."""
            nonlocal abandoned
            abandoned = True
            _log.warning("the client of %s left its stream unread for %.1f s: its decoder "
                         "is released", rid, self.config.stream_write_timeout)
            with contextlib.suppress(Exception):
                resp.close()
            self._spawn(self.table.release(rid, "cancelled"))

        try:
            async with contextlib.aclosing(_sse_pieces(resp, first, usage)) as pieces:
                async for out in pieces:
                    timer = loop.call_later(self.config.stream_write_timeout, abandon)
                    try:
                        yield out
                    finally:
                        timer.cancel()
                    if abandoned:  # taken up again after its decoder was released
                        return
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, BadEvent) as exc:
            if abandoned:  # the decoder's stream was closed by abandon()
                return
            _log.warning("decode stream %s broke after its first byte: %r", rid, exc)
            yield b"data: " + error_body(502, f"the decoder's stream broke: {exc!r}") + b"\n\n"
        finally:
            with contextlib.suppress(Exception):
                resp.release()
            if not abandoned:
                self._spawn(self.table.release(rid, outcome))


async def _sse_pieces(resp, first: bytes, usage) -> AsyncIterator[bytes]:
    """The decoder's SSE bytes to relay: ``first`` (already read), the rest as they come
    and what ``usage`` (:class:`eldr.proxy.bodies.SSEUsage`) holds back at the end, each
    through ``usage`` (which fixes the usage event's prompt tokens)."""
    yield usage.feed(first)
    async for chunk in resp.content.iter_any():
        out = usage.feed(chunk)
        if out:
            yield out
    tail = usage.flush()
    if tail:
        yield tail


def _fixed_json(raw: bytes, prompt_tokens: int | None) -> bytes:
    """The decoder's JSON answer, its usage made to count the whole prompt (as eldr serve
    does: a connector may report only the tokens it computed)."""
    from eldr.proxy.bodies import fix_usage

    if prompt_tokens is None:
        return raw
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(doc, dict) and fix_usage(doc.get("usage"), prompt_tokens):
        return json.dumps(doc).encode()
    return raw
