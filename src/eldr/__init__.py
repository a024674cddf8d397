"""ELDR: expert-locality-aware decode routing for PD-disaggregated MoE LLM serving.

The core (trace, signature, cluster, routing, cache, simulator) needs numpy, joblib and tqdm;
torch/transformers (capture), the HTTP stack (serve) and vLLM are optional extras that are
imported lazily by the modules that need them.
"""

__version__ = "0.1.0"
