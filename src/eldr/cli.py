"""The ``eldr`` command line: a thin dispatcher over :mod:`eldr.commands`.

Each sub-command lives in ``eldr/commands/<name>.py`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Errors a user can fix (bad files,
bad values) are ``ValueError``/``OSError``: they end the command with exit code 2 and a
single line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown by ``eldr --help``.
COMMANDS: tuple[str, ...] = (
    "reproduce",
    "synth",
    "score",
    "advise",
    "fit",
    "place",
    "simulate",
    "calibrate",
    "capture",
    "widen",
    "serve",
    "cluster",
    "orchestrate",
    "learn",
    "import",  # eldr/commands/importing.py (``import`` is a keyword)
)


def _load(name: str):
    try:
        module = {"import": "importing"}.get(name, name)
        return importlib.import_module(f"eldr.commands.{module}")
    except ModuleNotFoundError as exc:
        if exc.name == f"eldr.commands.{module}":
            return None  # not built yet
        raise


def build_parser() -> argparse.ArgumentParser:
    from eldr import __version__

    parser = argparse.ArgumentParser(
        prog="eldr",
        description="Expert-locality-aware decode routing for PD-disaggregated MoE serving.",
    )
    parser.add_argument("--version", action="version", version=f"eldr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = _load(name)
        if module is None:
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"eldr {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eldr {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
