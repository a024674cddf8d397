"""Calibration data: the trace format and its validation, synthetic traces (model presets,
workloads, sampling), real request arrivals (Azure 2023, Mooncake), recorded routing
imported from other stacks (:mod:`eldr.traces.importers`) and the real routing of two
production-size MoE models shipped with eldr (:mod:`eldr.traces.real`).

The package exports only the shipped real traces' locator; import everything else from its
modules (the trace record and its files from :mod:`eldr.traces.trace`, synthetic traces
from :mod:`eldr.traces.synth`, ...).
"""

from eldr.traces.real import REAL_TRACES, load_real_trace, real_trace_path

__all__ = ["REAL_TRACES", "load_real_trace", "real_trace_path"]
