"""The Serve deployments of the ELDR PD app (imports Ray: loaded only by the builder).

Each class is thin: the state is :class:`~eldr.integrations.ray.table.DecodeTable`, the
engine :class:`~eldr.integrations.ray.engine.EngineServer`, the request path
:class:`~eldr.integrations.ray.relay.PDRelay`; this module only wires them to Serve.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from eldr.integrations.ray.engine import EngineServer, EngineSpec
from eldr.integrations.ray.relay import PDRelay, RelayConfig
from eldr.integrations.ray.table import DecodeTable, TableConfig

__all__ = ["EldrDecodeTable", "EldrEngine", "EldrPDIngress", "TableClient", "bind_app"]

_log = logging.getLogger("eldr.ray")


class EldrDecodeTable:
    """The one table of the app. Async methods that never await: Serve runs them on the
    replica's event loop one at a time, so every call is atomic. The decode router for
    Ray's own PD builder runs the same class as a named Ray actor
    (:mod:`eldr.integrations.ray.router`)."""

    def __init__(self, config: TableConfig) -> None:
        self.table = DecodeTable(config)

    async def register(self, role, replica, url, pid=None, node=None) -> dict:
        return self.table.register(role, replica, url, pid, node)

    async def unregister(self, replica) -> None:
        self.table.unregister(replica)

    async def mark_failed(self, decoder) -> None:
        self.table.mark_failed(decoder)

    async def prefill_targets(self) -> list:
        return self.table.prefill_targets()

    async def prefill_failed(self, replica) -> None:
        self.table.prefill_failed(replica)

    async def prefill_params(self) -> dict:
        return self.table.prefill_params()

    async def reserve(self, request_id, payload=None, doc=None, prompt_tokens=None,
                      exclude=(), reading=None, replicas=None) -> dict:
        return self.table.reserve(request_id, payload=payload, doc=doc,
                                  prompt_tokens=prompt_tokens, exclude=tuple(exclude),
                                  reading=reading,
                                  replicas=None if replicas is None else tuple(replicas))

    async def move(self, request_id, replica) -> dict:
        return self.table.move(request_id, replica)

    async def release(self, request_id, outcome="completed") -> dict:
        return self.table.release(request_id, outcome)

    async def snapshot(self) -> dict:
        return self.table.snapshot()


class TableClient:
    """The table's methods as coroutines over a deployment handle (what the relay and the
    engines call)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def __getattr__(self, name):
        method = getattr(self.handle, name)

        async def call(*args, **kwargs):
            return await method.remote(*args, **kwargs)

        return call


class EldrEngine:
    """A prefill or decode replica: one vLLM engine (started in ``__init__``)."""

    async def __init__(self, spec: EngineSpec, table) -> None:
        self.table = TableClient(table)
        loop = asyncio.get_running_loop()
        # the engine takes ~40 s to start: off the replica's loop
        self.server = await loop.run_in_executor(None, EngineServer, spec, self.table)
        await self.server.heartbeat()

    async def check_health(self) -> None:
        await self.server.heartbeat()

    async def info(self) -> dict:
        return self.server.info()

    async def __del__(self) -> None:
        # the engine first: Serve kills a replica whose destructor outlives its graceful
        # shutdown window, and the table may already be gone (the call would wait)
        await asyncio.get_running_loop().run_in_executor(None, self.server.stop)
        try:
            await asyncio.wait_for(self.table.unregister(self.server.replica), timeout=2.0)
        except Exception:  # the table stopped first, or did not answer in time
            pass


class EldrPDIngress:
    """The HTTP ingress: every path goes to :meth:`PDRelay.handle`."""

    def __init__(self, table, relay: RelayConfig, _engines=()) -> None:
        self.relay = PDRelay(TableClient(table), relay)
        self.engines = _engines  # the engine deployments' handles (bound so Serve runs them)

    async def __call__(self, request):
        from starlette.responses import Response

        body = await request.body()
        answer = await self.relay.handle(request.method, request.url.path, body,
                                         request.headers.get("x-request-id"))
        if answer.stream is not None:
            return _closing_stream()(answer.stream, status_code=answer.status,
                                     media_type=answer.content_type, headers=answer.headers)
        return Response(answer.body, status_code=answer.status,
                        media_type=answer.content_type, headers=answer.headers)


def _closing_stream():
    """Starlette's ``StreamingResponse``, closing its body when it ends in any way.

    Starlette iterates the body with ``async for`` and does not close it: when the
    client leaves, Serve cancels the response, and a relay stream suspended at its
    ``yield`` (waiting for the send) stays suspended until the garbage collector
    finalizes it; only then does its ``finally`` release the decoder. Closing it here
    runs that ``finally`` at once, as ``cancelled``."""
    from starlette.responses import StreamingResponse

    class ClosingStreamingResponse(StreamingResponse):
        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()

    return ClosingStreamingResponse


def bind_app(config):
    """The application graph of :class:`~eldr.integrations.ray.app.PDAppConfig`."""
    table = serve.deployment(EldrDecodeTable, name="EldrDecodeTable", num_replicas=1,
                             max_ongoing_requests=10_000,
                             ray_actor_options={"num_cpus": 0}).bind(config.table)
    name = config.model_id
    prefill = serve.deployment(EldrEngine, name=f"Prefill:{name}",
                               **config.prefill_deployment).bind(config.prefill, table)
    decode = serve.deployment(EldrEngine, name=f"Decode:{name}",
                              **config.decode_deployment).bind(config.decode, table)
    ingress = serve.deployment(EldrPDIngress, name="EldrPDIngress",
                               **config.ingress_deployment)
    # the engines are bound so Serve deploys them; the ingress reaches them through the
    # table (their URLs), never through their handles
    return ingress.bind(table, config.relay, _engines=(prefill, decode))
