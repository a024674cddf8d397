"""Calibration data: the trace format and its validation, synthetic traces (model presets,
workloads, sampling), the published premises they are calibrated to, real request arrivals."""
