"""A worker's side of the pool journal of ``eldr serve --workers N`` (docs/serve.md).

Every decoder add, removal and artifact reload a worker is asked for (admin API,
``SIGHUP``, a ``--learn`` swap) goes to the parent as one JSON line on the worker's
socket; the parent checks it against the pool (:class:`eldr.proxy.workers.sharedpool.PoolJournal`),
numbers it and sends the entry to EVERY worker, the asking one included, which apply the
entries one at a time in that order. The asking worker answers with the outcome of its own
application, so every worker routes over the same decoder set and artifact, changed in
the same order.

- ``add``: the decoder joins at the slot the journal gave it (zeroed), its health checked
  once before the next entry; the band's centroid copy (``like``) is the asking worker's
  busiest decoder, by name, the same in every worker.
- ``drain``: each worker stops sending it requests and removes it once ITS requests there
  ended, then says ``removed``; once every worker has, the parent frees the slot and tells
  all (``freed``: ``DELETE ...?wait=true`` answers then, when no worker has a request left
  there).
- ``reload``: each worker first finishes the drains of earlier entries (so that every
  worker checks the artifact against the same decoders), then reloads the entry's path (a
  learned artifact's, or the configured one); a success is reported (``reloaded``) so a
  restarted worker starts from that artifact.
- ``hangup`` (the parent got SIGHUP): this worker re-reads the decoders file and reloads,
  through the journal like the rest.

A restarted worker builds its router from the journal's base and replays the entries
since (:meth:`PoolLink.replay`) before it serves. If the parent goes away the worker stops.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
from collections.abc import Callable

from eldr.proxy.control import ElasticPool, Reloader
from eldr.proxy.errors import ProxyError

__all__ = ["PoolLink"]

log = logging.getLogger("eldr.serve")

MAX_LINE = 16 << 20  # bytes of one message (a learn record is the largest)
MAX_BACKLOG = 8 << 20  # bytes waiting for the parent past which learn records are dropped
# messages of the parent applied in order: journal entries, then answers and notices
_JOURNAL = ("add", "drain", "reload", "refused", "joined", "freed", "hangup")


class PoolLink:
    """The channel of worker ``row`` to its parent (``sock``: its end of a socketpair).

    It applies the journal's entries to the worker's ``elastic`` pool and ``reloader``
    (their ``apply_*``/``apply`` and ``replay_*``/``replay`` methods); the router sets it
    as their ``link`` (``Router.attach_link``), through which their own changes go.
    """

    def __init__(self, sock, row: int, *, elastic: ElasticPool, reloader: Reloader) -> None:
        self.row, self._sock, self.elastic, self.reloader = row, sock, elastic, reloader
        self._writer = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._freed: dict[int, asyncio.Event] = {}  # drain seq -> set once freed everywhere
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        # the parent's messages other than the journal's (learn records, for the learner)
        self.on_message: Callable[[dict], None] | None = None
        self.dropped = 0  # learn records not sent (the parent fell behind)

    # -- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock,
                                                                  limit=MAX_LINE)
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._read(reader)),
                       asyncio.ensure_future(self._apply_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ProxyError(503, "the router is stopping", code="stopping"))
        if self._writer is not None:
            self._writer.close()
        if self.dropped:
            log.info("worker %d: %d learn records were not forwarded (the parent fell "
                     "behind)", self.row, self.dropped)

    def send(self, msg: dict, *, droppable: bool = False) -> bool:
        """One message to the parent (buffered by the transport, never blocking); False
        when it was not sent. ``droppable`` (a learn record): dropped while more than
        ``MAX_BACKLOG`` bytes wait."""
        if self._writer is None or self._writer.is_closing():
            return False
        if droppable and self._writer.transport.get_write_buffer_size() > MAX_BACKLOG:
            self.dropped += 1
            return False
        self._writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        return True

    async def _read(self, reader) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                msg = json.loads(line)
                if msg.get("op") in _JOURNAL:
                    self._queue.put_nowait(msg)
                elif self.on_message is not None:
                    self.on_message(msg)
        except (ValueError, OSError, asyncio.LimitOverrunError) as exc:
            log.error("worker %d: bad message from the parent (%s)", self.row, exc)
        log.error("worker %d: the parent is gone; stopping", self.row)
        os.kill(os.getpid(), signal.SIGTERM)

    # -- requests of this worker -----------------------------------------------------------
    async def request(self, msg: dict):
        """Send ``msg`` with a fresh id; the outcome of this worker's application of the
        entry it becomes (or the parent's refusal, as ``ProxyError``)."""
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self.send({**msg, "id": rid})
        try:
            return await asyncio.shield(fut)  # a client that leaves does not undo it
        finally:
            if fut.done():
                self._waiting.pop(rid, None)

    async def add(self, url: str, name: str | None, like: str | None):
        return await self.request({"op": "add", "url": url, "name": name, "like": like})

    async def drain(self, name: str) -> int:
        """Start removing ``name`` in every worker; the drain's seq (for :meth:`freed`)."""
        return await self.request({"op": "drain", "name": name})

    async def freed(self, seq: int) -> bool:
        """Wait until drain ``seq`` ended in every worker; True if a worker failed to
        remove the decoder (it stays draining there, its slot taken)."""
        event = self._freed.setdefault(seq, asyncio.Event())
        await event.wait()
        return getattr(event, "failed", False)

    async def reload(self, artifact: str | None = None):
        """The artifact reload of every worker (``Router.reload``'s signature)."""
        return await self.request({"op": "reload", "artifact": artifact})

    def removed(self, name: str) -> None:
        """This worker's drain of ``name`` ended: it is out of its pool."""
        self.send({"op": "removed", "name": name})

    # -- applying the journal --------------------------------------------------------------
    async def _apply_loop(self) -> None:
        while True:
            msg = await self._queue.get()
            try:
                await self._handle(msg)
            except Exception:  # a bug of ours: logged; the next entries still apply
                log.exception("worker %d: handling %s from the parent failed", self.row,
                              msg.get("op"))

    async def _handle(self, msg: dict) -> None:
        op = msg["op"]
        if op == "hangup":
            os.kill(os.getpid(), signal.SIGHUP)  # serve's handler: decoders file + reload
            return
        if op == "freed":  # or a worker failed to remove it ("failed": it stays draining)
            event = self._freed.setdefault(msg["seq"], asyncio.Event())
            event.failed = bool(msg.get("failed"))
            event.set()
            return
        fut = self._waiting.pop(msg.get("id"), None) \
            if msg.get("origin", self.row) == self.row else None
        if op == "refused":
            _settle(fut, exc=ProxyError(msg["status"], msg["message"], code=msg["code"]))
        elif op == "joined":
            _settle(fut, result=msg["seq"])
        else:
            try:
                result = await self._apply(msg)
            except Exception as exc:
                if op != "reload":  # a reload logged its own failure
                    log.error("worker %d: journal entry %d (%s %s) failed here: %s",
                              self.row, msg["seq"], op, msg.get("name"), exc)
                _settle(fut, exc=exc)
            else:
                _settle(fut, result=result)

    async def _apply(self, entry: dict):
        elastic, op = self.elastic, entry["op"]
        if op == "add":
            return await elastic.apply_add(entry["url"], entry["name"], entry["like"],
                                           entry["slot"])
        if op == "drain":
            if elastic.apply_drain(entry["name"]) is None:
                self.removed(entry["name"])  # not in this worker's pool (a restart)
            return entry["seq"]
        if op == "reload":
            drains = elastic.drains()
            if drains:  # every worker checks the artifact against the same decoders
                log.info("reload waits for %d decoder(s) to drain here", len(drains))
                await asyncio.gather(*(asyncio.shield(t) for t in drains),
                                     return_exceptions=True)
            state = await self.reloader.apply(entry["artifact"])
            self.send({"op": "reloaded", "seq": entry["seq"], "artifact": state.artifact,
                       "names": list(state.worker_names)})
            return state
        raise ValueError(f"unknown journal entry {op!r}")

    def replay(self, entries: list[dict]) -> None:
        """Apply the entries since the journal's base before serving (a restarted worker;
        nothing runs yet: a draining decoder is removed at once)."""
        elastic = self.elastic
        for entry in entries:
            op = entry["op"]
            try:
                if op == "add":
                    elastic.replay_add(entry["url"], entry["name"], entry["like"],
                                       entry["slot"])
                elif op == "drain":
                    elastic.replay_drain(entry["name"])
                elif op == "reload":
                    self.reloader.replay(entry["artifact"])
            except Exception as exc:  # the running workers logged the same outcome
                log.warning("worker %d: replaying journal entry %d (%s) failed: %s",
                            self.row, entry["seq"], op, exc)
        if entries:
            log.info("worker %d: replayed %d pool journal entries; decoders %s", self.row,
                     len(entries), list(self.reloader.live.state.worker_names))


def _settle(fut, *, result=None, exc: BaseException | None = None) -> None:
    if fut is None or fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
