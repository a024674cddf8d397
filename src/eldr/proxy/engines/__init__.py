"""The engines behind the router: the pool of prefill and decode instances
(:mod:`~eldr.proxy.engines.upstream`), their health, load and circuit breakers
(:mod:`~eldr.proxy.engines.breaker`), the decoders' expert footprints
(:mod:`~eldr.proxy.engines.footprints`), and the HTTP client the router talks to them with
(:mod:`~eldr.proxy.engines.client` over :mod:`~eldr.proxy.engines.connection`; it needs
``httptools``, so :func:`make_session` imports it, and falls back to aiohttp's without it).
"""

from eldr.proxy.engines.breaker import CircuitBreaker
from eldr.proxy.engines.upstream import Instance, UpstreamPool, error_kind, make_session

__all__ = ["CircuitBreaker", "Instance", "UpstreamPool", "error_kind", "make_session"]
