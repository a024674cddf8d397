"""A circuit breaker per decoder, driven by the outcomes of real requests.

Health checks alone let a decoder flap: one whose ``/health`` answers 200 while its
completions hang or fail is taken out by failing requests and re-admitted by the next
check, and each round costs requests a full decode timeout. The breaker listens to
request outcomes only (never to health checks):

- **closed**: requests flow; ``failures`` consecutive failed requests open it (a success
  resets the count, so isolated transient failures never open it: a breaker that
  amplifies blips is worse than none);
- **open**: no request is routed there for ``backoff`` seconds;
- **half-open**: after the back-off, exactly one real request (the probe) may go there.
  Its success closes the breaker (and resets the back-off); its failure opens it again for
  twice as long, up to ``max_backoff``. A probe that ends with no verdict (the client
  left, the engine answered 4xx) frees the slot for the next probe.

The states are computed from the clock on read; nothing runs in the background.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """Consecutive-failure breaker with a half-open probe and exponential back-off."""

    def __init__(self, *, failures: int = 3, backoff: float = 5.0, max_backoff: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if not 0 < backoff <= max_backoff:
            raise ValueError(f"need 0 < backoff <= max_backoff, got {backoff}, {max_backoff}")
        self.threshold = failures
        self.base_backoff = backoff
        self.max_backoff = max_backoff
        self.clock = clock
        self.failures = 0  # consecutive failed requests while closed
        self.backoff = backoff  # length of the current (or next) open period
        self.open_until: float | None = None  # None: closed
        self.probing = False  # a half-open probe is in flight
        self.num_opened = 0  # times it went from closed to open (metrics)

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        if self.open_until is None:
            return "closed"
        return "open" if self.clock() < self.open_until else "half_open"

    def allows(self) -> bool:
        """May a request be routed here now? (half-open: only while no probe is out)."""
        state = self.state
        return state == "closed" or (state == "half_open" and not self.probing)

    def on_dispatch(self) -> None:
        """A request was routed here; in half-open it is the probe."""
        if self.state == "half_open":
            self.probing = True

    def on_success(self) -> None:
        self.failures = 0
        self.open_until = None
        self.probing = False
        self.backoff = self.base_backoff

    def on_failure(self) -> None:
        if self.open_until is not None:  # a failed probe (or a late failure): longer
            if self.probing or self.state == "half_open":
                self.backoff = min(self.backoff * 2, self.max_backoff)
                self.open_until = self.clock() + self.backoff
            self.probing = False
            return
        self.failures += 1
        if self.failures >= self.threshold:
            self.failures = 0
            self.num_opened += 1
            self.open_until = self.clock() + self.backoff

    def on_abandon(self) -> None:
        """The request routed here ended with no verdict; a probe slot is free again."""
        self.probing = False
