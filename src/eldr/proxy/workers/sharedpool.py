"""The decoder pool shared by the workers of ``eldr serve --workers N`` (docs/serve.md).

Two parts, both free of I/O so they can be tested without processes:

- :class:`SharedLoads` / :class:`SharedLoadTracker`: the in-flight counts of every worker
  in one shared (N, C) int64 table of decoder SLOTS. The table is sized once, before
  ``fork``, with room for more decoders than the start-up pool (C = ``capacity``, default
  ``max(2K, K + 16)``). Each worker keeps its own map from its pool's decoder index to the
  decoder's slot, so a worker that has not applied a change yet (or has already removed a
  drained decoder, shifting its indices) still counts every request in the right slot:
  the slot belongs to one decoder from its add until every worker has removed it.
- :class:`PoolJournal`: the parent's ordered record of pool changes and reloads. Every
  change is checked and numbered here and sent to every worker in that order; it owns
  the slots (a free one for each add, zeroed before reuse; freed once every worker has
  removed the drained decoder). A worker started later (a restart) replays the journal
  from its base: the artifact and decoder set of the last reload a worker confirmed.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from eldr.proxy.request import GuardBuffers
from eldr.routing.loads import LoadTracker

__all__ = ["PoolJournal", "PoolRefused", "SharedLoadTracker", "SharedLoads", "WorkerShare",
           "default_capacity"]


def default_capacity(num_decoders: int) -> int:
    """Decoder slots when ``--decoder-slots`` is not given: ``max(2K, K + 16)``."""
    return max(2 * num_decoders, num_decoders + 16)


class SharedLoads:
    """(N, C) int64 in-flight counts per worker row and decoder slot, plus (C,) engine-
    reported loads and the in-flight sums at each report, in one anonymous shared mapping
    (created before ``fork``)."""

    def __init__(self, num_workers: int, capacity: int) -> None:
        if capacity < 1 or num_workers < 1:
            raise ValueError(f"need >= 1 worker and >= 1 decoder slot, got {num_workers} "
                             f"and {capacity}")
        self.num_workers, self.capacity = num_workers, capacity
        n, c = num_workers, capacity
        self._map = mmap.mmap(-1, 8 * (n * c + 3 * c))  # MAP_SHARED | MAP_ANONYMOUS
        buf = np.frombuffer(self._map, dtype=np.int64)
        self.in_flight = buf[: n * c].reshape(n, c)  # (N, C) rows: one per worker
        tail = np.frombuffer(self._map, dtype=np.float64, offset=8 * n * c)
        self.reported = tail[:c]  # (C,) engine load at the last scrape
        self.at_report = tail[c: 2 * c]  # (C,) in-flight sum when it was reported
        self.has_report = tail[2 * c:]  # (C,) 1.0 once a scrape reported the decoder

    def clear_row(self, row: int) -> None:
        """A worker died: its requests died with it."""
        self.in_flight[row] = 0

    def clear_slot(self, slot: int) -> None:
        """A slot about to hold another decoder: nothing of the last one stays."""
        self.in_flight[:, slot] = 0
        self.reported[slot] = self.at_report[slot] = self.has_report[slot] = 0.0


class SharedLoadTracker(LoadTracker):
    """A :class:`~eldr.routing.loads.LoadTracker` whose loads are every worker's.

    ``loads[k]`` = the requests all workers have in flight at this worker's decoder ``k``
    (slot ``slots[k]``) or, once an engine scrape reported it, that report plus the
    in-flight change since, never below the requests in flight there (as
    :class:`~eldr.routing.loads.LoadTracker` does in one process). Health is this worker's
    own (``healthy``). :meth:`add_worker` takes the slot given to :meth:`reserve` first
    (the journal's choice), so every worker maps a decoder to the same slot.
    """

    def __init__(self, table: SharedLoads, row: int, slots=None) -> None:
        slots = list(range(table.capacity) if slots is None else slots)
        if any(not 0 <= s < table.capacity for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} are not distinct slots of [0, {table.capacity})")
        self.slots = slots  # (K,) this worker's decoder index -> its slot
        self.num_workers = len(slots)
        self.healthy = np.ones(self.num_workers, dtype=bool)
        self._table, self._row = table, table.in_flight[row]
        self._reserved: int | None = None

    @property
    def loads(self) -> np.ndarray:  # (K,) float64, fresh on every read
        t, s = self._table, self.slots
        total = t.in_flight[:, s].sum(axis=0).astype(np.float64)
        has = t.has_report[s]
        if not has.any():
            return total
        # never below the router's own in flight: the engine has not seen a burst yet
        scraped = np.maximum(t.reported[s] + total - t.at_report[s], total)
        return np.where(has > 0, scraped, total)

    def reserve(self, slot: int) -> None:
        """The slot the next :meth:`add_worker` takes."""
        if not 0 <= slot < self._table.capacity or slot in self.slots:
            raise ValueError(f"slot {slot} is not a free slot of [0, {self._table.capacity})")
        self._reserved = slot

    def add_worker(self) -> int:
        if self._reserved is None:
            raise ValueError("with --workers > 1 a decoder is added through the workers' "
                             "pool journal (no slot was reserved for it)")
        self.slots.append(self._reserved)
        self._reserved = None
        self.healthy = np.append(self.healthy, True)
        self.num_workers += 1
        return self.num_workers - 1

    def remove_worker(self, worker: int) -> None:
        k = self._removable(worker)
        del self.slots[k]
        self.healthy = np.delete(self.healthy, k)
        self.num_workers -= 1

    def on_dispatch(self, worker: int) -> None:
        self._row[self.slots[self._index(worker)]] += 1

    def on_complete(self, worker: int) -> None:
        s = self.slots[self._index(worker)]
        if self._row[s] > 0:
            self._row[s] -= 1

    def in_flight_at(self, worker: int) -> float:
        """Every worker's requests in flight at decoder ``worker`` now."""
        return float(self._table.in_flight[:, self.slots[self._index(worker)]].sum())

    def report(self, worker: int, load: float, in_flight_then: float | None = None) -> None:
        load = self._checked_load(worker, load)
        s, t = self.slots[self._index(worker)], self._table
        now = float(t.in_flight[:, s].sum())
        # the larger of the in-flight sums when the scrape was sent and now (LoadTracker)
        t.at_report[s] = now if in_flight_then is None else max(float(in_flight_then), now)
        t.reported[s] = load
        t.has_report[s] = 1.0


@dataclass(frozen=True, slots=True)
class WorkerShare:
    """What worker ``row`` of ``--workers N`` shares with the others, handed to the router
    it builds (``Router(config, share=...)``): the load table its pool's tracker reads and
    writes, and the memory of the poison list and retry budget of its request flow."""

    loads: SharedLoads  # the (N, C) in-flight table and engine reports of every worker
    row: int  # this worker's row of ``loads`` and of the retry budget
    slots: tuple[int, ...]  # (K,) the slot of each decoder of its start-up pool, in order
    guards: GuardBuffers | None = None  # shared guard memory (None: the router's own)

    def tracker(self, num_decoders: int) -> SharedLoadTracker:
        """The pool's tracker over this worker's row and slots (``num_decoders`` of them:
        a pool that does not match its slots is refused)."""
        if len(self.slots) != num_decoders:
            raise ValueError(f"a worker's pool of {num_decoders} decoders does not match its "
                             f"{len(self.slots)} shared load slots")
        return SharedLoadTracker(self.loads, self.row, list(self.slots))


class PoolRefused(ValueError):
    """A pool change the journal refuses: ``status`` and ``code`` for the HTTP answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class PoolJournal:
    """The parent's view of the pool and the ordered entries every worker applies.

    ``decoders``: name -> {"url", "slot", "draining"} in pool order (a drained decoder
    stays until every worker removed it). ``entries``: ``{"seq", "op", ...}`` since
    ``base`` (``{"artifact", "names", "urls", "slots"}``: what a worker starting now builds
    its router from before replaying them). ``table`` (optional) is zeroed slot by slot
    when a slot is given to a new decoder.
    """

    def __init__(self, names, urls, capacity: int, artifact: str | None = None,
                 table: SharedLoads | None = None) -> None:
        names, urls = list(names), list(urls)
        if capacity < len(names):
            raise ValueError(f"--decoder-slots {capacity} is fewer than the {len(names)} "
                             f"decoders given")
        self.capacity, self.table = capacity, table
        self.decoders = {n: {"url": u, "slot": s, "draining": False}
                         for s, (n, u) in enumerate(zip(names, urls, strict=True))}
        self.base = {"artifact": artifact, "names": names, "urls": urls,
                     "slots": list(range(len(names)))}
        self.entries: list[dict] = []
        self.seq = 0
        self.pending: dict[str, dict] = {}  # draining name -> {"seq", "rows" still holding}

    def _append(self, entry: dict) -> dict:
        self.seq += 1
        entry = {"seq": self.seq, **entry}
        self.entries.append(entry)
        return entry

    # -- changes asked by a worker ---------------------------------------------------------
    def add(self, url: str, name: str | None, like: str | None) -> dict:
        """Check an add, give it a name (default ``decode-N``) and a zeroed free slot."""
        if any(d["url"] == url for d in self.decoders.values()):
            raise PoolRefused(409, "decoder_exists",
                              f"a decoder with URL {url} is already in the pool")
        if name is None:
            name = next(f"decode-{n}" for n in range(len(self.decoders) + 1)
                        if f"decode-{n}" not in self.decoders)
        elif name in self.decoders:
            raise PoolRefused(409, "decoder_exists",
                              f"a decoder named {name!r} is already in the pool")
        taken = {d["slot"] for d in self.decoders.values()}
        slot = next((s for s in range(self.capacity) if s not in taken), None)
        if slot is None:
            raise PoolRefused(409, "pool_full",
                              f"all {self.capacity} decoder slots of the workers' shared load "
                              f"table are taken (draining decoders hold theirs until every "
                              f"worker removed them); restart eldr serve with a larger "
                              f"--decoder-slots")
        if self.table is not None:
            self.table.clear_slot(slot)
        self.decoders[name] = {"url": url, "slot": slot, "draining": False}
        return self._append({"op": "add", "name": name, "url": url, "slot": slot,
                             "like": like if like in self.decoders else None})

    def drain(self, name: str, rows) -> dict | int:
        """Check a removal: the drain entry, or the seq of the drain already running.
        ``rows``: the workers that must each remove the decoder before its slot is free."""
        dec = self.decoders.get(name)
        if dec is None:
            raise PoolRefused(404, "decoder_not_found",
                              f"no decoder named {name!r}; the decoders are "
                              f"{list(self.decoders)}")
        if dec["draining"]:
            return self.pending[name]["seq"]
        if not any(not d["draining"] for n, d in self.decoders.items() if n != name):
            raise PoolRefused(409, "last_decoder", f"{name} is the last decoder taking "
                                                  f"requests; add another before removing it")
        dec["draining"] = True
        entry = self._append({"op": "drain", "name": name, "slot": dec["slot"]})
        self.pending[name] = {"seq": entry["seq"], "rows": set(rows)}
        return entry

    def reload(self, artifact: str | None) -> dict:
        return self._append({"op": "reload", "artifact": artifact})

    # -- what workers report ---------------------------------------------------------------
    def removed(self, name: str, row: int) -> dict | None:
        """Worker ``row`` removed drained ``name``; once every worker has, its slot is free
        and ``{"name", "seq", "slot"}`` is returned (None before)."""
        pending = self.pending.get(name)
        if pending is None:
            return None
        pending["rows"].discard(row)
        if pending["rows"]:
            return None
        del self.pending[name]
        dec = self.decoders.pop(name)
        return {"name": name, "seq": pending["seq"], "slot": dec["slot"]}

    def forget_row(self, row: int) -> list[dict]:
        """Worker ``row`` died: its requests are gone and its restart builds its pool
        without any draining decoder. Returns the decoders freed by that."""
        return [f for f in (self.removed(n, row) for n in list(self.pending)) if f]

    def reloaded(self, seq: int, artifact: str | None, names) -> None:
        """A worker applied reload ``seq`` with success, its decoders then ``names``: the
        base moves there (a restart reads this artifact and replays what came after)."""
        names = list(names)
        if seq <= self.base.get("seq", 0) or any(n not in self.decoders for n in names):
            return  # an older report, or a decoder unknown here (never: logged upstream)
        self.base = {"seq": seq, "artifact": artifact, "names": names,
                     "urls": [self.decoders[n]["url"] for n in names],
                     "slots": [self.decoders[n]["slot"] for n in names]}
        self.entries = [e for e in self.entries if e["seq"] > seq]
