"""The learner over HTTP, for routers whose ``--learn DIR`` is not at hand (a pod):

    GET /admin/learn                       the learner's state (as ``eldr learn status``)
    GET /admin/learn/trace[?decode_only=1] the buffered requests as a trace (.npz bytes,
                                           as ``eldr learn export``)

Both need the admin token (``ELDR_ADMIN_TOKEN``), as every ``/admin`` route. A router
without ``--learn`` answers 404 ``not_learning``; an empty buffer 409 ``empty``. The trace
is built from a snapshot of the buffer in a thread (the event loop only copies the list of
records) and written to a temporary file first, as ``eldr.traces.trace.save`` writes.
"""

from __future__ import annotations

import asyncio
import os
import tempfile

from eldr.proxy.control.admin import AdminToken
from eldr.proxy.errors import ProxyError
from eldr.proxy.request import LiveRouting, method_not_allowed

__all__ = ["LearnAdmin"]


class LearnAdmin:
    """The ``/admin/learn`` routes: ``learner`` is the router's (set when it attaches one;
    None: the router does not learn), ``live`` its routing snapshot."""

    def __init__(self, live: LiveRouting, token: AdminToken) -> None:
        self.live, self.token = live, token
        self.learner = None  # the router's LiveLearning or ForwardLearning, with --learn

    def _learner(self, request):
        self.token.authorize(request)
        live = self.learner
        if live is None:
            raise ProxyError(404, "this router does not learn: start eldr serve with "
                                  "--learn DIR", code="not_learning")
        if not hasattr(live, "learner"):  # --workers N: it forwards to worker 0's learner
            raise ProxyError(503, "with --workers N the learner runs in worker 0 and this "
                                  "connection reached another worker: ask again on a new "
                                  "connection", code="learner_elsewhere")
        return live.learner

    async def status(self, request):
        from aiohttp import web

        if request.method != "GET":
            return method_not_allowed("GET")
        learner = self._learner(request)
        buf = learner.buffer
        det = learner.detector
        fitting = learner.fit_task is not None and not learner.fit_task.done()
        return web.json_response({
            **learner.state,
            "requests": len(buf), "with_decode": buf.num_with_decode, "seen": buf.num_seen,
            "dropped": buf.num_dropped, "model": buf.model, "fit_running": fitting,
            "artifact": self.live.state.artifact, "policy": self.live.state.policy.name,
            "drift": {} if det is None else {s: r.score for s, r in det.last_.items()}})

    async def trace(self, request):
        from aiohttp import web

        if request.method != "GET":
            return method_not_allowed("GET")
        learner = self._learner(request)
        flag = request.query.get("decode_only", "0").lower()
        if flag not in ("0", "1", "true", "false"):
            raise ProxyError(400, "'decode_only' must be 0, 1, true or false",
                             param="decode_only")
        records = learner.buffer.snapshot()
        if flag in ("1", "true"):
            records = [r for r in records if r.decode_counts is not None]
        if not records or learner.buffer.top_k is None:
            raise ProxyError(409, "the learn buffer holds no requests"
                                  + (" with decode counts" if flag in ("1", "true") else ""),
                             code="empty")
        data = await asyncio.to_thread(_trace_bytes, records, learner.buffer.model or "unknown",
                                       int(learner.buffer.top_k))
        return web.Response(body=data, content_type="application/octet-stream", headers={
            "Content-Disposition": 'attachment; filename="learned.npz"',
            "X-Eldr-Requests": str(len(records))})


def _trace_bytes(records, model: str, top_k: int) -> bytes:
    from eldr.learn.buffer import records_to_trace
    from eldr.traces import trace as trace_io

    trace, _ = records_to_trace(records, model=model, top_k=top_k)
    fd, path = tempfile.mkstemp(suffix=".npz", prefix="eldr-learn-")
    os.close(fd)
    try:
        trace_io.save(trace, path)
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)
