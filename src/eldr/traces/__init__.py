"""Calibration data: the trace format and its validation, synthetic traces (model presets,
workloads, sampling), real request arrivals (Azure 2023, Mooncake)."""
