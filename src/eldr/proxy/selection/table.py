"""The reservations of the selection API, in memory every router process shares.

With ``eldr serve --workers N`` an orchestrator's calls for one reservation may reach
different worker processes (the port is shared with ``SO_REUSEPORT``). A reservation's
load must count exactly once in the shared decoder load table
(:mod:`eldr.proxy.workers.sharedpool`), whose row of each worker only that worker writes.
So each reservation is OWNED by the worker that made it: only the owner adds it to and
takes it from the loads (its row), and only it tells its policy. Another worker asked to
mark it prefilled or to release it writes a request into the reservation's record, which
the owner applies on its next sweep (:class:`eldr.proxy.selection.service.Selection`).

Records: ``num_workers`` rows of ``capacity`` records, row r owned by worker r, in one
anonymous shared mapping made before ``fork`` (``eldr serve`` makes it with the load
table). A record is addressed by ``(row, index, gen)``: ``gen`` grows with every reuse of
the record, so a stale id never reaches a newer reservation. Fields written by the owner
only: ``gen``, ``state``, ``key``, ``created``, ``deadline``, ``ended``, ``outcome``. Fields
any worker may write, each a single aligned 8-byte store of a value tagged by ``gen``
(no read-modify-write, so concurrent writers cannot tear it): ``prefill_gen`` with
``prefill_deadline`` (written first), ``release_gen`` with ``release_outcome`` (first).

Times are ``time.monotonic()`` seconds (CLOCK_MONOTONIC: the same clock in every process
of the machine). Free of I/O: testable without processes.
"""

from __future__ import annotations

import mmap
import secrets

import numpy as np

__all__ = ["ACTIVE", "ENDED", "FREE", "OUTCOMES", "OUTCOME_CODES", "SelectionTable"]

FREE, ACTIVE, ENDED = 0, 1, 2  # record states
# how a reservation ended; index = its code in ``outcome`` / ``release_outcome`` (0: none)
OUTCOMES = ("", "completed", "failed", "cancelled", "expired")
OUTCOME_CODES = {name: i for i, name in enumerate(OUTCOMES) if name}

_INT_FIELDS = ("gen", "state", "key", "prefill_gen", "release_gen", "release_outcome",
               "outcome")
_FLOAT_FIELDS = ("created", "deadline", "prefill_deadline", "ended")


class SelectionTable:
    """(num_workers, capacity) reservation records in one shared mapping.

    Each field is a (num_workers, capacity) array view (int64 or float64) named as in the
    module docstring; ``epoch`` is a random tag of this table, part of every reservation
    id, so ids from an earlier run of the router are refused rather than misread.
    """

    def __init__(self, num_workers: int, capacity: int = 4096) -> None:
        if num_workers < 1 or capacity < 1:
            raise ValueError(f"need >= 1 worker and >= 1 reservation record, got "
                             f"{num_workers} and {capacity}")
        self.num_workers, self.capacity = num_workers, capacity
        n = num_workers * capacity
        fields = len(_INT_FIELDS) + len(_FLOAT_FIELDS)
        self._map = mmap.mmap(-1, 8 * (fields * n + 1))  # MAP_SHARED | MAP_ANONYMOUS
        ints = np.frombuffer(self._map, dtype=np.int64)
        floats = np.frombuffer(self._map, dtype=np.float64)
        for i, name in enumerate(_INT_FIELDS):
            setattr(self, name, ints[i * n:(i + 1) * n].reshape(num_workers, capacity))
        base = len(_INT_FIELDS) * n
        for i, name in enumerate(_FLOAT_FIELDS):
            lo = base + i * n
            setattr(self, name, floats[lo:lo + n].reshape(num_workers, capacity))
        self.epoch = secrets.randbelow(1 << 40)

    def clear_row(self, row: int) -> None:
        """Worker ``row`` (re)starts: its reservations died with it (their loads too: the
        load table's row is cleared by the supervisor), so none stays to be answered."""
        for name in (*_INT_FIELDS, *_FLOAT_FIELDS):
            getattr(self, name)[row] = 0

    # -- ids -------------------------------------------------------------------------------
    def make_id(self, row: int, index: int, gen: int) -> str:
        return f"res-{self.epoch:x}-{row}-{index}-{gen}"

    def parse_id(self, rid: object) -> tuple[int, int, int] | None:
        """(row, index, gen) of a reservation id of this table, or None if it is not one."""
        if not isinstance(rid, str) or len(rid) > 80:
            return None
        parts = rid.split("-")
        if len(parts) != 5 or parts[0] != "res":
            return None
        try:
            epoch = int(parts[1], 16)
            row, index, gen = (int(p) for p in parts[2:])
        except ValueError:
            return None
        if epoch != self.epoch or not (0 <= row < self.num_workers and
                                       0 <= index < self.capacity and gen > 0):
            return None
        return row, index, gen

    # -- what any worker may read or ask ---------------------------------------------------
    def is_current(self, row: int, index: int, gen: int) -> bool:
        """The record still holds reservation ``gen`` (active or ended)."""
        return int(self.gen[row, index]) == gen and int(self.state[row, index]) != FREE

    def request_prefill(self, row: int, index: int, gen: int, deadline: float) -> None:
        self.prefill_deadline[row, index] = deadline
        self.prefill_gen[row, index] = gen

    def request_release(self, row: int, index: int, gen: int, outcome: str) -> None:
        self.release_outcome[row, index] = OUTCOME_CODES[outcome]
        self.release_gen[row, index] = gen

    def effective_deadline(self, row: int, index: int) -> float:
        """When the reservation expires: the prefill's deadline once marked prefilled."""
        gen = self.gen[row, index]
        return float(self.prefill_deadline[row, index] if self.prefill_gen[row, index] == gen
                     else self.deadline[row, index])

    def active_by_key(self) -> dict[int, int]:
        """Active reservations of every worker, per decoder key (what is shown as load)."""
        keys = self.key[self.state == ACTIVE]
        values, counts = np.unique(keys, return_counts=True)
        return {int(k): int(c) for k, c in zip(values, counts, strict=True)}
