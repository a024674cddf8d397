"""Prefill choice: prefix affinity with load spill.

A prefill instance that has already seen a prompt's prefix has its KV blocks in its prefix
cache, so sending requests that share a prefix (a system prompt, a chat history) to the
same instance saves prefill compute. The router holds no tokenizer, so it names prefixes
by the bytes of the prompt: the prompt text's UTF-8 bytes are cut into blocks of
``block_chars`` bytes and chained with :func:`eldr.cache.hashing.block_hashes` (each hash names
the whole prefix up to its block, exactly like vLLM's KV block hashes name token
prefixes). Byte blocks do not line up with the engine's token blocks; they only need to
agree between requests, which they do.

Choice rule (``pick``): the instance that served the longest remembered prefix wins if it
is healthy and its in-flight count is at most ``spill`` above the least-loaded healthy
instance; otherwise the least-loaded healthy instance (ties rotate, so an idle pool is
still spread). Affinity must never overload an instance: that is the top complaint about
affinity routers in production.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from eldr.cache.hashing import BlockHash, block_hashes

__all__ = ["PrefixAffinity"]


class PrefixAffinity:
    """Block-hash → prefill instance table (LRU-bounded) and the spill rule."""

    def __init__(self, num_instances: int, *, block_chars: int = 128, max_blocks: int = 512,
                 capacity: int = 100_000, spill: float = 4.0) -> None:
        if num_instances <= 0:
            raise ValueError(f"num_instances must be positive, got {num_instances}")
        for name, value in (("block_chars", block_chars), ("max_blocks", max_blocks),
                            ("capacity", capacity)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if spill < 0:
            raise ValueError(f"spill must be >= 0, got {spill}")
        self.num_instances = num_instances
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.capacity = capacity
        self.spill = spill
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()  # block hash → instance
        self._next = 0  # where the least-loaded tie-break starts next time

    def hashes(self, prompt: bytes) -> list[BlockHash]:
        """Block hashes of the first ``max_blocks`` full blocks of ``prompt``."""
        head = prompt[: self.block_chars * self.max_blocks]
        return block_hashes(np.frombuffer(head, dtype=np.uint8), self.block_chars)

    def lookup(self, hashes: list[BlockHash]) -> int | None:
        """The instance remembered for the longest prefix of ``hashes``, or None."""
        for h in reversed(hashes):
            owner = self._owner.get(h)
            if owner is not None:
                return owner
        return None

    def pick(self, hashes: list[BlockHash], loads: np.ndarray, healthy: np.ndarray) -> int:
        """Instance index for a prompt with these block hashes. ``loads``/``healthy`` (N,).

        Raises ``LookupError`` when no instance is healthy.
        """
        if self.num_instances == 1:  # no choice to make: skip the table and the arrays
            if not healthy[0]:
                raise LookupError("no healthy prefill instance")
            self._next += 1
            return 0
        idx = np.flatnonzero(healthy)
        if idx.size == 0:
            raise LookupError("no healthy prefill instance")
        least = float(loads[idx].min())
        owner = self.lookup(hashes)
        if owner is not None and healthy[owner] and loads[owner] <= least + self.spill:
            return owner
        ties = idx[loads[idx] == least]
        k = int(ties[self._next % ties.size])
        self._next += 1
        return k

    def record(self, hashes: list[BlockHash], instance: int) -> None:
        """Remember that ``instance`` now holds these prefixes (most recent use last)."""
        owner = self._owner
        for h in hashes:
            owner[h] = instance
            owner.move_to_end(h)
        while len(owner) > self.capacity:
            owner.popitem(last=False)

    def forget(self, instance: int) -> None:
        """Drop every entry of ``instance`` (it restarted: its prefix cache is empty)."""
        stale = [h for h, k in self._owner.items() if k == instance]
        for h in stale:
            del self._owner[h]
