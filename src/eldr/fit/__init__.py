"""The offline fit: signatures and rho, the premises a trace must meet, (balanced) spherical
K-means with exact capacity-constrained assignment, the profile predictor of the cost
policy, the one fit recipe that runs them on a calibration trace (``calibration``), the
routing artifact, per-decoder expert placement. Import from the modules; the package
itself exports nothing."""

__all__: list[str] = []
