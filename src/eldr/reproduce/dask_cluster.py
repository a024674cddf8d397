"""Running a reproduction's simulations on a Dask distributed cluster (docs/cluster.md).

``eldr reproduce --cluster ADDRESS``: :func:`connect` opens a client of the scheduler at
ADDRESS and checks that every worker runs this eldr; :func:`eldr.reproduce.sweeps.run_plan`
then builds and fits the set-ups here, as a local run does, and hands each set-up's tasks
to :meth:`DaskCluster.run`. That scatters the set-up to every worker once
(:func:`shipped_setup`: the held-out split, its token slab and signatures, the fitted
encoder, predictor, centroids, cluster profiles and expert layouts; not the calibration
split, which the fits no longer need), submits one small task per simulation that names
the scattered copy, and yields the outputs as they finish. A worker reads nothing from
this machine's disk: the memory-mapped files of a local run (:mod:`eldr.reproduce.memmaps`)
are read here and their bytes sent.

The rows are those of a local run but for the wall-time columns: a task is the same pure
function of (plan, set-up, task) wherever it runs (:func:`run_shipped`).

``distributed`` (the ``cluster`` extra) is imported only in :func:`connect` and
:meth:`DaskCluster.run`; this module imports without it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from pathlib import Path

from eldr.reproduce.plan import Plan, Task
from eldr.reproduce.setup import RoutingSetup
from eldr.reproduce.sweeps import make_job, run_job

__all__ = ["MISSING", "DaskCluster", "code_fingerprint", "connect", "run_shipped",
           "shipped_setup"]

MISSING = ("--cluster needs Dask's distributed scheduler, which is not installed: "
           "pip install 'eldr[cluster]' (or 'dask[distributed]')")


@cache
def code_fingerprint() -> str:
    """``"<version> (code <12 hex>)"``: eldr's version and a SHA-256 of every ``.py`` file
    of the installed package (relative path and bytes, sorted). Two processes with the
    same fingerprint run the same simulator, so their rows agree; a version number alone
    does not say that of a development checkout."""
    import eldr

    root = Path(eldr.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return f"{eldr.__version__} (code {digest.hexdigest()[:12]})"


def shipped_setup(setup: RoutingSetup) -> RoutingSetup:
    """The set-up as a worker gets it: the same object but for the calibration split
    (``calib`` and ``calibration.trace`` None) and the oracle's cached decode patterns,
    which no task reads there. The caller fits every centroid set, profile and layout the
    tasks use first (:func:`eldr.reproduce.sweeps.prime_setups`): a worker could not."""
    calibration = replace(setup.calibration, trace=None)
    return replace(setup, calib=None, calibration=calibration, _patterns=None)


def run_shipped(plan: Plan, setup: RoutingSetup, task: Task) -> tuple[dict, list[dict]]:
    """One task on a worker: (summary row, decoder rows), exactly as
    :func:`eldr.reproduce.sweeps.run_task` returns them in this process."""
    return run_job(make_job(plan, setup, task))


class DaskCluster:
    """A client of a Dask scheduler that runs a set-up's tasks on its workers.

    Made by :func:`connect` (or around a ``distributed.Client`` of your own, which it
    then leaves open); a context manager that closes the client it opened. Passed to
    :func:`eldr.reproduce.sweeps.run_plan` as ``cluster=``.
    """

    def __init__(self, client, *, owns_client: bool = False) -> None:
        self.client = client  # a connected distributed.Client
        self._owns_client = owns_client  # close it on exit

    @property
    def num_threads(self) -> int:
        """Worker threads of the cluster now (tasks that run at once)."""
        return int(sum(self.client.nthreads().values()))

    def __str__(self) -> str:
        workers = self.client.nthreads()
        return (f"the Dask cluster at {self.client.scheduler.address} ({len(workers)} "
                f"worker(s), {sum(workers.values())} thread(s))")

    def __enter__(self) -> DaskCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client if :func:`connect` opened it (the cluster keeps running)."""
        if self._owns_client:
            self.client.close()

    def run(self, plan: Plan, setup: RoutingSetup,
            tasks: list[Task]) -> Iterator[tuple[int, tuple[dict, list[dict]]]]:
        """(position in ``tasks``, (summary row, decoder rows)) of each task, as they
        finish on the workers: a runner of :func:`eldr.reproduce.sweeps.run_tasks`.

        The set-up is scattered to every worker once (``broadcast``: each task then finds
        it where it runs) and released when its tasks are done, so a worker holds one
        set-up at a time, as a local run's processes map one slab at a time. Workers are
        checked first (:func:`check_workers`: one may have joined since the last set-up).
        A task that fails raises its error here; the others are cancelled."""
        from distributed import as_completed

        client = self.client
        check_workers(client)
        shipped = client.scatter(shipped_setup(setup), broadcast=True, hash=False)
        futures = [client.submit(run_shipped, plan, shipped, t, pure=False) for t in tasks]
        position = {f.key: j for j, f in enumerate(futures)}
        try:
            for fut in as_completed(futures, loop=client.loop):
                yield position[fut.key], fut.result()
        finally:
            client.cancel([*futures, shipped])


def connect(address: str, *, timeout: float | None = None) -> DaskCluster:
    """A :class:`DaskCluster` on the scheduler at ``address`` (``tcp://host:8786``), once
    at least one worker has joined and every worker runs this eldr
    (:func:`code_fingerprint`).

    ``timeout`` seconds to connect and to wait for a worker (None: Dask's
    ``distributed.comm.timeouts.connect``, 30 s by default). Raises ``ValueError`` with
    one line when ``distributed`` is not installed, the scheduler cannot be reached, no
    worker joins, or a worker runs other code."""
    try:
        from distributed import Client
    except ImportError:
        raise ValueError(MISSING) from None
    if timeout is None:
        import dask
        from dask.utils import parse_timedelta

        timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
    _check_address(address)
    try:
        client = Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as exc:
        raise ValueError(f"cannot reach a Dask scheduler at {address!r}: "
                         f"{_first_line(exc)}") from None
    try:
        try:
            client.wait_for_workers(1, timeout=timeout)
        except TimeoutError:
            raise ValueError(f"no Dask worker joined the scheduler at {address!r} within "
                             f"{timeout:g} s") from None
        check_workers(client)
    except BaseException:
        client.close()
        raise
    return DaskCluster(client, owns_client=True)


def _check_address(address: str) -> None:
    """Refuse a malformed address before a ``Client`` is made of it: a client that fails
    to parse its address is left half-made, and its finaliser then blocks the exit of
    the process for many seconds."""
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
        if scheme in ("tcp", "tls"):
            parse_host_port(location)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{address!r} is no Dask scheduler address ({_first_line(exc)}); "
                         "expected tcp://HOST:PORT") from None


def check_workers(client) -> None:
    """Raise ``ValueError`` naming the first worker whose eldr differs from this
    process's (:func:`code_fingerprint`), or that cannot import eldr at all."""
    mine = code_fingerprint()
    theirs = client.run(_fingerprint_probe(), on_error="return")
    for worker, got in sorted(theirs.items()):
        if got != mine:
            what = f"cannot run it ({_first_line(got)})" if isinstance(got, BaseException) \
                else f"has {got}"
            raise ValueError(f"Dask worker {worker} {what}, this client eldr {mine}: install "
                             "the same eldr on every worker (docs/cluster.md)")


def _fingerprint_probe():
    """A function that returns the worker's :func:`code_fingerprint`, or why it has none.
    Nested, so that it travels by value: a reference to this module would fail to load
    on a worker without eldr, before it could say so."""
    def probe() -> str:
        try:
            from eldr.reproduce.dask_cluster import code_fingerprint
        except ImportError as exc:
            return f"no eldr ({exc})"
        return code_fingerprint()
    return probe


def _first_line(exc: object) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
