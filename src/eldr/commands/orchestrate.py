"""``eldr orchestrate``: the selection API's reference orchestrator
(:mod:`eldr.proxy.orchestrator`, docs/selection-api.md) from the command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from eldr.proxy.orchestrator import TOKEN_ENV

HELP = ("Serve /v1/completions over vLLM prefill and decode engines, every decode decision "
        "taken from eldr serve's selection API.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, metavar="URL",
                   help="eldr serve's base URL, whose selection API picks every decoder")
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill engine (repeatable; used round robin)")
    p.add_argument("--register", action="append", default=[], metavar="[NAME=]URL",
                   help="a decode engine to register through the API at start, unless the "
                        "router has it already (repeatable)")
    p.add_argument("--select-on", choices=("payload", "tokens"), default="payload",
                   help="select after the prefill on its eldr payload (default), or before "
                        "it on the prompt's token ids (the router's prompt predictor)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="listen port (default 8100)")
    p.add_argument("--admin-token-file", default=None, metavar="PATH",
                   help=f"file holding eldr serve's admin token (or env {TOKEN_ENV}): the "
                        f"selection API needs it")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds for one engine call (default 120)")


def config_from_args(args: argparse.Namespace):
    from eldr.proxy.config import parse_decode_spec
    from eldr.proxy.orchestrator import OrchestrateConfig

    token = None
    if args.admin_token_file is not None:
        from eldr.fileio import open_regular

        with open_regular(args.admin_token_file, max_bytes=4096,
                          what="an admin token file") as fh:
            token = fh.read().decode("utf-8", errors="replace").strip()
    token = token or os.environ.get(TOKEN_ENV) or ""
    return OrchestrateConfig(
        router=args.router.rstrip("/"), prefill_urls=tuple(u.rstrip("/") for u in args.prefill),
        token=token, select_on=args.select_on,
        register=tuple(parse_decode_spec(s) for s in args.register), host=args.host,
        port=args.port, timeout=args.timeout)


def run(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("aiohttp") is None:
        raise ValueError("eldr orchestrate needs aiohttp: pip install -e '.[serve]' from the "
                         "source tree")
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from eldr.proxy.orchestrator import Orchestrator, SelectionUnavailable, serve

    config = config_from_args(args)
    try:
        asyncio.run(serve(Orchestrator(config)))
    except SelectionUnavailable as exc:  # registering at start-up failed
        raise ValueError(str(exc)) from None
    return 0
