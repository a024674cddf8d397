"""``eldr advise TRACE``: what ELDR would buy on your own routing, before you switch
(docs/real-models.md, "eldr advise")."""

from __future__ import annotations

import argparse
import json

HELP = ("Advise on your own routing trace (eldr import / capture / learn export): rho, the "
        "distinct-expert cut, simulated TPOT vs JSQ, and whether ELDR is worth it.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eldr.sim import HARDWARE

    p.add_argument("trace", metavar="TRACE", help="trace file (.npz): eldr import, eldr "
                   "capture, eldr learn export, or a shipped real trace's name "
                   "(gpt-oss-20b, esft-vanilla-lite)")
    p.add_argument("--model", metavar="PRESET|config.json", help="the model's step costs: "
                   "a preset name, or its Hugging Face config.json (default: the preset the "
                   "trace's model names)")
    p.add_argument("--hardware", default="h200", metavar="PRESET|hw.json",
                   help=f"hardware preset ({', '.join(sorted(HARDWARE))}; default h200) or a "
                   "hardware file written by eldr calibrate")
    p.add_argument("--arrivals", metavar="FILE", help="replay these arrival times (an Azure "
                   "CSV or Mooncake JSONL, or azure_conv / mooncake_conv) instead of the "
                   "highest Poisson load the trace sustains")
    p.add_argument("--decoders", type=int, metavar="K", help="decode workers (default 8, "
                   "fewer for a small trace: 16 held-out requests each)")
    p.add_argument("--seeds", type=int, default=3, help="seeds, each its own split, fit and "
                   "arrivals (default 3; the intervals need 2)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=10.0, help="warm-up seconds per run")
    p.add_argument("--plot", metavar="PNG", help="also draw TPOT vs JSQ and the cut vs batch "
                   "size (needs matplotlib: the report extra)")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def _trace(name: str):
    from pathlib import Path

    from eldr.traces.real import REAL_TRACES, load_real_trace
    from eldr.traces.trace import load

    if name in REAL_TRACES and not Path(name).exists():
        return load_real_trace(name)
    return load(name)


def _model(text: str | None):
    if text is None or not text.strip().lower().endswith(".json"):
        return text
    from pathlib import Path

    from eldr.traces.models import preset_from_config

    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--model {text}: no such file")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model {text}: not JSON ({exc})") from None
    return preset_from_config(doc, where=f"--model {text}")


def run(args: argparse.Namespace) -> int:
    import sys

    from eldr.reproduce.advise import advice_json, advise, format_advice, plot_advice
    from eldr.sim.config import get_hardware

    if args.seeds < 2:
        raise ValueError(f"--seeds must be >= 2 (an interval needs two), got {args.seeds}")
    if not args.duration > 0 or not args.warmup >= 0:
        raise ValueError(f"--duration must be > 0 and --warmup >= 0, got {args.duration}, "
                         f"{args.warmup}")
    if args.plot:
        from eldr.reproduce.plots import require_matplotlib

        require_matplotlib()
    trace = _trace(args.trace)
    model = _model(args.model)
    hardware = get_hardware(args.hardware)
    times = None
    if args.arrivals:
        from eldr.traces import arrivals as arr

        name = args.arrivals.strip()
        real = arr.default_arrivals(name) if name.lower() in arr.DEFAULT_ARRIVALS \
            else arr.load_arrivals(name)
        times = real.times

    def log(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    a = advise(trace, model=model, hardware=hardware, decoders=args.decoders,
               arrival_times=times, seeds=args.seeds, seed=args.seed,
               warmup_s=args.warmup, duration_s=args.duration, log=log)
    if args.plot and a.comparison is not None:
        plot_advice(a, args.plot)
    if args.json:
        print(advice_json(a))
    else:
        print(format_advice(a))
        if args.plot and a.comparison is not None:
            print(f"plot: {args.plot}")
    return 0
