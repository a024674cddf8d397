"""``eldr serve``: an OpenAI-compatible prefill/decode router for vLLM that routes decode
by expert locality (docs/method.md#request-path-with-vllm).

Five concerns, one subpackage each (docs/serve.md#code-layout): :mod:`eldr.proxy.request`
(one request: prefill, decision, decode, relay), :mod:`eldr.proxy.engines` (the instances,
their health and load, the HTTP client), :mod:`eldr.proxy.control` (admin token, reloads,
the elastic pool, learning), :mod:`eldr.proxy.workers` (``--workers N``) and
:mod:`eldr.proxy.selection` (the decode-selection API). Beside them the modules every part
reads: :mod:`~eldr.proxy.config` (settings), :mod:`~eldr.proxy.errors`,
:mod:`~eldr.proxy.metrics`, :mod:`~eldr.proxy.bodies` (bounded reads, request bodies); and
the three that make the server: :mod:`~eldr.proxy.app` (the router: its parts wired
together, the HTTP routes), :mod:`~eldr.proxy.httpserver` (hardened for untrusted clients)
and :mod:`~eldr.proxy.serving` (the serve loop, which ``eldr orchestrate`` runs too).
:mod:`~eldr.proxy.orchestrator` is apart: ``eldr orchestrate``, the selection API's
reference client, an HTTP app of its own that takes every decision from a router.
aiohttp is needed (the ``serve`` extra); it is imported only when the router runs, so
``import eldr.proxy`` works without it.
"""

from eldr.proxy.config import ServeConfig

__all__ = ["ServeConfig"]
