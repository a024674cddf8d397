"""The offline fit: signatures and rho, (balanced) spherical K-means with exact capacity-
constrained assignment, the routing artifact, per-decoder expert placement."""
