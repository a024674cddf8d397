"""Calibration data: the trace format and its validation, synthetic traces (model presets,
workloads, sampling), real request arrivals (Azure 2023, Mooncake).

The package exports no names of its own: import from its modules (the trace record and its
files from :mod:`eldr.traces.trace`, synthetic traces from :mod:`eldr.traces.synth`, ...).
"""

__all__: list[str] = []
