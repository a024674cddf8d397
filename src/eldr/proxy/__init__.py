"""``eldr serve``: an OpenAI-compatible prefill/decode router for vLLM that routes decode
by expert locality (docs/method.md#request-path-with-vllm).

Modules: :mod:`~eldr.proxy.config` (settings), :mod:`~eldr.proxy.upstream` (engines,
health, load), :mod:`~eldr.proxy.affinity` (prefill choice), :mod:`~eldr.proxy.decision`
(routing snapshot, signatures), :mod:`~eldr.proxy.flow` (the per-request PD flow),
:mod:`~eldr.proxy.bodies` (bounded reads, timed writes, usage), :mod:`~eldr.proxy.breaker`
(per-decoder circuit breaker), :mod:`~eldr.proxy.app` (HTTP routes),
:mod:`~eldr.proxy.metrics`, :mod:`~eldr.proxy.errors`.
aiohttp is needed (the ``serve`` extra); it is imported only when the router runs, so
``import eldr.proxy`` works without it.
"""

from eldr.proxy.config import ServeConfig

__all__ = ["ServeConfig"]
