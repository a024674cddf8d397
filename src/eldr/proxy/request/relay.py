"""The decode step of the PD flow (:mod:`eldr.proxy.request.flow`): the decoder's request,
and its answer relayed to the client, buffered whole (JSON) or streamed (SSE).

The flow hands each attempt to its :class:`DecodeRelay` as one :class:`DecodeAttempt`: the
client's request, the decoder, its :class:`DecodeTarget` (where the decode goes, and why)
and the headers both ways. A failure before the first byte reaches the client raises
:class:`RetryDecode` (the flow tries another decoder); a stream that breaks later ends with
an SSE error event.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from eldr.proxy.answer import json_answer
from eldr.proxy.bodies import (
    SMALL_ANSWER,
    BadEvent,
    ByteBudget,
    SSEUsage,
    decode_body,
    fix_usage,
    json_object,
    read_upto,
    within,
)
from eldr.proxy.config import ServeConfig
from eldr.proxy.engines import Instance, UpstreamPool, error_kind
from eldr.proxy.errors import ProxyError, UpstreamReply, error_body
from eldr.proxy.request.containment import RequestGuards, Strikes
from eldr.proxy.request.decodepayload import DecodeStripper, record_payload, strip_json
from eldr.proxy.request.signatures import Reading
from eldr.routing import Outcome, RouteRequest

if TYPE_CHECKING:
    from eldr.proxy.metrics import RouterMetrics

__all__ = [
    "ERROR_BODY_LIMIT",
    "SSE_DONE",
    "SSE_HEADERS",
    "DecodeAttempt",
    "DecodeRelay",
    "DecodeTarget",
    "RetryDecode",
    "is_stream_done",
    "mark_stream_done",
    "reply_id",
    "report_failure",
]

log = logging.getLogger("eldr.serve")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
ERROR_BODY_LIMIT = 64 * 1024  # bytes of an engine's error answer kept for relay / logs
_FRAMING = 64  # bytes a chunked write adds to its data (size line and CRLF), rounded up
SSE_DONE = b"data: [DONE]"  # the last event of an OpenAI stream


@functools.cache
def _done_key():
    return (web.RequestKey("eldr_stream_done", bool) if hasattr(web, "RequestKey")
            else "eldr_stream_done")


def mark_stream_done(request) -> None:
    """The client was sent ``[DONE]``: it has its whole answer, and a close from then on is
    a completed request, not a disconnect (clients close right after ``[DONE]``, often
    before the engine's stream has ended)."""
    request[_done_key()] = True


def is_stream_done(request) -> bool:
    return bool(request.get(_done_key(), False))


class RetryDecode(Exception):
    """A decode failed before its first byte reached the client: the flow tries another
    decoder (``kind``: the failure's :func:`~eldr.proxy.engines.upstream.error_kind`)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def reply_id(out) -> str:
    """The client's request id of an answer (for logs)."""
    return out.headers.get("X-Request-Id", "?")


def report_failure(pool: UpstreamPool, metrics: RouterMetrics, inst: Instance, kind: str,
                   detail: object) -> None:
    """A request to ``inst`` failed (``kind``: :func:`~eldr.proxy.engines.upstream.error_kind`):
    counted, logged, and told to the pool (health, circuit breaker)."""
    metrics.upstream_errors.inc(role=inst.role, instance=inst.name, kind=kind)
    text = str(detail) or type(detail).__name__
    log.warning("%s %s: a request failed there (%s: %s)", inst.role, inst.name, kind, text)
    pool.request_failed(inst, kind, text)


@dataclass(slots=True)
class DecodeTarget:
    """Where one attempt's decode goes, and why. Not changed once made (not frozen: a
    frozen dataclass's ``__init__`` costs five times as much, and the request path makes
    one of these and one :class:`DecodeAttempt` per attempt)."""

    worker: int  # decode worker index k
    request: RouteRequest  # what the policy routed (dispatched to ``worker``)
    reading: Reading  # what the prefill response carried
    kv_params: dict | None  # kv_transfer_params to relay to the decoder
    prompt_tokens: int | None  # the prefill's usage.prompt_tokens (the whole prompt)
    faults: Strikes | None = None  # the request's deaths so far (a stream dying mid-way)


@dataclass(slots=True)
class DecodeAttempt:
    """One decode, as the flow hands it to :meth:`DecodeRelay.decode` (not changed once
    made; not frozen, as :class:`DecodeTarget`)."""

    request: web.Request  # the client's request (its transport; its answer's state)
    kind: str  # "completions" or "chat"
    body: dict  # the client's parsed body
    raw: bytes | None  # the client's bytes, relayed as they are when possible (or None)
    decoder: Instance  # the decoder the decision picked
    decision: DecodeTarget  # why there: the KV parameters and prompt tokens to pass on
    headers: dict  # to the decoder: this attempt's X-Request-Id, the engines' key
    reply: dict  # to the client: X-Request-Id, X-Eldr-Prefill/-Decoder/-Attempts
    stream: bool  # the client asked for SSE


class DecodeRelay:
    """The decode of one attempt at its decoder, and the relay of the answer.

    ``budget`` bounds the bytes of all buffered (non-streaming) answers; ``background``
    holds the tasks that read a finished stream to its end (the flow cancels them when the
    router stops); ``guards`` decide whether an engine that broke a stream died.
    """

    def __init__(self, config: ServeConfig, pool: UpstreamPool, metrics: RouterMetrics,
                 guards: RequestGuards, budget: ByteBudget,
                 background: set[asyncio.Task]) -> None:
        self.config, self.pool, self.metrics, self.guards = config, pool, metrics, guards
        self.budget = budget
        self._background = background
        # the same for every decode: built once (immutable)
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout,
                                              sock_read=config.decode_read_timeout)

    # -- decode ----------------------------------------------------------------------------
    async def decode(self, attempt: DecodeAttempt) -> tuple[web.StreamResponse, Outcome]:
        """(the client's response, the outcome to release the dispatch with)."""
        inst, request = attempt.decoder, attempt.request
        data = decode_body(attempt.body, attempt.raw, attempt.decision.kv_params)
        path = "/v1/chat/completions" if attempt.kind == "chat" else "/v1/completions"
        pool = self.pool
        pool.begin(inst)
        try:
            try:
                resp = await pool.session.post(inst.url + path, data=data,
                                               headers=attempt.headers, timeout=self._timeout)
            except Exception as exc:
                raise self._failure(inst, error_kind(exc), exc) from None
            try:
                if resp.status >= 400:
                    raw, _ = await read_upto(resp, ERROR_BODY_LIMIT)
                    if resp.status >= 500:
                        raise self._failure(inst, "http_5xx", f"status {resp.status}")
                    raise UpstreamReply(resp.status, raw, resp.content_type)
                if not attempt.stream:
                    return await self._whole(attempt, resp)
                return await self._relay(attempt, resp)
            finally:
                if is_stream_done(request):  # the stream is over: let it end cleanly
                    self._finish_later(resp)
                else:
                    resp.close()  # an unfinished upstream request is aborted, not pooled
        finally:
            pool.end(inst)

    def _failure(self, inst: Instance, kind: str, detail) -> RetryDecode:
        report_failure(self.pool, self.metrics, inst, kind, detail)
        return RetryDecode(kind, str(detail) or type(detail).__name__)

    async def _whole(self, attempt: DecodeAttempt, resp):
        """Buffer the decoder's JSON answer (retryable to its end), then send it whole.

        The answer's bytes are reserved in the router's buffer budget before it is read
        and given back once the client has it (or was dropped): memory stays bounded by
        ``max_buffered_bytes`` (times about two: the answer, and the socket buffer holding
        its unsent part) however many clients wait for large answers.
        """
        limit = self.config.max_response_bytes
        size = resp.content_length
        if size is not None and size > limit:
            raise self._too_large(attempt.decoder, limit)
        need = limit if size is None else size
        try:
            if not self.budget.try_acquire(need):  # else wait, bounded
                await within(self.budget.acquire(need), self.config.decode_read_timeout)
        except asyncio.TimeoutError:
            raise ProxyError(503, "the router's answer buffer stayed full; retry later",
                             code="router_busy") from None
        try:
            return await self._whole_within_budget(attempt, resp)
        finally:
            self.budget.release(need)

    def _too_large(self, inst: Instance, limit: int) -> ProxyError:
        # another decoder would answer as much: not retried
        self.metrics.upstream_errors.inc(role=inst.role, instance=inst.name, kind="too_large")
        return ProxyError(502, f"the decoder's answer is larger than {limit} bytes "
                               f"(--max-response-bytes); stream it instead",
                          code="upstream_too_large")

    async def _whole_within_budget(self, attempt: DecodeAttempt, resp):
        request, inst, reply = attempt.request, attempt.decoder, attempt.reply
        limit = self.config.max_response_bytes
        try:
            raw, whole = await read_upto(resp, limit)
        except Exception as exc:  # nothing was sent yet: retryable
            raise self._failure(inst, error_kind(exc), exc) from None
        if not whole:
            raise self._too_large(inst, limit)
        raw, payload = strip_json(raw)  # the engines' decode counts: the router's alone
        if payload is not None:
            record_payload(request, self.metrics, inst, payload)
        doc = json_object(raw)  # a 200 that is not JSON (a proxy's page...) is not an answer
        if doc is None:
            raise self._failure(inst, "protocol", "answer is not a JSON object")
        if fix_usage(doc.get("usage"), attempt.decision.prompt_tokens):
            raw = json.dumps(doc).encode()
        del doc  # only the bytes are sent: the parsed copy must not wait with them
        self.pool.request_succeeded(inst)
        if len(raw) <= SMALL_ANSWER:  # never waits on the client (below the write limit)
            return json_answer(request, raw, resp.status, reply), "completed"
        out = web.StreamResponse(status=resp.status, headers=reply)
        out.content_type = "application/json"
        out.content_length = len(raw)
        # the decode is over either way: a client that does not read only loses its answer
        try:
            await out.prepare(request)
            if await self._deliver(request, out, raw):
                await self._deliver(request, out, None)
        except ConnectionResetError:  # the client left while its answer was being sent
            self.metrics.client_disconnects.inc()
        return out, "completed"

    async def _deliver(self, request, out, data: bytes | None) -> bool:
        """Write ``data`` to the client (None: end the answer) within ``write_timeout``.

        A client that leaves the answer unread that long is dropped (its connection
        aborted, which frees what was buffered for it) and False is returned: without this,
        each such client pins a decoder slot, and its unsent answer, for as long as it
        keeps the connection open.

        A write cannot wait when the socket took every byte written before it and the
        chunk is below the transport's high-water mark: the transport is then not paused,
        and aiohttp's writer returns without suspending. Such a write (nearly every chunk
        of a stream: a client reads as fast as tokens come) goes without a deadline; the
        timeout block it skips was the largest part of the router's own work per
        streamed chunk. Once the client falls behind, its bytes wait in the transport and
        every write is timed again.
        """
        transport = request.transport
        if data is not None and transport is not None \
                and not transport.get_write_buffer_size() \
                and len(data) + _FRAMING <= transport.get_write_buffer_limits()[1]:
            await out.write(data)  # lands in an empty buffer, below its high-water mark
            return True
        try:
            await within(out.write(data) if data is not None else out.write_eof(),
                          self.config.write_timeout)
            return True
        except asyncio.TimeoutError:
            self.metrics.slow_clients.inc()
            log.warning("client of %s left its answer unread for %.1f s: dropped",
                        reply_id(out), self.config.write_timeout)
            if request.transport is not None:
                request.transport.abort()
            return False

    async def _relay(self, attempt: DecodeAttempt, resp):
        """Stream the decoder's SSE to the client: (response, outcome)."""
        request, inst, decision = attempt.request, attempt.decoder, attempt.decision
        if resp.content_type != "text/event-stream":  # not a stream: nothing sent, retry
            raise self._failure(inst, "protocol", f"stream answered as {resp.content_type!r}")
        usage = SSEUsage(decision.prompt_tokens)
        strip = DecodeStripper()  # drops the engines' decode-payload event
        try:
            raw_first = await resp.content.readany()
        except Exception as exc:  # nothing was sent yet: retryable
            raise self._failure(inst, error_kind(exc), exc) from None
        if not raw_first:
            raise self._failure(inst, "disconnect", "stream ended before any byte")
        try:
            first = strip.feed(usage.feed(raw_first))
        except BadEvent as exc:
            raise self._failure(inst, "protocol", exc) from None
        self.pool.request_succeeded(inst)
        out = web.StreamResponse(status=200, headers={**SSE_HEADERS, **attempt.reply})
        outcome: Outcome = "completed"
        tail = b""  # the last bytes sent: "data: [DONE]" may arrive split over two reads
        try:
            await out.prepare(request)
            data, chunk = first, raw_first
            while True:
                if not await self._deliver(request, out, data):
                    return out, "cancelled"  # the decode is aborted with the upstream close
                tail = (tail + data)[-32:]
                if outcome == "completed" and tail.rstrip().endswith(SSE_DONE):
                    # The client has the whole answer: a close from now on is no disconnect,
                    # and the decoder's end of stream is awaited apart (_finish_later).
                    mark_stream_done(request)
                    break
                if not chunk:
                    break
                try:
                    chunk = await resp.content.readany()
                    data = (strip.feed(usage.feed(chunk)) if chunk
                            else strip.feed(usage.flush()) + strip.flush())
                except Exception as exc:  # too late to retry: tell the client
                    kind = "protocol" if isinstance(exc, BadEvent) else error_kind(exc)
                    report_failure(self.pool, self.metrics, inst, kind, exc)
                    msg = f"decoder {inst.name} failed mid-stream: {kind}"
                    if decision.faults is not None:
                        try:  # a death is a strike; the second one makes the body poison
                            await self.guards.check_death(inst, kind, decision.faults)
                        except ProxyError as poison:
                            msg = poison.message
                    outcome = "failed"
                    data = usage.flush() + b"data: " + error_body(502, msg) + b"\n\n"
                    chunk = b""
            await self._deliver(request, out, None)
        except ConnectionResetError:  # the client left: stop reading (closes upstream)
            self._take_stream_payload(request, inst, strip)
            if is_stream_done(request):
                return out, outcome
            self.metrics.client_disconnects.inc()
            outcome = "cancelled"
        self._take_stream_payload(request, inst, strip)
        return out, outcome

    def _take_stream_payload(self, request, inst: Instance, strip: DecodeStripper) -> None:
        if strip.payload is not None:
            record_payload(request, self.metrics, inst, strip.payload)
            strip.payload = None

    def _finish_later(self, resp) -> None:
        """Read the decoder's stream to its end after ``[DONE]``, in the background.

        Only the chunked terminator is left, but it may come in a later TCP segment, and
        the client usually closes as soon as it has ``[DONE]``: that cancels the handler,
        and closing the upstream then would abort a request the engine has finished. Read
        to its end, the connection goes back to the pool; a decoder that sends more, or
        keeps the stream open past ``connect_timeout``, is cut off.
        """
        task = asyncio.ensure_future(self._finish_upstream(resp))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish_upstream(self, resp) -> None:
        try:
            await within(read_upto(resp, ERROR_BODY_LIMIT), self.config.connect_timeout)
        except Exception as exc:  # the answer is complete: the close aborts nothing
            log.debug("decoder stream after [DONE] did not end cleanly: %s", exc)
        finally:
            resp.close()  # after the end of the stream: the connection is already pooled
