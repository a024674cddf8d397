"""The serve loop: an HTTP app listening until SIGINT or SIGTERM, the one loop of ``eldr
serve`` (each ``--workers N`` worker included) and of ``eldr orchestrate``.

:func:`run_app` sets a runner up on ``host:port``, says where it listens on stderr, calls
``ready(port)`` (the real port when ``port`` is 0) and waits for a stop signal, then
cleans up; SIGHUP runs ``on_hangup`` when one is given. :func:`serve` runs a
:class:`~eldr.proxy.app.Router` with it: the hardened server
(:mod:`eldr.proxy.httpserver`) and SIGHUP's :func:`hangup`. aiohttp is imported when a
loop starts, so ``import eldr.proxy.serving`` works without it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

__all__ = ["hangup", "run_app", "serve"]

log = logging.getLogger("eldr.serve")


async def run_app(runner, *, host: str, port: int, banner: Callable[[str, int], str],
                  ready: Callable[[int], None] | None = None, reuse_port: bool = False,
                  backlog: int = 128,
                  on_hangup: Callable[[], Awaitable[None]] | None = None,
                  site_factory=None) -> None:
    """Serve ``runner`` (an aiohttp ``AppRunner``, not yet set up) on ``host:port`` until
    SIGINT/SIGTERM. ``banner(host, port)``: the line printed on stderr once listening;
    ``ready(port)``: called then; ``reuse_port``: bind with ``SO_REUSEPORT`` (the workers
    of ``--workers N``); ``on_hangup()``: a coroutine run on each SIGHUP (none: SIGHUP is
    left as it was); ``site_factory``: aiohttp's ``TCPSite`` or one like it (called as
    it is)."""
    from aiohttp import web

    await runner.setup()
    if site_factory is None:
        site_factory = web.TCPSite
    site = site_factory(runner, host, port, backlog=backlog, reuse_port=reuse_port or None)
    await site.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(on_hangup()))
    bound_host, bound_port = site._server.sockets[0].getsockname()[:2]  # port 0: the real
    print(banner(bound_host, bound_port), file=sys.stderr, flush=True)
    if ready is not None:
        ready(bound_port)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


async def serve(router, *, ready=None, port: int | None = None, reuse_port: bool = False,
                http_limits=None) -> None:
    """Run the router until SIGINT/SIGTERM; SIGHUP re-reads the decoders file (if serve has
    one: decoders are added or drained to match it) and reloads the artifact (with
    ``--workers N``, both through the pool journal).

    ``port`` overrides the config's (a worker of ``--workers N`` binds the port its parent
    reserved, with ``reuse_port``). The HTTP server refuses malformed requests with JSON
    errors and closes connections whose request head is late or that stay idle
    (:mod:`eldr.proxy.httpserver`; ``http_limits``, an ``HttpLimits``, overrides its
    defaults).
    """
    from eldr.proxy.httpserver import HardenedAppRunner

    def banner(host: str, bound: int) -> str:
        return (f"eldr serve: listening on http://{host}:{bound} (policy "
                f"{router.state.policy.name}, {len(router.pool.prefill)} prefill, "
                f"{len(router.pool.decode)} decode)")

    runner = HardenedAppRunner(router.make_app(), limits=http_limits,
                               handler_cancellation=True, access_log=None)
    site_factory = None
    if router.config.http_front == "fast":
        from eldr.proxy.front import front_site

        def site_factory(runner, host, port, **kwargs):
            return front_site(runner, router, host, port, **kwargs)
    await run_app(runner, host=router.config.host,
                  port=router.config.port if port is None else port, banner=banner,
                  ready=ready, reuse_port=reuse_port, backlog=1024,
                  on_hangup=lambda: hangup(router), site_factory=site_factory)


async def hangup(router) -> None:
    """SIGHUP: the decoders file first (so an artifact for the new set fits), then the
    artifact. Each step logs its own outcome; neither stops the router."""
    if router.config.decoders_file is not None:
        try:
            await router.elastic.sync_file()
        except Exception as exc:  # a bad file or a fixed pool: logged, nothing changed
            log.error("decoders file not applied: %s", exc)
    try:
        await router.reload()
    except Exception:  # logged and counted by the reload; the running artifact stays
        pass
