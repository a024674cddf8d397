"""vLLM general plugin: record each request's expert routing and hand it to the router.

Registered under the ``vllm.general_plugins`` entry point (``eldr_capture``), so vLLM calls
:func:`register` in every process it starts (API server, engine core, worker). It patches
methods idempotently (docs/capture.md lists them and why):

- worker: ``GPUModelRunner`` (every v1 build; vLLM-CPU's ``CPUModelRunner`` derives from
  it and overrides ``load_model``, wrapped too). ``load_model`` attaches a capture
  function to every MoE layer's ``BaseRouter`` (``set_capture_fn``) that copies the
  step's top-k ids into one preallocated ``(max_num_batched_tokens, L, k)`` int32 tensor
  on the model's device, and nothing else (no Python conversion inside the forward pass:
  one stalls ``torch.compile`` for minutes). ``execute_model`` splits the rows by
  request: prompt rows become per-request counts (and, with prefix caching, per-block
  rows: :mod:`eldr.capture.enginecache`); on an engine with a KV connector (or
  ``ELDR_CAPTURE=all``) decode rows become a :class:`~eldr.capture.decode.DecodeStep`.
  ``sample_tokens`` attaches both to the ``ModelRunnerOutput`` (``eldr_prefill``,
  ``eldr_decode``), which vLLM already pickles to the engine core. A decode step's
  ``wall_s`` is the time spent inside vLLM's ``execute_model`` plus ``sample_tokens`` of
  that step (``time.perf_counter`` around each original call; the plugin's own work and
  whatever the engine core does between the two calls left out).
- engine core: ``Scheduler.update_from_output`` accumulates them; a finished prefill leg
  (``do_remote_decode``) gets the payload of :mod:`eldr.capture.payload` under ``"eldr"``
  of its ``kv_transfer_params``, a finished decode leg the decode payload
  (:mod:`eldr.capture.vllm_decode`); ``BlockPool`` hooks evict signature-cache rows with
  their blocks.
- API server: the stream generators, a ``/metrics`` collector and the
  ``GET /eldr/footprint`` route (:func:`eldr.capture.vllm_decode.install_api_server_hooks`).

A reused block without a row (loaded by a KV connector, or cached before the plugin saw
it) is left out and ``tokens`` says how much of the prompt the counts cover: partial,
never stale. Layers are the MoE layers in model order. ``ELDR_CAPTURE=0`` disables it.
"""

from __future__ import annotations

import logging
import os
import time
from copy import copy
from functools import wraps

import numpy as np

from eldr.capture.decode import DecodeStep, decode_step
from eldr.capture.enginecache import (
    POOL_HOOKS,
    PrefillStep,
    chunk_rows,
)
from eldr.capture.payload import PAYLOAD_KEY
from eldr.capture.vllm_decode import (
    absorb_decode,
    attach_decode,
    flush_steps,
    install_api_server_hooks,
)
from eldr.capture.vllm_prefill import absorb, attach_payloads

__all__ = ["register"]

# A child of vLLM's "vllm" logger: vLLM configures that one's handler in every process it
# starts, so these lines show in the engine's own log (an "eldr..." logger would not).
logger = logging.getLogger("vllm.eldr_capture")
_PATCHED = "_eldr_capture_patched"


def register() -> None:
    """Entry point: patch the CPU model runner and the scheduler (safe to call twice)."""
    mode = os.environ.get("ELDR_CAPTURE", "prefill")
    if mode == "0":
        return
    if mode not in ("prefill", "all"):
        raise ValueError(f"ELDR_CAPTURE must be 0, prefill or all, got {mode!r}")
    if os.environ.get("ELDR_PAYLOAD_VERSION", "2") not in ("1", "2"):
        raise ValueError(f"ELDR_PAYLOAD_VERSION must be 1 or 2, got "
                         f"{os.environ['ELDR_PAYLOAD_VERSION']!r}")
    try:
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as exc:  # another vLLM build: do nothing, loudly
        logger.warning("eldr capture plugin: vLLM's v1 classes not found (%s); disabled", exc)
        return
    # The base class carries execute_model / sample_tokens / load_model for every build;
    # vLLM-CPU's runner derives from it and overrides load_model, so it is wrapped too
    # (_attach is idempotent, in case the override calls the base one).
    for cls in _runner_classes(GPUModelRunner):
        if "load_model" in cls.__dict__:
            _patch(cls, "load_model", _wrap_load_model)
    _patch(GPUModelRunner, "execute_model", _wrap_execute_model)
    _patch(GPUModelRunner, "sample_tokens", _wrap_sample_tokens)
    _patch(Scheduler, "update_from_output", _wrap_update_from_output)
    install_api_server_hooks()
    for name, wrapper in POOL_HOOKS.items():  # rows are evicted with their blocks
        _patch(BlockPool, name, wrapper)


def _runner_classes(base) -> list:
    """``base`` and the runner subclasses this build ships that override its methods
    (vLLM-CPU's ``CPUModelRunner``; absent from GPU builds' imports, which is fine)."""
    classes = [base]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        classes.append(CPUModelRunner)
    except Exception:  # a GPU build without the CPU runner, or one that fails to import
        pass
    return classes


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

    def __init__(self, buffer, num_experts: int, block_size: int | None = None) -> None:
        self.buffer = buffer  # (max_tokens, L, k) int32 torch tensor, written by the hooks
        self.num_experts = num_experts  # E
        # tokens per KV block when prefix caching is on (rows are cut), else None
        self.block_size = block_size
        self.pending: dict[str, PrefillStep] = {}  # req_id -> what goes out with the step
        self.carry: dict = {}  # req_id -> BlockCarry of a block split across chunks
        self.decode_all = False  # ELDR_CAPTURE=all: decode rows of every batch
        # a KV connector is configured: decode rows are shipped (the worker cannot tell a
        # decode leg, vLLM does not send it kv_transfer_params; the engine core can)
        self.pd = False
        self.decode_steps: list[DecodeStep] = []  # steps not yet handed to the engine core
        # seconds of the last execute_model, while its DecodeStep (last of decode_steps)
        # waits for sample_tokens to finish its timing; None: no step waiting
        self.exec_s: float | None = None


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

    if getattr(runner, "_eldr_capture", None) is not None:
        return  # already attached (a subclass's load_model called the base one)
    routers = _moe_routers(runner.get_model())
    if not routers:
        logger.warning("eldr capture plugin: no MoE router found; nothing is recorded")
        return
    top_k = int(runner.model_config.get_num_experts_per_tok())
    num_experts = int(runner.model_config.get_num_experts())
    max_tokens = int(runner.scheduler_config.max_num_batched_tokens)
    # on the model's device: the hook is a device-side copy (inside CUDA graphs on GPUs)
    device = getattr(runner, "device", None) or "cpu"
    buffer = torch.zeros((max_tokens, len(routers), top_k), dtype=torch.int32, device=device)

    def make_hook(layer: int):
        def capture(topk_ids) -> None:  # inside the forward pass: one slice copy, no Python
            buffer[: topk_ids.shape[0], layer] = topk_ids
        return capture

    for layer, router in enumerate(routers):
        router.set_capture_fn(make_hook(layer))
    cache_config = getattr(runner, "cache_config", None)
    caching = bool(getattr(cache_config, "enable_prefix_caching", False))
    block_size = int(cache_config.block_size) if caching else None
    runner._eldr_capture = _Capture(buffer, num_experts, block_size)
    runner._eldr_capture.decode_all = os.environ.get("ELDR_CAPTURE") == "all"
    runner._eldr_capture.pd = getattr(runner.vllm_config, "kv_transfer_config", None) is not None
    mode = os.environ.get("ELDR_CAPTURE", "prefill")
    logger.info(
        "eldr capture plugin active: prefill expert counts of %d MoE layers (top-%d of %d "
        "experts) go to kv_transfer_params[%r] (payload v%s) of %s; %s", len(routers), top_k,
        num_experts, PAYLOAD_KEY, os.environ.get("ELDR_PAYLOAD_VERSION", "2"),
        "every finished request" if mode == "all" else "prefill legs (do_remote_decode)",
        f"signature cache of {block_size}-token blocks on (prefix-cache hits stay exact)"
        if caching else "prefix caching off (no signature cache)")


def _wrap_load_model(original):
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _attach(self)
        return result
    return load_model


def _collect(runner, scheduler_output) -> None:
    """Turn the rows of the step just run into per-request prompt-token counts (and, with
    prefix caching on, the rows of the KV blocks each prefill chunk completed)."""
    cap: _Capture | None = getattr(runner, "_eldr_capture", None)
    if cap is None:
        return
    for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
        cap.carry.pop(req_id, None)
    total = int(scheduler_output.total_num_scheduled_tokens)
    if total == 0:
        return
    start_of = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    first_chunk = set(start_of)  # new requests: tokens before start were not computed here
    cached = scheduler_output.scheduled_cached_reqs
    start_of.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    first_chunk.update(getattr(cached, "resumed_req_ids", ()) or ())
    req_ids = [r for r in runner.input_batch.req_ids if r is not None]
    sizes = [int(scheduler_output.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    if sum(sizes) != total or total > cap.buffer.shape[0]:
        logger.warning("eldr capture plugin: step layout not understood (%d rows for %d "
                       "tokens); step skipped", sum(sizes), total)
        return
    rows = None
    offset = 0
    spans = []  # (req_id, first row, rows) of decode positions
    wanted = cap.decode_all or cap.pd  # the engine core picks the decode legs
    for req_id, n in zip(req_ids, sizes, strict=True):
        state = runner.requests.get(req_id)
        start = start_of.get(req_id)
        if state is not None and start is not None:
            m = max(0, min(n, state.num_prompt_tokens - start))  # prompt positions
            if m:
                if rows is None:
                    rows = _rows(cap, total)
                _count_chunk(cap, req_id, rows[offset : offset + m], int(start),
                             req_id in first_chunk)
            if m < n:
                spans.append((req_id, offset + m, n - m))
        offset += n
    if spans and wanted:  # a decode engine: its batch's decode rows go to the engine core
        if rows is None:
            rows = _rows(cap, total)
        step = decode_step(rows, spans, cap.num_experts)
        if step is not None:
            cap.decode_steps.append(step)


def _rows(cap: _Capture, total: int) -> np.ndarray:
    """The step's (total, L, k) rows as numpy: one copy per step, outside the hook (a
    device-to-host copy on GPUs)."""
    return cap.buffer[:total].cpu().numpy()


def _count_chunk(cap: _Capture, req_id: str, ids: np.ndarray, start: int,
                 first: bool) -> None:
    if first:
        cap.carry.pop(req_id, None)
    if cap.block_size is None:
        counts, blocks = _bincount(ids, cap.num_experts), ()
    else:
        cut = chunk_rows(ids, start=start, block_size=cap.block_size,
                         num_experts=cap.num_experts, carry=cap.carry.pop(req_id, None))
        if cut.carry is not None:
            cap.carry[req_id] = cut.carry
        counts, blocks = cut.counts, ((cut.first_block, cut.rows),) if len(cut.rows) else ()
    step = PrefillStep(counts, len(ids), start if first else None, blocks)
    old = cap.pending.get(req_id)
    cap.pending[req_id] = step if old is None or first else old.merge(step)


def _bincount(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """(L, E) int32 counts from (T, L, k) ids."""
    L = ids.shape[1]
    flat = ids.transpose(1, 0, 2).reshape(L, -1).astype(np.int64)
    flat += np.arange(L, dtype=np.int64)[:, None] * num_experts
    return np.bincount(flat.ravel(), minlength=L * num_experts).reshape(L, num_experts).astype(
        np.int32)


def _hand_over(runner, output):
    cap: _Capture | None = getattr(runner, "_eldr_capture", None)
    if cap is None or not (cap.pending or cap.decode_steps):
        return output
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if not isinstance(output, ModelRunnerOutput):
        return output  # keep pending until a ModelRunnerOutput goes out
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy(output)  # never mutate vLLM's shared empty output
    if cap.pending:
        output.eldr_prefill = cap.pending
        cap.pending = {}
    if cap.decode_steps:
        output.eldr_decode = cap.decode_steps
        cap.decode_steps = []
    return output


def _time_step(runner, extra_s: float) -> None:
    """Close the timing of the step ``execute_model`` left waiting: its ``wall_s`` is that
    call's seconds plus ``extra_s`` (``sample_tokens``'s, or 0 when execute_model returned
    the output itself)."""
    cap: _Capture | None = getattr(runner, "_eldr_capture", None)
    if cap is None or cap.exec_s is None:
        return
    if cap.decode_steps and cap.decode_steps[-1].wall_s is None:
        cap.decode_steps[-1] = cap.decode_steps[-1]._replace(wall_s=cap.exec_s + extra_s)
    cap.exec_s = None


def _wrap_execute_model(original):
    def execute_model(self, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        output = original(self, scheduler_output, *args, **kwargs)
        spent = time.perf_counter() - start
        cap: _Capture | None = getattr(self, "_eldr_capture", None)
        try:
            if cap is not None:
                cap.exec_s = None  # a step never sampled stays untimed
                steps = len(cap.decode_steps)
                _collect(self, scheduler_output)
                if len(cap.decode_steps) > steps:
                    cap.exec_s = spent
                    if output is not None:  # no sample_tokens call for this step
                        _time_step(self, 0.0)
        except Exception:  # never take the engine down for a measurement
            logger.exception("eldr capture plugin: collecting a step failed")
        return output if output is None else _hand_over(self, output)
    return execute_model


def _wrap_sample_tokens(original):
    def sample_tokens(self, *args, **kwargs):
        start = time.perf_counter()
        output = original(self, *args, **kwargs)
        _time_step(self, time.perf_counter() - start)
        return _hand_over(self, output)
    return sample_tokens


# -- engine-core side --------------------------------------------------------------------------
def _wrap_update_from_output(original):
    def update_from_output(self, scheduler_output, model_runner_output):
        acc: dict = self.__dict__.setdefault("_eldr_acc", {})
        prefill = getattr(model_runner_output, "eldr_prefill", None)
        if prefill:
            try:
                absorb(self, acc, prefill)
            except Exception:  # never take the engine down for a measurement
                logger.exception("eldr capture plugin: absorbing a step failed")
        decode = getattr(model_runner_output, "eldr_decode", None)
        if decode:
            try:
                absorb_decode(self, decode)
            except Exception:  # never take the engine down for a measurement
                logger.exception("eldr capture plugin: absorbing decode rows failed")
        outputs = original(self, scheduler_output, model_runner_output)
        if decode or self.__dict__.get("_eldr_dec"):
            try:
                attach_decode(self, outputs)
                if not getattr(self, "running", True):  # idle now: the last steps out
                    flush_steps(self)
            except Exception:
                logger.exception("eldr capture plugin: attaching a decode payload failed")
        if acc:
            try:
                attach_payloads(acc, outputs)
            except Exception:
                logger.exception("eldr capture plugin: attaching a payload failed")
            if len(acc) > 2 * len(self.requests) + 64:  # aborted requests leave entries
                for req_id in [r for r in acc if r not in self.requests]:
                    del acc[req_id]
        return outputs
    return update_from_output
