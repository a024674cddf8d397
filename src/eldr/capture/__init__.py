"""Capture real expert routing from MoE models.

- :mod:`eldr.capture.payload`: the compact per-request expert-count payload carried in
  ``kv_transfer_params`` at the prefill→decode handoff (numpy only; the router imports
  it), with its base-91 digit codec :mod:`eldr.capture.digits`, and vLLM's
  ``routed_experts`` field (:mod:`eldr.capture.routed`).
- :mod:`eldr.capture.enginecache`: the prefill engine's signature cache (per-block expert
  counts co-indexed with vLLM's KV blocks), numpy only, wired by the plugin.
- :mod:`eldr.capture.hf`: forward hooks on the routers of Hugging Face transformers MoE
  models (torch/transformers imported lazily, only there).
- :mod:`eldr.capture.vllm_plugin`: a vLLM general plugin that records each request's
  prefill routing on vLLM-CPU and adds the payload to the prefill response.
- :mod:`eldr.capture.wide`: the wide tiny MoE, the shipped one with zero-padded expert
  FFNs (same function, more bytes per expert), built on first use into a cache folder
  (:func:`wide_tiny_moe_dir`, :func:`wide_engine_bytes`; numpy only).
"""

from __future__ import annotations

from pathlib import Path

from eldr.capture.wide import wide_engine_bytes, wide_tiny_moe_dir

__all__ = ["tiny_moe_dir", "tiny_moe_prompt_trace_path", "tiny_moe_trace_path", "wide_engine_bytes",
           "wide_tiny_moe_dir"]

_DATA = Path(__file__).resolve().parent.parent / "data"


def tiny_moe_dir() -> Path:
    """Folder of the tiny Qwen3-MoE shipped with eldr (weights, tokenizer, config)."""
    path = _DATA / "tiny_moe"
    if not (path / "config.json").is_file():
        raise ValueError(f"the tiny MoE is not installed at {path} "
                         "(rebuild it with scripts/train_tiny_moe.py)")
    return path


def tiny_moe_trace_path() -> Path:
    """The real trace captured from the tiny MoE on held-out prompts (``.npz``)."""
    path = _DATA / "traces" / "tiny_moe_heldout.npz"
    if not path.is_file():
        raise ValueError(f"the tiny-MoE trace is not installed at {path}")
    return path


def tiny_moe_prompt_trace_path() -> Path:
    """The tiny-MoE trace that has ``prompt_token_ids`` (``.npz``), for the prompt predictor.

    A newer capture than :func:`tiny_moe_trace_path`'s, with other prompts of the same ten
    domains (its ``code`` prompts are cut from eldr's own source); the sources and licences
    of its prompts are listed in ``data/traces/README.md``.
    """
    path = _DATA / "traces" / "tiny_moe_prompts.npz"
    if not path.is_file():
        raise ValueError(f"the tiny-MoE prompt trace is not installed at {path}")
    return path
