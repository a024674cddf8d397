"""Settings of the learning router: one frozen, validated record."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LearnConfig"]


@dataclass(frozen=True)
class LearnConfig:
    """What ``eldr serve --learn DIR`` learns from, and when it refits (docs/learn.md)."""

    directory: str  # DIR: buffer, learned artifacts and state live here
    min_requests: int = 500  # collected requests before the first fit (and per refit)
    max_requests: int = 4000  # the buffer's bound: the oldest request is dropped past it
    holdout: float = 0.25  # fraction of a fit's requests held out to validate it
    batch_size: int = 16  # decoder batch of the validation score (expected distinct experts)
    min_gain: float = 0.0  # a first artifact must beat load balancing by this (score < 1 - g)
    max_balance: float = 2.0  # refuse if the largest held-out cluster exceeds this x the mean
    rho_tolerance: float = 0.05  # refuse if held-out rho falls this far below the running one
    persist_interval: float = 30.0  # seconds between writes of the buffer (and at shutdown)
    drift: bool = True  # watch for drift once an artifact runs
    drift_window: int = 100  # requests per drift check
    drift_alpha: float = 0.01  # false-alarm level of one window's test
    drift_patience: int = 2  # consecutive windows past the threshold that count as drift
    tau: float = 0.1  # locality band width stored in learned artifacts
    seed: int = 0  # seed of splits, K-means and the drift test's bootstrap

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ValueError("learn directory must be a non-empty path")
        for name in ("min_requests", "max_requests", "batch_size", "drift_window",
                     "drift_patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"learn {name} must be a positive integer, got {value!r}")
        if self.min_requests < 20:
            raise ValueError(f"learn min_requests must be at least 20, got {self.min_requests}")
        if self.max_requests < self.min_requests:
            raise ValueError(f"learn max_requests ({self.max_requests}) must be at least "
                             f"min_requests ({self.min_requests})")
        if not 0.05 <= self.holdout <= 0.5:
            raise ValueError(f"learn holdout must be in [0.05, 0.5], got {self.holdout}")
        if not 0.0 < self.drift_alpha < 0.5:
            raise ValueError(f"learn drift_alpha must be in (0, 0.5), got {self.drift_alpha}")
        for name in ("min_gain", "rho_tolerance", "tau"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"learn {name} must be finite and >= 0, got {value!r}")
        if not (math.isfinite(self.max_balance) and self.max_balance >= 1.0):
            raise ValueError(f"learn max_balance must be >= 1, got {self.max_balance}")
        if not (math.isfinite(self.persist_interval) and self.persist_interval > 0):
            raise ValueError(f"learn persist_interval must be > 0, got {self.persist_interval}")
