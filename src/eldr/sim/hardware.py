"""Hardware: the :class:`Hardware` record the step-time model reads, and hardware files,
a :class:`Hardware` measured on your own machines.

The presets (``h200``, ``mi300x``, ``cpu``) and what their numbers are stay in
:mod:`eldr.sim.config`, which re-exports :class:`Hardware`; this module holds the record
itself so that config can read files through it without an import circle.

``eldr calibrate`` writes one from decode steps timed on running engines
(:mod:`eldr.sim.stepfit`); ``eldr simulate --hardware FILE`` and ``eldr reproduce
--hardware FILE`` read it (:func:`eldr.sim.config.get_hardware` takes a path to an
existing ``.json`` file). The format (docs/simulator.md#your-own-hardware-eldr-calibrate)::

    {"format": "eldr-hardware/1", "name": "my-gpu",
     "hbm_bandwidth": 4.8e12, "hbm_bytes": 141e9, "peak_flops": 989e12, "t_fixed_s": 0.002,
     "moe_fits": [{"model": "qwen3-30b-a3b", "a_us": 18.7, "b_us": 2.22, "c_us": 0.0,
                   "r2": 0.99, "layers": 48, "experts": 128, "top_k": 8}],
     "source": {"how": "eldr calibrate", "engine": "http://...", "steps": 1234,
                "date": "2026-12-01T..."}}

Units: B/s, bytes, FLOP/s, seconds, µs. ``moe_fits[].model`` must be a model preset of
:mod:`eldr.traces.models` (a fit is per model: ``b`` is the time of one expert of THAT
model); ``layers`` / ``experts`` / ``top_k``, when given, must match the preset (a fit of
another shape is refused, not silently applied). ``a_us`` and ``b_us`` become
``Hardware.moe_fits``, and as for the ``cpu`` preset the hardware then resolves those
models only; ``c_us``, ``r2`` and ``source`` are informational and kept in the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from eldr.fileio import atomic_write_text
from eldr.sim.stepfit import StepFit
from eldr.traces.models import ALL_PRESETS, ModelPreset, get_preset

__all__ = ["A_OVER_B_MI300X", "FORMAT", "Hardware", "hardware_from_fit", "is_hardware_file",
           "load_hardware", "save_hardware"]

# a / b from the paper's 4.7x at D = 16 -> 128: (128 - 4.7*16) / (4.7 - 1)
A_OVER_B_MI300X = (128 - 4.7 * 16) / (4.7 - 1)  # = 14.27
FORMAT = "eldr-hardware/1"
_MAX_BYTES = 1 << 20  # a hardware file is a few hundred bytes; refuse anything huge
_POSITIVE = ("hbm_bandwidth", "hbm_bytes", "peak_flops")


@dataclass(frozen=True)
class Hardware:
    """One accelerator, as the step-time model sees it (the presets and what their
    numbers mean: :mod:`eldr.sim.config`)."""

    name: str  # preset key, or the name a hardware file gives
    hbm_bandwidth: float  # B/s of HBM (weights and KV are streamed at this rate)
    hbm_bytes: float  # HBM capacity in bytes (KV capacity = util x HBM - weights)
    peak_flops: float  # dense bf16 FLOP/s (prefill is compute bound)
    t_fixed_s: float  # fixed per-step overhead in seconds (eldr.sim.config)
    measured_moe: bool  # True: a, b measured (preset or moe_fits); False: derived
    a_over_b: float = A_OVER_B_MI300X  # a = a_over_b x b when not measured
    # (model preset, a µs, b µs) measured on THIS hardware; when any is given, the hardware
    # resolves those models only (no derived constants for the rest)
    moe_fits: tuple[tuple[str, float, float], ...] = ()
    # the HBM bandwidth (B/s) the model presets' measured a, b were taken at, when that is
    # not this hardware's (the h100 preset reads the H200 fits: 4.8e12): b is scaled by
    # fit_bandwidth / hbm_bandwidth (an expert is streamed at this bandwidth), a is kept
    # (launch and routing overheads of the same chip). None: the fits are this hardware's
    fit_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for name in ("hbm_bandwidth", "hbm_bytes", "peak_flops", "a_over_b"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be > 0, "
                                 f"got {getattr(self, name)!r}")
        for model, a_us, b_us in self.moe_fits:
            if not (a_us >= 0 and b_us > 0):
                raise ValueError(f"hardware {self.name!r}: fit of {model!r} needs a >= 0 and "
                                 f"b > 0 µs, got a={a_us!r}, b={b_us!r}")
        if self.fit_bandwidth is not None and not self.fit_bandwidth > 0:
            raise ValueError(f"hardware {self.name!r}: fit_bandwidth must be > 0 or None, "
                             f"got {self.fit_bandwidth!r}")
        if not self.t_fixed_s >= 0:
            raise ValueError(f"hardware {self.name!r}: t_fixed_s must be >= 0, "
                             f"got {self.t_fixed_s!r}")


def is_hardware_file(name: str | os.PathLike) -> bool:
    """``name`` reads as a hardware file (a ``.json`` path), not a preset name."""
    return str(name).strip().lower().endswith(".json")


def _number(doc: dict, key: str, where: str, *, positive: bool) -> float:
    v = doc.get(key)
    if v is None:
        raise ValueError(f"{where}: missing field {key!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{where}: {key} must be a finite number, got {v!r}")
    if (v <= 0) if positive else (v < 0):
        raise ValueError(f"{where}: {key} must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def _read_fit(entry: object, where: str) -> tuple[str, float, float]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be an object, got {type(entry).__name__}")
    name = entry.get("model")
    if not isinstance(name, str):
        raise ValueError(f"{where}: missing field 'model' (a model preset name)")
    try:
        preset = get_preset(name)
    except ValueError:
        raise ValueError(f"{where}: unknown model {name!r}; a fit must name a model preset: "
                         f"{', '.join(ALL_PRESETS)}") from None
    a_us = _number(entry, "a_us", where, positive=False)
    b_us = _number(entry, "b_us", where, positive=True)
    for key in ("c_us", "r2"):  # informational, but never garbage
        if entry.get(key) is not None:
            v = entry[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}: {key} must be a finite number, got {v!r}")
    for key, want in (("layers", preset.num_layers), ("experts", preset.num_experts),
                      ("top_k", preset.top_k)):
        got = entry.get(key)
        if got is not None and got != want:
            raise ValueError(f"{where}: {key}={got!r} but model preset {preset.name!r} has "
                             f"{want}; this fit is of another model")
    return preset.name, a_us, b_us


def load_hardware(path: str | os.PathLike) -> Hardware:
    """The :class:`Hardware` of a hardware file; ``ValueError`` naming the field and the
    file for an unknown format, a missing field, a non-positive number or an unknown
    model (``OSError`` when it cannot be read)."""
    where = f"hardware file {os.fspath(path)}"
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{where}: no such file")
    if p.stat().st_size > _MAX_BYTES:
        raise ValueError(f"{where}: larger than {_MAX_BYTES} bytes, not a hardware file")
    try:
        doc = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: must be a JSON object")
    if doc.get("format") != FORMAT:
        raise ValueError(f"{where}: format {doc.get('format')!r}, expected {FORMAT!r}")
    name = doc.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: missing field 'name' (a non-empty string)")
    values = {k: _number(doc, k, where, positive=True) for k in _POSITIVE}
    t_fixed = _number(doc, "t_fixed_s", where, positive=False)
    fits = doc.get("moe_fits", [])
    if not isinstance(fits, list):
        raise ValueError(f"{where}: moe_fits must be a list")
    moe_fits = tuple(_read_fit(f, f"{where}: moe_fits[{i}]") for i, f in enumerate(fits))
    seen = [m for m, _, _ in moe_fits]
    if len(set(seen)) != len(seen):
        raise ValueError(f"{where}: moe_fits names a model twice ({', '.join(seen)})")
    return Hardware(name.strip(), t_fixed_s=t_fixed, measured_moe=bool(moe_fits),
                    moe_fits=moe_fits, **values)


def save_hardware(hw: Hardware, path: str | os.PathLike, *, source: dict | None = None,
                  fit_notes: dict[str, dict] | None = None) -> Path:
    """Write ``hw`` as a hardware file, atomically (readers see the old file or the new
    one). ``fit_notes`` adds informational keys (``c_us``, ``r2``, ...) to the fit of the
    model it names; ``source`` says how the numbers were obtained. The model's shape
    (``layers``, ``experts``, ``top_k``) is written from its preset."""
    notes = fit_notes or {}
    unknown = set(notes) - {m for m, _, _ in hw.moe_fits}
    if unknown:
        raise ValueError(f"save_hardware: notes for models without a fit: {sorted(unknown)}")
    fits = []
    for model, a_us, b_us in hw.moe_fits:
        preset = get_preset(model)
        fits.append({"model": preset.name, "a_us": float(a_us), "b_us": float(b_us),
                     **notes.get(model, {}), "layers": preset.num_layers,
                     "experts": preset.num_experts, "top_k": preset.top_k})
    doc = {"format": FORMAT, "name": hw.name, "hbm_bandwidth": float(hw.hbm_bandwidth),
           "hbm_bytes": float(hw.hbm_bytes), "peak_flops": float(hw.peak_flops),
           "t_fixed_s": float(hw.t_fixed_s), "moe_fits": fits}
    if source is not None:
        doc["source"] = source
    out = atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    load_hardware(out)  # never leave a file the loader refuses
    return out


def hardware_from_fit(fit: StepFit, model: str | ModelPreset, base: Hardware,
                      name: str) -> Hardware:
    """A :class:`Hardware` from a whole-step fit (:mod:`eldr.sim.stepfit`): bandwidth,
    memory and FLOP/s of ``base``; ``b`` the fitted one; ``a = 0`` and
    ``t_fixed = t0 − dense_bytes / bandwidth`` (clipped at 0), because whole steps cannot
    tell a per-layer constant from a per-step one and the simulator adds the dense weight
    read itself. The fit's ``c`` (per token) has no slot: the simulator's KV read plays
    that part. ``ValueError`` when the fitted ``b`` is not > 0."""
    preset = get_preset(model)
    if not fit.b_s > 0:
        raise ValueError(f"the fitted b = {fit.b_s * 1e6:.3g} µs per distinct expert is not "
                         "> 0: the steps do not show an expert cost (more varied traffic?)")
    t_fixed = max(0.0, fit.t0_s - preset.dense_bytes_per_step / base.hbm_bandwidth)
    return Hardware(name, hbm_bandwidth=base.hbm_bandwidth, hbm_bytes=base.hbm_bytes,
                    peak_flops=base.peak_flops, t_fixed_s=t_fixed, measured_moe=True,
                    moe_fits=((preset.name, 0.0, fit.b_s * 1e6),))
