"""``eldr serve``: the ELDR router in front of vLLM prefill/decode instances."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

HELP = "Route an OpenAI API over vLLM prefill/decode instances, decode by expert locality."

_TOKEN_ENV = "ELDR_ADMIN_TOKEN"
_UPSTREAM_KEY_ENV = "ELDR_UPSTREAM_API_KEY"
_MAX_TOKEN_FILE_BYTES = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_engines(p)
    _add_routing(p)
    _add_server(p)
    _add_dependability(p)
    _add_processes(p)
    _add_learning(p)


def _add_engines(p: argparse.ArgumentParser) -> None:
    """The engines behind the router."""
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill instance, e.g. http://10.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", action="append", default=None, metavar="[ID=]URL",
                   help="a decode instance (repeatable); ID = its worker id in the artifact, "
                        "else decoders match the artifact's workers in order")
    p.add_argument("--decoders-file", default=None, metavar="PATH",
                   help="the decode instances, one [ID=]URL a line (# comments), instead of "
                        "--decode; SIGHUP re-reads it and adds or drains decoders to match "
                        "(docs/serve.md, the elastic decoder pool)")


def _add_routing(p: argparse.ArgumentParser) -> None:
    """The decode routing policy and its artifact."""
    from eldr.routing import POLICIES

    # oracle policies read labels a live request lacks: simulation only
    policies = sorted(n for n, spec in POLICIES.items() if not spec.evaluation_only)
    p.add_argument("--artifact", metavar="DIR", help="routing artifact written by eldr fit "
                   "(required by eldr and eldr_top1; eldr_cost uses its predictor and "
                   "cluster profiles when given, and runs without one)")
    p.add_argument("--policy", default="eldr_cost", choices=policies,
                   help="decode routing policy (default eldr_cost: the marginal expert cost, "
                        "never worse than load balancing in the simulator's grid)")
    p.add_argument("--tau", type=float, default=None,
                   help="locality band width (default: the artifact's)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the model's folder (tokenizer.json, tokenizer_config.json), to route "
                        "on the prompt with an artifact's prompt predictor; default: the "
                        "artifact's model folder when known (docs/serve.md, routing on the "
                        "prompt)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the chat template the engines use (vllm --chat-template), when the "
                        "tokenizer's folder has none")
    p.add_argument("--prompt-threads", type=int, default=2, metavar="N",
                   help="threads predicting prompts off the event loop (default 2)")
    p.add_argument("--prompt-processes", type=int, default=1, metavar="N",
                   help="processes tokenizing text prompts and chats (the tokenizer holds "
                        "the GIL); 0: the prompt threads tokenize (default 1)")
    p.add_argument("--prompt-queue", type=int, default=32, metavar="N",
                   help="prompt jobs in flight at most; a request finding it full is routed "
                        "by load, counted (default 32)")
    p.add_argument("--prompt-timeout", type=float, default=0.25, metavar="S",
                   help="seconds a decision waits for its prompt's prediction before routing "
                        "by load, counted (default 0.25)")
    p.add_argument("--decode-first", action="store_true",
                   help="choose the decoder before the prefill is sent (on the prompt's "
                        "prediction, else by load) and hold it while the prefill runs")
    p.add_argument("--decode-kv-params", action="append", default=[], metavar="NAME=JSON",
                   help="with --decode-first: a JSON object added to the prefill request's "
                        "kv_transfer_params when decoder NAME was chosen (a push connector's "
                        "address of it; repeatable)")
    p.add_argument("--load-slack", type=float, default=None, metavar="S",
                   help="eldr_cost only: no decoder may hold more than (1 + S) x the mean "
                        "load + 1, at all times (default: no bound, except near expert "
                        f"saturation, where S = {_cost_default('saturated_slack'):g})")
    p.add_argument("--cost-layer-stride", type=int, default=1, metavar="S",
                   help="eldr_cost only: price every S-th MoE layer (rows 0, S, 2S, ...) and "
                        "ask the prefill engines for those layers only; in the simulator S = 3 "
                        "routed as well as all layers at a third less decision time "
                        "(default 1: every layer)")


def _cost_default(name: str):
    """A default of :class:`eldr.routing.cost.CostPolicy` (the help states the code's)."""
    import inspect

    from eldr.routing.cost import CostPolicy

    return inspect.signature(CostPolicy.__init__).parameters[name].default


def _add_server(p: argparse.ArgumentParser) -> None:
    """Where the router listens, who may use it, what it accepts."""
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    p.add_argument("--admin-token-file", default=None, metavar="PATH",
                   help=f"file holding the bearer token of /admin/* and of /health's details "
                        f"(or env {_TOKEN_ENV}); without one the admin endpoints refuse every "
                        f"request")
    p.add_argument("--admin-token", default=None, help=argparse.SUPPRESS)  # ps shows it
    p.add_argument("--upstream-api-key-env", default=_UPSTREAM_KEY_ENV, metavar="NAME",
                   help=f"environment variable holding the API key the engines require "
                        f"(vllm --api-key); default {_UPSTREAM_KEY_ENV}, read if set")
    p.add_argument("--model", action="append", default=[], metavar="NAME",
                   help="accepted model name (repeatable; default: what the engines list)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--http-front", choices=("fast", "aiohttp"), default="fast",
                   help="the server of the generate routes: fast (their common requests "
                        "parsed and answered without aiohttp's request machinery, the rest "
                        "handed to it) or aiohttp (aiohttp's server for every request)")


def _add_dependability(p: argparse.ArgumentParser) -> None:
    """Timeouts, bounds, health, retries and containment (docs/failures.md)."""
    p.add_argument("--connect-timeout", type=float, default=3.0, metavar="S")
    p.add_argument("--prefill-timeout", type=float, default=120.0, metavar="S")
    p.add_argument("--decode-timeout", type=float, default=120.0, metavar="S",
                   help="seconds a decoder may stay silent, first byte included")
    p.add_argument("--write-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client may leave an answer unread before it is dropped "
                        "and its decode aborted")
    p.add_argument("--max-prefill-bytes", type=int, default=64 * 1024 * 1024,
                   help="largest prefill answer read (its expert payload included)")
    p.add_argument("--max-response-bytes", type=int, default=64 * 1024 * 1024,
                   help="largest non-streaming decode answer buffered")
    p.add_argument("--max-buffered-bytes", type=int, default=512 * 1024 * 1024,
                   help="all non-streaming answers buffered at once; more wait their turn")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S")
    p.add_argument("--scrape-interval", type=float, default=0.0, metavar="S",
                   help="read engines' /metrics for their load every S seconds (0: off)")
    p.add_argument("--engine-footprint", choices=("auto", "off"), default="auto",
                   help="with --scrape-interval: also read each decoder's live expert "
                        "footprint (GET /eldr/footprint) into eldr_cost (default auto)")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="prefill+decode attempts per request (default 3)")
    p.add_argument("--no-kv-release", dest="release_kv", action="store_false",
                   help="do not send a one-token decode to free the KV of a prefill whose "
                        "decoder refused the request (it then waits for the connector's "
                        "timeout)")
    p.add_argument("--short-prompt-tokens", type=int, default=None, metavar="N",
                   help="serve a prompt of fewer than N tokens whole on a decoder, without a "
                        "prefill (default: one KV block as the engines report it, else 16; "
                        "0: always disaggregate; docs/failures.md)")
    p.add_argument("--poison-ttl", type=float, default=300.0, metavar="S",
                   help="seconds a request body that made two engines die is refused (422) "
                        "(default 300)")
    p.add_argument("--retry-budget", type=float, default=0.2, metavar="RATIO",
                   help="retries of all requests together: at most RATIO per request over "
                        "the last 10 s, plus --retry-budget-min per second (default 0.2)")
    p.add_argument("--retry-budget-min", type=float, default=5.0, metavar="R",
                   help="retries per second always allowed, whatever the traffic (default 5)")
    p.add_argument("--breaker-failures", type=int, default=3,
                   help="consecutive failed requests that open a decoder's circuit breaker")
    p.add_argument("--breaker-backoff", type=float, default=5.0, metavar="S",
                   help="seconds an open breaker holds a decoder off before one probe; "
                        "doubled after each failed probe (up to 120 s)")


def _add_processes(p: argparse.ArgumentParser) -> None:
    """Router processes and logging."""
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="router processes on the port (SO_REUSEPORT), sharing each "
                        "decoder's load; for machines with more cores than one (default 1)")
    p.add_argument("--decoder-slots", type=int, default=None, metavar="C",
                   help="--workers > 1: decoders the workers' shared load table has room for, "
                        "the start-up ones and those added later (default max(2K, K + 16))")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"))


def _add_learning(p: argparse.ArgumentParser) -> None:
    """``--learn DIR`` and its settings (docs/learn.md)."""
    g = p.add_argument_group("learning from live traffic (docs/learn.md)")
    g.add_argument("--learn", metavar="DIR", default=None,
                   help="collect completed requests into a calibration trace in DIR, fit an "
                        "artifact when enough are in, validate it and swap it in; refit on "
                        "drift. Survives restarts (DIR is reloaded)")
    g.add_argument("--learn-min-requests", type=int, default=500, metavar="N",
                   help="requests before the first fit, and new ones per refit (default 500)")
    g.add_argument("--learn-max-requests", type=int, default=4000, metavar="N",
                   help="requests kept in the buffer, oldest dropped (default 4000)")
    g.add_argument("--learn-holdout", type=float, default=0.25, metavar="F",
                   help="fraction of a fit's requests held out to validate it (default 0.25)")
    g.add_argument("--learn-drift-window", type=int, default=100, metavar="N",
                   help="requests per drift test (default 100)")
    g.add_argument("--learn-drift-alpha", type=float, default=0.01, metavar="A",
                   help="false-alarm level of one drift test (default 0.01)")
    g.add_argument("--learn-no-drift", dest="learn_drift", action="store_false",
                   help="never refit on drift (fit once)")
    g.add_argument("--learn-persist-interval", type=float, default=30.0, metavar="S",
                   help="seconds between writes of the buffer to DIR (default 30)")


def config_from_args(args: argparse.Namespace):
    from eldr.proxy.config import ServeConfig, parse_decode_spec

    decoders_file = getattr(args, "decoders_file", None)
    if (args.decode is None) == (decoders_file is None):
        raise ValueError("give the decode instances with --decode [ID=]URL (repeatable) or "
                         "with --decoders-file PATH, one of the two")
    if decoders_file is not None:
        from eldr.proxy.config import read_decoders_file

        specs = read_decoders_file(decoders_file)
    else:
        specs = [parse_decode_spec(s) for s in args.decode]
    ids = [i for i, _ in specs]
    if any(i is None for i in ids) and any(i is not None for i in ids):
        raise ValueError("give worker ids for all --decode URLs (ID=URL) or for none")
    return ServeConfig(
        prefill_urls=tuple(args.prefill), decode_urls=tuple(u for _, u in specs),
        decode_ids=None if ids[0] is None else tuple(ids), artifact=args.artifact,
        policy=args.policy, tau=args.tau, load_slack=args.load_slack,
        cost_layer_stride=args.cost_layer_stride, host=args.host,
        port=args.port,
        admin_token=_admin_token(args),
        upstream_api_key=os.environ.get(args.upstream_api_key_env) or None,
        models=tuple(args.model), max_body_bytes=args.max_body_bytes,
        http_front=getattr(args, "http_front", "fast"),
        connect_timeout=args.connect_timeout, prefill_timeout=args.prefill_timeout,
        decode_read_timeout=args.decode_timeout, write_timeout=args.write_timeout,
        max_prefill_bytes=args.max_prefill_bytes, max_response_bytes=args.max_response_bytes,
        max_buffered_bytes=args.max_buffered_bytes,
        health_interval=args.health_interval,
        health_timeout=min(2.0, args.health_interval), scrape_interval=args.scrape_interval,
        engine_footprint=args.engine_footprint,
        max_attempts=args.max_attempts, release_kv=args.release_kv,
        short_prompt_tokens=args.short_prompt_tokens, poison_ttl=args.poison_ttl,
        retry_budget_ratio=args.retry_budget, retry_budget_min=args.retry_budget_min,
        breaker_failures=args.breaker_failures,
        breaker_backoff=args.breaker_backoff,
        breaker_max_backoff=max(120.0, args.breaker_backoff), workers=args.workers,
        decoders_file=decoders_file, tokenizer=getattr(args, "tokenizer", None),
        chat_template=getattr(args, "chat_template", None),
        prompt_threads=getattr(args, "prompt_threads", 2),
        prompt_processes=getattr(args, "prompt_processes", 1),
        prompt_queue=getattr(args, "prompt_queue", 32),
        prompt_timeout=getattr(args, "prompt_timeout", 0.25),
        decode_first=getattr(args, "decode_first", False),
        decode_kv_params=_decode_kv_params(getattr(args, "decode_kv_params", [])))


def _decode_kv_params(specs: list[str]) -> tuple[tuple[str, str], ...]:
    """``NAME=JSON`` options as (name, JSON text) pairs (ServeConfig checks both)."""
    out = []
    for spec in specs:
        name, sep, text = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"--decode-kv-params {spec!r}: give NAME=JSON")
        out.append((name, text))
    return tuple(out)


def _admin_token(args: argparse.Namespace) -> str | None:
    """The admin token from --admin-token-file, else the environment, else --admin-token.

    A token on the command line is visible to every user of the machine (``ps``): it still
    works, with a warning, but the file or the environment is the way.
    """
    if args.admin_token_file is not None:
        from eldr.fileio import open_regular

        with open_regular(args.admin_token_file, max_bytes=_MAX_TOKEN_FILE_BYTES,
                          what="an admin token file") as fh:
            try:
                token = fh.read().decode("utf-8").strip()
            except UnicodeDecodeError:
                raise ValueError(f"{args.admin_token_file}: the admin token is not UTF-8 "
                                 f"text") from None
        if not token:
            raise ValueError(f"{args.admin_token_file}: the admin token file is empty")
        return token
    if os.environ.get(_TOKEN_ENV):
        return os.environ[_TOKEN_ENV]
    if args.admin_token:
        print(f"eldr serve: warning: --admin-token is visible in the process list; use "
              f"--admin-token-file or {_TOKEN_ENV}", file=sys.stderr)
        return args.admin_token
    return None


def learn_config_from_args(args: argparse.Namespace):
    """The :class:`~eldr.learn.config.LearnConfig` of ``--learn DIR`` (None without it)."""
    if getattr(args, "learn", None) is None:
        return None
    from eldr.learn.config import LearnConfig

    return LearnConfig(directory=args.learn, min_requests=args.learn_min_requests,
                       max_requests=args.learn_max_requests, holdout=args.learn_holdout,
                       drift=args.learn_drift, drift_window=args.learn_drift_window,
                       drift_alpha=args.learn_drift_alpha,
                       persist_interval=args.learn_persist_interval)


def start_artifact(learn) -> str | None:
    """The learned artifact a restarted router starts with (None: none saved, or no
    ``--learn``)."""
    if learn is None:
        return None
    from eldr.learn.controller import learned_artifact

    return learned_artifact(learn.directory)


def configure(config, args: argparse.Namespace):
    """(serve config, learn config or None) from ``eldr serve``'s arguments: with
    ``--learn DIR`` and no ``--artifact``, the router starts with the artifact it learned
    last in DIR (none: it starts without one, a policy that needs one, such as ``eldr``,
    running ``eldr_cost`` until the first learned artifact is swapped in)."""
    import dataclasses

    learn = learn_config_from_args(args)
    if learn is not None and config.artifact is None:
        config = dataclasses.replace(config, artifact=start_artifact(learn), stand_in=True)
    return config, learn


def run(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [m for m in ("aiohttp", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"eldr serve needs {' and '.join(missing)}: pip install -e '.[serve]' "
                         f"from the source tree")
    from eldr.proxy.app import Router
    from eldr.proxy.serving import serve

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, learn = configure(config_from_args(args), args)
    router = Router(config)  # a bad artifact fails here, before any socket or worker
    if config.workers > 1:
        from eldr.proxy.workers import run_workers

        names = router.state.worker_names
        slots = args.decoder_slots
        if slots is not None and not len(names) <= slots <= 65536:
            raise ValueError(f"--decoder-slots must be in [{len(names)}, 65536] (the "
                             f"decoders given at least), got {slots}")
        del router
        from eldr.proxy.selection import SelectionTable

        reservations = SelectionTable(config.workers)  # the selection API's, before fork

        def make_router(cfg, share):
            worker = Router(cfg, share=share)  # the shared loads and guards of its row
            worker.selection.share(reservations, share.row)
            if learn is not None:  # worker 0 learns, the others forward to it
                worker.learn(learn, forward=share.row != 0)
            return worker

        return run_workers(config, make_router, names=names, capacity=slots)
    if learn is not None:
        router.learn(learn)
    try:
        import uvloop  # optional: a faster event loop when installed
    except ModuleNotFoundError:
        asyncio.run(serve(router))
    else:
        uvloop.run(serve(router))
    return 0
