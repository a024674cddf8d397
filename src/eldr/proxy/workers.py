"""``eldr serve --workers N``: N router processes on one port, sharing their decode loads.

Why processes: one Python process routes on one core (the GIL); a machine with more cores
than one router process uses needs several, behind ONE address so clients and load
balancers see a single router. How they share it:

- **The port.** Every worker binds its own listening socket to the same address with
  ``SO_REUSEPORT``; the kernel spreads new connections over them by their address hash.
  With ``--port 0`` the parent binds first (same option, never listening) to learn a free
  port, and keeps it reserved while the workers run.
- **Decode loads.** Policies route on each decoder's load, and a worker that saw only its
  own requests would see 1/N of it. The in-flight counts live in one shared (N, K) int64
  table (an anonymous shared mapping inherited through ``fork``); worker ``i`` writes only
  its row ``i`` (no lock: one writer per cell), and every decision reads the column sums,
  so each decoder's load is exactly the requests in flight there from ALL workers. An
  engine scrape (``--scrape-interval``) still overrides a decoder's load the same way in
  every worker (:class:`SharedLoadTracker`).
- **Artifact reloads.** ``POST /admin/reload`` reaches one worker; after it succeeds there
  the worker tells the parent (one byte on its pipe) and the parent sends ``SIGHUP`` to
  every other worker, which re-reads the same artifact path. ``SIGHUP`` to the parent
  reloads all of them.
- **Lifetime.** ``SIGTERM``/``SIGINT`` to the parent stop every worker; a worker that dies
  is started again (its row of the load table zeroed first: its requests died with it),
  unless it died within 5 s of its start (it cannot start: all stop, exit status 1).

Per-worker, not shared: health checks and circuit breakers (each worker checks every
engine itself; they agree within a health interval), the prefix-affinity table, metrics
(``/metrics`` answers from the worker the connection landed on; scrape each worker, or
sum, with ``--workers 1`` per port if exact per-router totals matter).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import select
import signal
import socket
import sys
import time

import numpy as np

from eldr.routing.loads import LoadTracker

__all__ = ["SharedLoadTracker", "SharedLoads", "make_tracker", "reserve_port", "run_workers"]

log = logging.getLogger("eldr.serve")

_current: tuple[SharedLoads, int] | None = None  # (table, this worker's row) in a worker
_MIN_LIFETIME = 5.0  # seconds: a worker ending sooner cannot start (port, artifact): stop


class SharedLoads:
    """(N, K) int64 in-flight counts, plus (K,) engine-reported loads and the in-flight
    sums at each report, in one anonymous shared mapping (created before ``fork``)."""

    def __init__(self, num_workers: int, num_decoders: int) -> None:
        self.num_workers, self.num_decoders = num_workers, num_decoders
        n, k = num_workers, num_decoders
        self._map = mmap.mmap(-1, 8 * (n * k + 3 * k))  # MAP_SHARED | MAP_ANONYMOUS
        buf = np.frombuffer(self._map, dtype=np.int64)
        self.in_flight = buf[: n * k].reshape(n, k)  # (N, K) rows: one per worker
        tail = np.frombuffer(self._map, dtype=np.float64, offset=8 * n * k)
        self.reported = tail[:k]  # (K,) engine load at the last scrape
        self.at_report = tail[k: 2 * k]  # (K,) in-flight sum when it was reported
        self.has_report = tail[2 * k:]  # (K,) 1.0 once a scrape reported the decoder

    def clear_row(self, row: int) -> None:
        self.in_flight[row] = 0


class SharedLoadTracker(LoadTracker):
    """A :class:`~eldr.routing.loads.LoadTracker` whose loads are every worker's.

    ``loads[k]`` = the requests all workers have in flight at decoder ``k`` or, once an
    engine scrape reported ``k``, that report plus the in-flight change since (never
    below 0), as in one process. Health is this worker's own (``healthy``).
    """

    def __init__(self, table: SharedLoads, row: int) -> None:
        self.num_workers = table.num_decoders
        self.healthy = np.ones(self.num_workers, dtype=bool)
        self._table, self._row = table, table.in_flight[row]

    @property
    def loads(self) -> np.ndarray:  # (K,) float64, fresh on every read
        t = self._table
        total = t.in_flight.sum(axis=0).astype(np.float64)
        if not t.has_report.any():
            return total
        scraped = np.maximum(t.reported + total - t.at_report, 0.0)
        return np.where(t.has_report > 0, scraped, total)

    def add_worker(self) -> int:
        raise ValueError("the shared load table is sized at start-up: the decoder pool "
                         "cannot change with --workers > 1")

    def remove_worker(self, worker: int) -> None:
        self.add_worker()  # the same refusal

    def on_dispatch(self, worker: int) -> None:
        self._row[self._index(worker)] += 1

    def on_complete(self, worker: int) -> None:
        k = self._index(worker)
        if self._row[k] > 0:
            self._row[k] -= 1

    def report(self, worker: int, load: float) -> None:
        load = float(load)
        if not np.isfinite(load) or load < 0:
            raise ValueError(f"reported load for worker {worker} must be finite and >= 0, "
                             f"got {load}")
        k, t = self._index(worker), self._table
        t.at_report[k] = float(t.in_flight[:, k].sum())
        t.reported[k] = load
        t.has_report[k] = 1.0


def make_tracker(num_decoders: int) -> LoadTracker:
    """The pool's tracker: shared across workers inside ``run_workers``, else local."""
    if _current is not None and _current[0].num_decoders == num_decoders:
        return SharedLoadTracker(*_current)
    return LoadTracker(num_decoders)


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


def run_workers(config, make_router, serve, *, ready=None) -> int:
    """Run ``config.workers`` router processes on ``config.host:config.port``; returns the
    exit status when stopped (0 after SIGTERM/SIGINT, 1 when a worker could not start).
    ``make_router()`` builds one worker's :class:`~eldr.proxy.app.Router` (called in each
    worker, after ``fork``); ``serve`` is :func:`eldr.commands.serve.serve`; ``ready(port)``
    is called in the parent once the port is known."""
    if not hasattr(socket, "SO_REUSEPORT") or not hasattr(os, "fork"):
        raise ValueError("--workers > 1 needs SO_REUSEPORT and fork (Linux, BSD, macOS)")
    n = config.workers
    holder, port = reserve_port(config.host, config.port)
    table = SharedLoads(n, len(config.decode_urls))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    pending: list[int] = []

    def on_signal(signum, frame) -> None:
        pending.append(signum)
        try:
            os.write(wake_w, b"s")
        except OSError:
            pass

    previous = {sig: signal.signal(sig, on_signal)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    children: dict[int, tuple[int, int]] = {}  # row -> (pid, read end of its relay pipe)
    started: dict[int, float] = {}  # row -> when its worker was started

    def spawn(row: int) -> None:
        table.clear_row(row)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            status = 1
            try:
                os.close(r)
                os.close(wake_r)
                os.close(wake_w)
                for _, (_, fd) in children.items():
                    os.close(fd)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_DFL)
                status = _worker_main(make_router, serve, table, row, port, w)
            except BaseException:  # a worker must never return into the parent's loop
                log.exception("worker %d failed", row)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        os.close(w)
        children[row] = (pid, r)
        started[row] = time.monotonic()

    for row in range(n):
        spawn(row)
    print(f"eldr serve: {n} workers on http://{config.host}:{port}", file=sys.stderr,
          flush=True)
    if ready is not None:
        ready(port)
    stopping, exit_status = False, 0
    try:
        while children:
            fds = [wake_r, *(fd for _, fd in children.values())]
            try:
                readable, _, _ = select.select(fds, [], [], 0.5)
            except InterruptedError:
                readable = []
            if wake_r in readable:
                os.read(wake_r, 4096)
            for row, (_, fd) in list(children.items()):
                if fd in readable:
                    data = os.read(fd, 4096)
                    if data:  # a worker reloaded on the admin API: the others follow
                        _signal_all(children, signal.SIGHUP, but=row)
            while pending:
                sig = pending.pop(0)
                if sig == signal.SIGHUP:
                    _signal_all(children, signal.SIGHUP)
                else:
                    stopping = True
                    _signal_all(children, signal.SIGTERM)
            for row, (pid, fd) in list(children.items()):
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 0
                if done == 0:
                    continue
                os.close(fd)
                del children[row]
                if stopping:
                    continue
                if time.monotonic() - started[row] < _MIN_LIFETIME:  # it cannot start: stop
                    log.error("worker %d (pid %d) ended at start-up (status %d): stopping",
                              row, pid, status)
                    stopping, exit_status = True, 1
                    _signal_all(children, signal.SIGTERM)
                    continue
                log.error("worker %d (pid %d) ended (status %d): starting it again",
                          row, pid, status)
                spawn(row)
    finally:
        if children:
            _signal_all(children, signal.SIGKILL)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        holder.close()
        os.close(wake_r)
        os.close(wake_w)
    return exit_status


def _signal_all(children: dict[int, tuple[int, int]], sig: int, but: int | None = None
                ) -> None:
    for row, (pid, _) in children.items():
        if row != but:
            try:
                os.kill(pid, sig)
            except OSError as exc:  # already gone: reaped on the next round
                if exc.errno != errno.ESRCH:
                    raise


def _worker_main(make_router, serve, table: SharedLoads, row: int, port: int,
                 relay_fd: int) -> int:
    """One worker: its router, its own listening socket, reloads relayed to the parent."""
    import asyncio

    global _current
    _current = (table, row)
    router = make_router()  # its pool's tracker is the shared one (make_tracker)
    own_reload = router.reload

    async def reload_and_relay():
        state = await own_reload()
        os.write(relay_fd, b"r")  # the parent sends SIGHUP to the other workers
        return state

    router.reload = reload_and_relay  # what the admin API calls
    try:
        import uvloop
    except ModuleNotFoundError:
        asyncio.run(serve(router, port=port, reuse_port=True, reload=own_reload))
    else:
        uvloop.run(serve(router, port=port, reuse_port=True, reload=own_reload))
    return 0
