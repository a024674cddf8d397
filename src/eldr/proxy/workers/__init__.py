"""``eldr serve --workers N``: router processes on one port sharing their decoder loads,
their pool and their artifact (docs/serve.md#several-processes---workers-n).

:mod:`~eldr.proxy.workers.supervisor` is the parent (:func:`run_workers`);
:mod:`~eldr.proxy.workers.sharedpool` the memory and journal they share (each worker's
:class:`WorkerShare` reaches its router as an argument); :mod:`~eldr.proxy.workers.poollink`
a worker's side of the journal.
"""

from eldr.proxy.workers.poollink import PoolLink
from eldr.proxy.workers.sharedpool import PoolJournal, SharedLoads, SharedLoadTracker, WorkerShare
from eldr.proxy.workers.supervisor import reserve_port, run_workers

__all__ = ["PoolJournal", "PoolLink", "SharedLoadTracker", "SharedLoads", "WorkerShare",
           "reserve_port", "run_workers"]
