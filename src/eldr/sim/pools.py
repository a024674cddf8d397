"""Worker state of the simulated cluster: the prefill router and pool, the decode pool.

Prefill routing (the paper's PrefixHash): a request's affinity key is the block hash
(:func:`eldr.cache.hashing.block_hashes`) of its first ``affinity_blocks`` full KV blocks, which
names that whole prefix; the target worker is the key's first 8 bytes modulo the pool
size, so requests sharing a system prompt meet on one worker (and hit its prefix cache).
A prompt shorter than that uses its last full block; one without a full block, or a
trace without token ids, uses a mix of its trace index (no affinity). Spill: when the
target holds more than ``spill_tokens`` queued prompt tokens above the least-loaded
worker, the least-loaded worker takes the request (ties → lowest index).

Prefill batches take queued requests in FIFO order up to ``prefill_max_batch_tokens``
computed tokens (the first request always fits, however long). With prefix caching, a
worker keeps an LRU cache of block hashes; cached leading blocks skip compute (at least
one token is always computed, as in vLLM).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from eldr.cache.hashing import BlockHash, block_hashes
from eldr.sim.config import SimConfig
from eldr.traces.trace import Trace

__all__ = ["DecodeWorker", "PrefillRouter", "PrefillWorker"]


class PrefillRouter:
    """Prefix-affinity routing over the prefill pool, with spilling on load."""

    def __init__(self, trace: Trace, config: SimConfig) -> None:
        self.trace = trace
        self.num_workers = config.num_prefill
        self.affinity_blocks = config.affinity_blocks
        self.spill_tokens = config.spill_tokens
        self.block_size = trace.meta.block_size
        self._hashes: dict[int, list[BlockHash]] = {}
        self._targets: dict[int, int] = {}  # r -> its affinity worker
        self._has_ids = trace.prompt_token_ids is not None
        self.num_spills = 0

    def hashes(self, r: int) -> list[BlockHash]:
        """Block hashes of trace request ``r``'s full prompt blocks ([] without token ids)."""
        h = self._hashes.get(r)
        if h is None:
            h = block_hashes(self.trace.prompt_tokens(r), self.block_size) if self._has_ids \
                else []
            self._hashes[r] = h
        return h

    def target(self, r: int) -> int:
        """Trace request ``r``'s affinity worker (module docstring), computed once. Only
        the first ``affinity_blocks`` blocks are hashed unless the full chain is known (a
        chain's first hashes depend on the first blocks only)."""
        target = self._targets.get(r)
        if target is None:
            h = self._hashes.get(r)
            if h is None and self._has_ids:
                head = self.trace.prompt_tokens(r)[:self.affinity_blocks * self.block_size]
                h = block_hashes(head, self.block_size)
            if h:
                key = int.from_bytes(h[min(self.affinity_blocks, len(h)) - 1][:8], "little")
            else:
                key = (r * 0x9E3779B97F4A7C15) >> 7  # Fibonacci mix of the index: no affinity
            target = self._targets[r] = key % self.num_workers
        return target

    def choose(self, r: int, workers: list[PrefillWorker]) -> int:
        target = self.target(r)
        queued = [w.queued_tokens for w in workers]
        fewest = min(queued)
        if queued[target] > fewest + self.spill_tokens:
            self.num_spills += 1
            return queued.index(fewest)  # the least loaded, ties → lowest index
        return target


class PrefillWorker:
    """A prefill worker: FIFO queue, current batch, optional LRU prefix cache."""

    def __init__(self, config: SimConfig) -> None:
        self.queue: deque[int] = deque()  # request indices waiting for prefill
        self.batch: list[int] = []  # requests of the running prefill step
        self.batch_tokens = 0  # prompt tokens of the running batch
        self.queued_tokens = 0  # prompt tokens queued or running (the spill load)
        self.busy = False
        self.budget = config.prefill_max_batch_tokens
        self.caching = config.prefix_caching
        self.capacity = config.prefix_cache_blocks
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()  # LRU, oldest first
        self.pending: list[list[BlockHash]] = []  # block hashes of the running batch

    def enqueue(self, i: int, prompt_tokens: int) -> None:
        self.queue.append(i)
        self.queued_tokens += prompt_tokens

    def _cached_tokens(self, hashes: list[BlockHash], prompt_tokens: int,
                       block_size: int) -> int:
        """Leading cached tokens of a prompt (at least one token is always computed)."""
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
        return min(hit * block_size, max(prompt_tokens - 1, 0))

    def _insert(self, hashes: list[BlockHash]) -> None:
        """The prompt's blocks become most recent (LRU eviction past capacity)."""
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    def take_batch(self, router: PrefillRouter, tidx: np.ndarray,
                   prompt: np.ndarray) -> tuple[list[int], list[int], int]:
        """Pop the next batch; returns (request indices, prefix-cached tokens of each,
        tokens to compute)."""
        batch: list[int] = []
        cached_tokens: list[int] = []
        fresh_total = 0
        tokens = 0
        while self.queue:
            i = self.queue[0]
            p = int(prompt[i])
            cached = 0
            if self.caching:
                hashes = router.hashes(int(tidx[i]))
                cached = self._cached_tokens(hashes, p, router.block_size)
            fresh = p - cached
            if batch and fresh_total + fresh > self.budget:
                break
            if self.caching:
                self.pending.append(hashes)
            self.queue.popleft()
            batch.append(i)
            cached_tokens.append(cached)
            fresh_total += fresh
            tokens += p
        self.batch, self.batch_tokens = batch, tokens
        return batch, cached_tokens, fresh_total

    def finish_batch(self) -> None:
        """The batch's KV exists now: its blocks enter the prefix cache (not before, so
        two requests of one batch never share blocks that are still being computed)."""
        for hashes in self.pending:
            self._insert(hashes)
        self.pending = []
        self.queued_tokens -= self.batch_tokens
        self.batch, self.batch_tokens = [], 0


class DecodeWorker:
    """A decode worker under continuous batching. Lists are parallel, one entry per
    running request; ``finish_at`` maps a step index to the requests ending at it.

    A request's decode rows come as its (n_out, L, W) array (kept in ``bits``) or, when
    the simulator reads rows from a token bank's flat slab, as the slab index of its first
    row (kept in ``offs`` minus its start step, so step ``s`` reads rows ``offs + s``).

    The running set changes only when requests are admitted or finish, so the simulator
    plans a stretch of steps at once (``plan_*``: the times and expert counts of steps
    from the current one on, last step first, :meth:`eldr.sim.engine.Simulation.plan`);
    :meth:`admit` and :meth:`remove` drop the plan."""

    __slots__ = ("bits", "busy", "cur_batch", "cur_distinct", "ends", "finish_at", "ids",
                 "kv_bytes", "kvs", "new", "offs", "plan_distinct", "plan_dt", "prompt_sum",
                 "prompts", "start_sum", "starts", "step", "waiting", "win_batch",
                 "win_distinct", "win_steps")

    def __init__(self) -> None:
        self.waiting: deque[int] = deque()  # KV arrived, not yet admitted (FIFO)
        self.ids: list[int] = []  # running request indices
        self.bits: list[np.ndarray] = []  # their (n_out, L, W) step bitsets (rows given)
        self.offs: list[int] = []  # their first slab row - start (slab index given)
        self.starts: list[int] = []  # step index at which each was admitted
        self.ends: list[int] = []  # step index of each one's last token
        self.prompts: list[int] = []  # their prompt lengths
        self.kvs: list[float] = []  # KV bytes reserved by each
        self.prompt_sum = 0  # Σ prompts of running requests
        self.start_sum = 0  # Σ starts of running requests
        self.kv_bytes = 0.0  # Σ reserved KV bytes
        self.step = 0  # index of the next (or current) step
        self.busy = False  # a step is in flight
        self.finish_at: dict[int, list[tuple[int, int]]] = {}  # step -> [(request, start)]
        self.new: list[int] = []  # admitted at the current step (first token at its end)
        self.cur_batch = 0  # batch size of the step in flight
        self.cur_distinct = 0  # Σ_l D_l of the step in flight
        self.win_steps = 0  # steps ending inside the measured window
        self.win_batch = 0  # Σ batch size over those steps
        self.win_distinct = 0  # Σ (Σ_l D_l) over those steps
        # the plan, LAST step first (a step pops its own): step times in seconds (empty:
        # no plan) and Σ_l D_l
        self.plan_dt: list[float] = []
        self.plan_distinct: list[int] = []

    def admit(self, i: int, rows: np.ndarray | int, prompt: int, n_out: int,
              kv: float) -> None:
        """Request ``i`` joins the running batch at this step; ``rows``: its (n_out, L, W)
        bitsets or the slab index of the first of them (class docstring)."""
        s = self.step
        self.ids.append(i)
        if isinstance(rows, int):
            self.offs.append(rows - s)
        else:
            self.bits.append(rows)
        self.starts.append(s)
        self.ends.append(s + n_out - 1)
        self.prompts.append(prompt)
        self.kvs.append(kv)
        self.prompt_sum += prompt
        self.start_sum += s
        self.kv_bytes += kv
        self.finish_at.setdefault(s + n_out - 1, []).append((i, s))
        self.new.append(i)
        self.plan_dt = []

    def remove(self, finished: set[int]) -> None:
        """The requests ``finished`` leave the running batch (the others keep their order)."""
        self.plan_dt = []
        if len(finished) == 1:  # the usual case: one list deletion each
            (i,) = finished
            j = self.ids.index(i)
            self.prompt_sum -= self.prompts[j]
            self.start_sum -= self.starts[j]
            self.kv_bytes -= self.kvs[j]
            for column in (self.ids, self.bits or self.offs, self.starts, self.ends,
                           self.prompts, self.kvs):
                del column[j]
            if not self.ids:
                self.kv_bytes = 0.0  # no float drift when empty
            return
        keep = []
        for j, i in enumerate(self.ids):
            if i in finished:
                self.prompt_sum -= self.prompts[j]
                self.start_sum -= self.starts[j]
                self.kv_bytes -= self.kvs[j]
            else:
                keep.append(j)
        self.ids = [self.ids[j] for j in keep]
        if self.bits:
            self.bits = [self.bits[j] for j in keep]
        else:
            self.offs = [self.offs[j] for j in keep]
        self.starts = [self.starts[j] for j in keep]
        self.ends = [self.ends[j] for j in keep]
        self.prompts = [self.prompts[j] for j in keep]
        self.kvs = [self.kvs[j] for j in keep]
        if not self.ids:
            self.kv_bytes = 0.0  # no float drift when empty
