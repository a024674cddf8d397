"""Helpers shared by every routing policy (``eldr.routing``, ``eldr.routing.baselines``)."""

from __future__ import annotations

import numpy as np

_RANDOM_BUFFER = 4096  # uniforms drawn per refill: one Generator call per 4096 decisions


class NoHealthyWorkerError(RuntimeError):
    """No decode worker is healthy: the request cannot be routed (HTTP router → 503)."""


def _check(policy_name: str, num_workers: int, loads: np.ndarray,
           healthy: np.ndarray | None) -> None:
    if loads.shape != (num_workers,):
        raise ValueError(f"{policy_name}: loads has shape {loads.shape}, "
                         f"expected ({num_workers},)")
    if healthy is not None and healthy.shape != (num_workers,):
        raise ValueError(f"{policy_name}: healthy has shape {healthy.shape}, "
                         f"expected ({num_workers},)")


def _no_healthy(policy_name: str) -> NoHealthyWorkerError:
    return NoHealthyWorkerError(f"{policy_name}: no healthy decode worker to route to")


def _jsq(policy_name: str, loads: np.ndarray, healthy: np.ndarray | None) -> int:
    """Least-loaded healthy worker; ties → lowest index."""
    if healthy is None:
        return int(np.argmin(loads))
    key = np.where(healthy, loads, np.inf)
    k = int(np.argmin(key))
    if not healthy[k]:
        raise _no_healthy(policy_name)
    return k


class _Uniforms:
    """Seeded uniforms in [0, 1), drawn in blocks so one decision costs no Generator call."""

    __slots__ = ("_buf", "_pos", "_rng")

    def __init__(self, random_state: int | np.random.Generator | None) -> None:
        self._rng = np.random.default_rng(random_state)
        self._buf = self._rng.random(_RANDOM_BUFFER).tolist()
        self._pos = 0

    def next(self) -> float:
        if self._pos == _RANDOM_BUFFER:
            self._buf = self._rng.random(_RANDOM_BUFFER).tolist()
            self._pos = 0
        u = self._buf[self._pos]
        self._pos += 1
        return u


def _check_num_workers(num_workers: int) -> int:
    if not isinstance(num_workers, (int, np.integer)) or num_workers <= 0:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    return int(num_workers)
