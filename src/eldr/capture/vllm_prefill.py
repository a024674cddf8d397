"""Engine-core half of the plugin's prefill capture (wired by
:mod:`eldr.capture.vllm_plugin`): per-request prompt tallies over prefill chunks, the
signature cache of :mod:`eldr.capture.enginecache` fed and read, and the payload put into
a finished prefill leg's ``kv_transfer_params``. vLLM objects are used by duck typing only.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from eldr.capture.enginecache import BlockRowCache, PrefillStep, pool_cache, store_rows
from eldr.capture.payload import LAYERS_KEY, PAYLOAD_KEY, encode_counts, encode_payload

__all__ = ["Tally", "absorb", "attach_payloads"]

logger = logging.getLogger("vllm.eldr_capture")


class Tally:
    """One request's prompt counts so far, in the engine core."""

    __slots__ = ("counts", "layers", "tokens", "wanted")

    def __init__(self, step: PrefillStep, params: dict) -> None:
        self.counts = step.counts.astype(np.int32, copy=True)  # (L, E) counts so far
        self.tokens = step.num_tokens  # prompt tokens they cover
        self.wanted = (os.environ.get("ELDR_CAPTURE") == "all"  # send a payload at the end
                       or bool(params.get("do_remote_decode")))
        self.layers = params.get(LAYERS_KEY)  # the router's layer mask, validated at encode



def absorb(sched, acc: dict, prefill: dict) -> None:
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
            acc[req_id] = tally = Tally(step, request.kv_transfer_params or {})
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


def attach_payloads(acc: dict, outputs) -> None:
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


def _payload(tally: Tally, version: str) -> dict:
    if version == "1":
        return {**encode_counts(tally.counts), "tokens": int(tally.tokens)}
    try:
        return encode_payload(tally.counts, tokens=tally.tokens, layers=tally.layers)
    except ValueError:  # a bad layer mask in the request: send every layer
        if tally.layers is None:
            raise
        return encode_payload(tally.counts, tokens=tally.tokens)
