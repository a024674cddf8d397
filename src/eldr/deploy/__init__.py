"""Starting ELDR deployments on this machine: ``eldr cluster``'s processes.

:mod:`eldr.deploy.processes` runs and stops child processes (each in its own session,
stopped by process group); :mod:`eldr.deploy.local` builds and runs a local PD cluster of
vLLM-CPU engines with ``eldr serve`` in front. Nothing here is imported by the router.
"""

from eldr.deploy.local import ClusterSpec, LocalCluster, engine_command
from eldr.deploy.processes import ChildProcess, free_port

__all__ = ["ChildProcess", "ClusterSpec", "LocalCluster", "engine_command", "free_port"]
