"""``eldr calibrate``: a hardware file from decode steps timed on running engines.

Engines running the eldr capture plugin time each decode step and serve the last 4,096
as ``GET /eldr/steps`` (docs/capture.md#step-timings). This command reads them (or
recorded copies, ``--metrics-file``), fits ``t = t0 + b·Σ_l D_l + c·B``
(:mod:`eldr.sim.stepfit`), takes bandwidth, memory and FLOP/s from a preset (``--base``)
and writes a hardware file (:mod:`eldr.sim.hardware`) for ``eldr simulate --hardware
FILE`` (docs/simulator.md#your-own-hardware-eldr-calibrate).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

HELP = ("Fit the simulator's step model to decode steps timed on running engines with the "
        "eldr plugin and write a hardware file.")

_MAX_DOC_BYTES = 16 << 20  # a full ring is about 75 kB
_TOKENS_PER_REQUEST = 16  # what the "send N more requests" estimate assumes


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eldr.sim.stepfit import MIN_STEPS

    p.add_argument("--engine", action="append", default=[], metavar="URL",
                   help="a vLLM engine running the eldr plugin (repeatable); its "
                   "GET /eldr/steps is read")
    p.add_argument("--metrics-file", action="append", default=[], metavar="FILE",
                   help="a recorded GET /eldr/steps document instead of a live engine "
                   "(repeatable)")
    p.add_argument("--model", required=True, help="model preset the engines serve "
                   "(eldr.traces.models; its layers must match the engines')")
    p.add_argument("-o", "--out", required=True, help="hardware file to write (.json)")
    p.add_argument("--base", help="preset whose bandwidth, memory and FLOP/s the file "
                   "takes (default: cpu for tiny-moe, else h200)")
    p.add_argument("--name", help="hardware name in the file (default: calibrated-MODEL)")
    p.add_argument("--min-steps", type=int, default=MIN_STEPS,
                   help=f"fewest decode steps without prompt rows to fit (default "
                   f"{MIN_STEPS})")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for enough steps (polling each second)")
    p.add_argument("--include-mixed", action="store_true",
                   help="also fit steps that ran prompt rows (left out by default)")


class _NoPlugin(ValueError):
    """The engine answers, but has no eldr step timings route."""


def _get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read(_MAX_DOC_BYTES + 1)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(4096)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"engine {url.rsplit('/eldr', 1)[0]} not reachable: {reason}") from None


def _read_engine(url: str):
    """(StepColumns or None when the plugin has no timed step yet, lifetime timed steps
    per /metrics or None) of one engine; ``_NoPlugin`` for an engine without the plugin."""
    from eldr.capture.decode import decode_step_ring

    base = url.rstrip("/")
    status, body = _get(base + "/eldr/steps")
    if status == 404:
        try:
            has_plugin = "eldr_steps" in json.loads(body)
        except ValueError:
            has_plugin = False
        if not has_plugin:
            raise _NoPlugin(f"engine {base} has no eldr plugin (GET /eldr/steps: 404): start "
                            "it with the eldr capture plugin (eldr cluster does; "
                            "docs/capture.md)")
        return None, _metrics_steps(base)
    if status != 200:
        raise ValueError(f"engine {base}: GET /eldr/steps answered {status}")
    if len(body) > _MAX_DOC_BYTES:
        raise ValueError(f"engine {base}: GET /eldr/steps is over {_MAX_DOC_BYTES} bytes")
    try:
        return decode_step_ring(json.loads(body)), _metrics_steps(base)
    except ValueError as exc:
        raise ValueError(f"engine {base}: {exc}") from None


def _metrics_steps(base: str) -> float | None:
    """``eldr_engine_step_seconds_count`` of the engine's /metrics (None: not there)."""
    try:
        status, body = _get(base + "/metrics")
    except ValueError:
        return None
    if status != 200:
        return None
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("eldr_engine_step_seconds_count"):
            try:
                return float(line.split()[-1])
            except ValueError:
                return None
    return None


def _read_file(path: str):
    from eldr.capture.decode import decode_step_ring
    from eldr.fileio import open_regular

    with open_regular(path, max_bytes=_MAX_DOC_BYTES, what="a recorded /eldr/steps") as fh:
        try:
            doc = json.load(fh)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    try:
        return decode_step_ring(doc)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _collect(args) -> tuple[list, list[str]]:
    """[(source, StepColumns or None)] and notes, for every engine and file."""
    found, notes = [], []
    for path in args.metrics_file:
        found.append((path, _read_file(path)))
    for url in args.engine:
        cols, lifetime = _read_engine(url)
        if cols is not None and lifetime is None:
            notes.append(f"{url}: no eldr_engine_step_seconds on /metrics "
                         "(PROMETHEUS_MULTIPROC_DIR set?); /eldr/steps used alone")
        found.append((url, cols))
    return found, notes


def _usable(found, include_mixed: bool) -> int:
    return sum(len(c.wall_s) if include_mixed else int((~c.mixed).sum())
               for _, c in found if c is not None)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from eldr.sim.config import get_hardware
    from eldr.sim.hardware import hardware_from_fit, save_hardware
    from eldr.sim.stepfit import fit_step_model
    from eldr.traces.models import get_preset

    if not args.engine and not args.metrics_file:
        raise ValueError("give --engine URL or --metrics-file FILE (at least one)")
    if args.min_steps < 3:
        raise ValueError(f"--min-steps must be >= 3, got {args.min_steps}")
    if not (math.isfinite(args.wait) and args.wait >= 0):
        raise ValueError(f"--wait must be >= 0 seconds, got {args.wait}")
    preset = get_preset(args.model)
    base = get_hardware(args.base or ("cpu" if preset.name == "tiny-moe" else "h200"))
    deadline = time.monotonic() + args.wait
    try:
        found, notes = _collect(args)
        while (_usable(found, args.include_mixed) < args.min_steps and args.engine
               and time.monotonic() < deadline):
            time.sleep(1.0)
            found, notes = _collect(args)
    except _NoPlugin as exc:
        print(f"eldr calibrate: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"eldr calibrate: note: {note}", file=sys.stderr)
    for source, cols in found:
        if cols is not None and cols.num_layers != preset.num_layers:
            raise ValueError(f"{source}: steps of a model with {cols.num_layers} MoE layers, "
                             f"but --model {preset.name} has {preset.num_layers}")
    have = _usable(found, args.include_mixed)
    if have < args.min_steps:
        missing = args.min_steps - have
        more = -(-missing // (_TOKENS_PER_REQUEST - 1))
        idle = [src for src, c in found if c is None]
        hint = (f" ({', '.join(idle)}: no timed decode step yet; an engine times its decode "
                "steps with a KV connector or ELDR_CAPTURE=all)" if idle else "")
        print(f"eldr calibrate: {have} timed decode steps without prompt rows, "
              f"{args.min_steps} needed: send at least {more} more requests of "
              f"{_TOKENS_PER_REQUEST}+ output tokens (at varied concurrency) and run again"
              f"{hint}", file=sys.stderr)
        return 2
    cols = [c for _, c in found if c is not None]
    fit = fit_step_model(np.concatenate([c.wall_s for c in cols]),
                         np.concatenate([c.tokens for c in cols]),
                         np.concatenate([c.distinct_sum for c in cols]),
                         mixed=np.concatenate([c.mixed for c in cols]),
                         include_mixed=args.include_mixed, num_layers=preset.num_layers,
                         min_steps=args.min_steps)
    print(fit.describe(preset.name))
    hw = hardware_from_fit(fit, preset, base, args.name or f"calibrated-{preset.name}")
    source = {"how": "eldr calibrate", "steps": fit.n,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "base": base.name, "t0_us": fit.t0_s * 1e6,
              "residual_us": fit.residual_s * 1e6}
    if args.engine:
        source["engines"] = list(args.engine)
    if args.metrics_file:
        source["files"] = list(args.metrics_file)
    out = save_hardware(hw, args.out, source=source,
                        fit_notes={preset.name: {"c_us": fit.c_s * 1e6, "r2": fit.r2}})
    print(f"wrote {out}: hardware {hw.name!r}, t_fixed {hw.t_fixed_s * 1e3:.3f} ms (t0 less "
          f"the dense read), a 0, b {fit.b_s * 1e6:.3f} µs; bandwidth, memory and FLOP/s of "
          f"{base.name!r}")
    return 0
