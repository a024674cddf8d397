"""Admin-endpoint helpers of the router (:mod:`eldr.proxy.app`): the per-address limit on
wrong admin tokens, and the error a reload that does not fit the deployment raises.
"""

from __future__ import annotations

import collections
import time
from collections import OrderedDict

__all__ = ["FailedAttempts", "ReloadRefused"]


class FailedAttempts:
    """Wrong admin tokens per client address in a sliding window, to slow guessing down.

    ``max_failures`` within ``window`` seconds limit an address until the oldest ages
    out. At most ``max_peers`` addresses are remembered (the oldest forgotten first), so a
    flood of addresses cannot grow memory.
    """

    def __init__(self, *, max_failures: int = 5, window: float = 60.0,
                 max_peers: int = 4096, clock=time.monotonic) -> None:
        self.max_failures = max_failures
        self.window = window
        self.max_peers = max_peers
        self.clock = clock
        self._seen: OrderedDict[str, collections.deque] = OrderedDict()

    def _recent(self, peer: str) -> collections.deque | None:
        times = self._seen.get(peer)
        if times is not None:
            cutoff = self.clock() - self.window
            while times and times[0] < cutoff:
                times.popleft()
        return times

    def is_limited(self, peer: str) -> bool:
        times = self._recent(peer)
        return times is not None and len(times) >= self.max_failures

    def record(self, peer: str) -> None:
        times = self._recent(peer)
        if times is None:
            times = self._seen[peer] = collections.deque(maxlen=self.max_failures)
        times.append(self.clock())
        self._seen.move_to_end(peer)
        while len(self._seen) > self.max_peers:
            self._seen.popitem(last=False)


class ReloadRefused(ValueError):
    """A valid artifact that does not fit the running deployment (HTTP 409)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
