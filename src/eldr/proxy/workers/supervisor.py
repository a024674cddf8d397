"""``eldr serve --workers N``: N router processes on one port, sharing their decode loads,
their decoder pool and their artifact.

Why processes: one Python process routes on one core (the GIL); a machine with more cores
than one router process uses needs several, behind ONE address so clients and load
balancers see a single router. How they share it:

- **The port.** Every worker binds its own listening socket to the same address with
  ``SO_REUSEPORT``; the kernel spreads new connections over them by their address hash.
  With ``--port 0`` the parent binds first (same option, never listening) to learn a free
  port, and keeps it reserved while the workers run.
- **Decode loads.** Policies route on each decoder's load, and a worker that saw only its
  own requests would see 1/N of it. The in-flight counts live in one shared (N, C) int64
  table of decoder slots (an anonymous shared mapping inherited through ``fork``, C =
  ``--decoder-slots``, default ``max(2K, K + 16)``: room for decoders added later);
  worker ``i`` writes only its row ``i`` (no lock: one writer per cell), and every
  decision reads the column sums of its decoders' slots, so each decoder's load is exactly
  the requests in flight there from ALL workers (:mod:`eldr.proxy.workers.sharedpool`). An engine
  scrape (``--scrape-interval``) still overrides a decoder's load the same way in every
  worker.
- **The pool journal.** Decoder adds and removals (admin API, ``--decoders-file`` +
  SIGHUP) and artifact reloads (``POST /admin/reload``, SIGHUP, a ``--learn`` swap with
  its new path) are asked of the parent over each worker's socket; the parent checks and
  numbers them (:class:`~eldr.proxy.workers.sharedpool.PoolJournal`: names, URLs, a free zeroed
  slot per add) and sends each to every worker, which apply them in that order
  (:mod:`eldr.proxy.workers.poollink`). A removed decoder drains in every worker; its slot is
  free again once every worker removed it. ``SIGHUP`` to the parent makes one worker
  re-read the decoders file and reload, through the journal.
- **Learning.** With ``--learn DIR`` worker 0 learns (it owns DIR, the buffer and the
  fit process); the other workers forward their completed requests to it through the
  parent (bounded, dropped when it falls behind, never holding a request), so it learns
  from all the traffic; its swaps reach every worker as journal reloads.
- **Containment.** The poison list and the retry budget (:mod:`eldr.proxy.request.containment`)
  live in shared memory too, so a body refused by one worker is refused by all, and the
  budget caps the retries of all workers together.
- **Lifetime.** ``SIGTERM``/``SIGINT`` to the parent stop every worker; a worker that dies
  is started again (its row of the load table zeroed first: its requests died with it;
  it builds its router from the journal's base and replays the entries since), unless it
  died within 5 s of its start (it cannot start: all stop, exit status 1). A worker whose
  parent is gone stops.

Per-worker, not shared: health checks and circuit breakers (each worker checks every
engine itself; they agree within a health interval), the prefix-affinity table, metrics
(``/metrics`` answers from the worker the connection landed on; scrape each worker, or
sum, with ``--workers 1`` per port if exact per-router totals matter).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import os
import select
import signal
import socket
import sys
import time

from eldr.proxy.request import GuardBuffers
from eldr.proxy.workers.poollink import PoolLink
from eldr.proxy.workers.sharedpool import (
    PoolJournal,
    PoolRefused,
    SharedLoads,
    WorkerShare,
    default_capacity,
)

__all__ = ["reserve_port", "run_workers"]

log = logging.getLogger("eldr.serve")

_MIN_LIFETIME = 5.0  # seconds: a worker ending sooner cannot start (port, artifact): stop
_MAX_LINE = 16 << 20  # bytes of one message from a worker
_MAX_FORWARD = 8 << 20  # bytes of learn records queued for the learner before dropping


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A bound, never listening ``SO_REUSEPORT`` socket holding ``(host, port)``: the
    workers bind the same address; with ``port`` 0 the kernel's choice is returned."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock, sock.getsockname()[1]


class _Child:
    """The parent's handle on one worker: its pid and socket, with byte buffers."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock
        self.inbox, self.outbox = bytearray(), bytearray()
        self.eof = False
        self.started = time.monotonic()

    def send(self, msg: dict) -> None:
        self.outbox += json.dumps(msg, separators=(",", ":")).encode() + b"\n"


class _Parent:
    """Messages of the workers → the journal → messages to the workers."""

    def __init__(self, journal: PoolJournal, children: dict[int, _Child]) -> None:
        self.journal, self.children = journal, children
        self.dropped = 0  # learn records not forwarded (the learner fell behind)

    def broadcast(self, msg: dict) -> None:
        for child in self.children.values():
            child.send(msg)

    def receive(self, row: int, child: _Child) -> None:
        try:
            data = child.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            child.eof = True  # it is ending: reaped below
            return
        child.inbox += data
        while True:
            line, sep, rest = child.inbox.partition(b"\n")
            if not sep:
                if len(child.inbox) > _MAX_LINE:
                    log.error("worker %d sent a message over %d bytes: dropped", row,
                              _MAX_LINE)
                    child.inbox.clear()
                return
            child.inbox = bytearray(rest)
            try:
                self.handle(row, json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("worker %d sent a bad message (%s): ignored", row, exc)

    def handle(self, row: int, msg: dict) -> None:
        op, journal = msg["op"], self.journal
        if op == "learn":
            learner = self.children.get(0)
            if learner is None or row == 0 or len(learner.outbox) > _MAX_FORWARD:
                self.dropped += 1
            else:
                learner.send(msg)
            return
        if op == "removed":
            freed = journal.removed(msg["name"], row)
            if freed is not None:
                log.info("decoder %s removed by every worker: slot %d is free", freed["name"],
                         freed["slot"])
                self.broadcast({"op": "freed", **freed})
            return
        if op == "remove_failed":  # a bug in that worker: its slot stays taken
            pending = journal.pending.get(msg["name"])
            if pending is not None:
                self.broadcast({"op": "freed", "name": msg["name"], "seq": pending["seq"],
                                "failed": True})
            return
        if op == "reloaded":
            journal.reloaded(int(msg["seq"]), msg["artifact"], msg["names"])
            return
        origin = {"origin": row, "id": msg["id"]}
        try:
            if op == "add":
                entry = journal.add(msg["url"], msg.get("name"), msg.get("like"))
            elif op == "drain":
                entry = journal.drain(msg["name"], self.children)
                if isinstance(entry, int):  # already draining: wait for that one
                    self.children[row].send({"op": "joined", "seq": entry, **origin})
                    return
            elif op == "reload":
                entry = journal.reload(msg.get("artifact"))
            else:
                raise ValueError(f"unknown op {op!r}")
        except PoolRefused as exc:
            self.children[row].send({"op": "refused", "status": exc.status, "code": exc.code,
                                     "message": str(exc), **origin})
            return
        self.broadcast({**entry, **origin})

    def forget(self, row: int) -> None:
        """Worker ``row`` is (re)starting: no draining decoder waits for it any more."""
        for freed in self.journal.forget_row(row):
            self.broadcast({"op": "freed", **freed})


def run_workers(config, make_router, serve=None, *, ready=None, names=None,
                capacity: int | None = None) -> int:
    """Run ``config.workers`` router processes on ``config.host:config.port``; returns the
    exit status when stopped (0 after SIGTERM/SIGINT, 1 when a worker could not start).
    ``make_router(config, share)`` builds one worker's :class:`~eldr.proxy.app.Router`
    (called in each worker, after ``fork``; ``share``: the worker's
    :class:`~eldr.proxy.workers.sharedpool.WorkerShare`, its row and shared memory);
    ``serve(router, port=, reuse_port=)`` runs it (default :func:`eldr.proxy.serving.serve`,
    the one serve loop; a test may stand in its own); ``ready(port)`` is called in the parent
    once the port is known. ``names``: the decoders' names (default: ``config.decode_ids``,
    else ``decode-K``); ``capacity``: decoder slots (default ``max(2K, K + 16)``)."""
    if not hasattr(socket, "SO_REUSEPORT") or not hasattr(os, "fork"):
        raise ValueError("--workers > 1 needs SO_REUSEPORT and fork (Linux, BSD, macOS)")
    if serve is None:
        from eldr.proxy.serving import serve
    supervisor = _Supervisor(config, make_router, serve, names, capacity)
    try:
        for row in range(config.workers):
            supervisor.spawn(row)
        print(f"eldr serve: {config.workers} workers on http://{config.host}:"
              f"{supervisor.port}", file=sys.stderr, flush=True)
        if ready is not None:
            ready(supervisor.port)
        while supervisor.children:
            supervisor.pump(0.5)
            supervisor.handle_signals()
            supervisor.reap()
    finally:
        supervisor.close()
    if supervisor.parent.dropped:
        log.info("%d learn records were not forwarded (the learner fell behind)",
                 supervisor.parent.dropped)
    return supervisor.exit_status


class _Supervisor:
    """The parent of ``--workers N``: its shared memory and journal (made before the first
    ``fork``), the reserved port, the workers, and the signals it got.

    Its life: :meth:`spawn` each worker, then rounds of :meth:`pump` (the workers' messages
    in and out), :meth:`handle_signals` (SIGHUP to one worker; SIGTERM/SIGINT stop all) and
    :meth:`reap` (a worker that ended is started again, unless it could not start or all
    are stopping), until no worker is left; :meth:`close` in any case.
    """

    def __init__(self, config, make_router, serve, names, capacity: int | None) -> None:
        n, k = config.workers, len(config.decode_urls)
        names = list(names or config.decode_ids or (f"decode-{i}" for i in range(k)))
        capacity = default_capacity(k) if capacity is None else capacity
        self.config, self._make_router, self._serve = config, make_router, serve
        self.table = SharedLoads(n, capacity)
        self.guards = GuardBuffers.allocate(config, n)
        self.journal = PoolJournal(names, config.decode_urls, capacity, config.artifact,
                                   self.table)
        self.children: dict[int, _Child] = {}
        self.parent = _Parent(self.journal, self.children)
        self.stopping, self.exit_status = False, 0
        self._holder, self.port = reserve_port(config.host, config.port)
        self._wake_r, self._wake_w = os.pipe()  # a signal wakes the select loop
        os.set_blocking(self._wake_w, False)
        self._signals: list[int] = []
        self._previous = {sig: signal.signal(sig, self._on_signal)
                          for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass

    def spawn(self, row: int) -> None:
        """Start worker ``row`` (again): its row of the load table zeroed (its requests
        died with it), its router built from the journal's base, the entries since
        replayed."""
        self.table.clear_row(row)
        self.parent.forget(row)
        mine, theirs = socket.socketpair()
        base = self.journal.base
        cfg = dataclasses.replace(self.config, artifact=base["artifact"],
                                  decode_urls=tuple(base["urls"]),
                                  decode_ids=tuple(base["names"]))
        share = WorkerShare(self.table, row, tuple(base["slots"]), self.guards)
        entries = list(self.journal.entries)
        pid = os.fork()
        if pid == 0:
            mine.close()
            self._be_worker(cfg, share, entries, theirs)  # never returns
        theirs.close()
        mine.setblocking(False)
        self.children[row] = _Child(pid, mine)

    def _be_worker(self, cfg, share: WorkerShare, entries: list[dict], sock) -> None:
        """In the forked child: drop the parent's handles and signals, serve, exit."""
        status = 1
        try:
            os.close(self._wake_r)
            os.close(self._wake_w)
            for child in self.children.values():
                child.sock.close()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve handles it
            status = _worker_main(self._make_router, self._serve, cfg, share, entries,
                                  self.port, sock)
        except BaseException:  # a worker must never return into the parent's loop
            log.exception("worker %d failed", share.row)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def pump(self, timeout: float) -> None:
        """One round of the workers' sockets: read what came (handled by the journal's
        :class:`_Parent`), write what waits, for at most ``timeout`` seconds."""
        children = self.children
        reading = {c.sock: row for row, c in children.items() if not c.eof}
        writing = {c.sock: c for c in children.values() if c.outbox and not c.eof}
        try:
            readable, writable, _ = select.select([self._wake_r, *reading], list(writing), [],
                                                  timeout)
        except InterruptedError:
            readable, writable = [], []
        if self._wake_r in readable:
            os.read(self._wake_r, 4096)
        for sock in readable:
            if sock in reading:
                self.parent.receive(reading[sock], children[reading[sock]])
        for sock in writable:
            child = writing[sock]
            try:
                del child.outbox[:sock.send(child.outbox)]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                child.eof = True

    def handle_signals(self) -> None:
        """SIGHUP: one worker re-reads the decoders file and reloads (through the
        journal); SIGTERM/SIGINT: every worker stops."""
        while self._signals:
            sig = self._signals.pop(0)
            if sig == signal.SIGHUP and self.children:
                self.children[min(self.children)].send({"op": "hangup"})
            elif sig != signal.SIGHUP:
                self.stopping = True
                _signal_all(self.children, signal.SIGTERM)

    def reap(self) -> None:
        """Collect the workers that ended: started again, unless all are stopping or one
        ended within ``_MIN_LIFETIME`` of its start (it cannot start: all stop, status 1)."""
        for row, child in list(self.children.items()):
            try:
                done, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                done, status = child.pid, 0
            if done == 0:
                continue
            child.sock.close()
            del self.children[row]
            if self.stopping:
                continue
            if time.monotonic() - child.started < _MIN_LIFETIME:
                log.error("worker %d (pid %d) ended at start-up (status %d): stopping",
                          row, child.pid, status)
                self.stopping, self.exit_status = True, 1
                _signal_all(self.children, signal.SIGTERM)
                continue
            log.error("worker %d (pid %d) ended (status %d): starting it again",
                      row, child.pid, status)
            self.spawn(row)

    def close(self) -> None:
        """Kill the workers left (an error in the loop), give back signals, port, pipe."""
        if self.children:
            _signal_all(self.children, signal.SIGKILL)
            for child in self.children.values():
                child.sock.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._holder.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _signal_all(children: dict[int, _Child], sig: int) -> None:
    for child in children.values():
        try:
            os.kill(child.pid, sig)
        except OSError as exc:  # already gone: reaped on the next round
            if exc.errno != errno.ESRCH:
                raise


def _worker_main(make_router, serve, config, share: WorkerShare, entries: list[dict],
                 port: int, sock) -> int:
    """One worker: its router (from the journal's base, then its entries replayed), its
    own listening socket, its link to the parent."""
    router = make_router(config, share)  # its pool's tracker is the shared one
    link = PoolLink(sock, share.row, elastic=router.elastic, reloader=router.reloader)
    link.replay(entries)
    router.attach_link(link)  # changes go through the journal; --learn records too

    async def main() -> None:
        await link.start()
        try:
            await serve(router, port=port, reuse_port=True)
        finally:
            await link.stop()

    try:
        import uvloop
    except ModuleNotFoundError:
        asyncio.run(main())
    else:
        uvloop.run(main())
    return 0
