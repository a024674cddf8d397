"""The offline fit: signatures and rho, the premises a trace must meet, (balanced) spherical
K-means with exact capacity-constrained assignment, the routing artifact, the profile
predictor of the cost policy, per-decoder expert placement."""
