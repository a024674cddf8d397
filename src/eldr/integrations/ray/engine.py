"""One vLLM engine per Serve replica: the process ``eldr cluster`` starts, owned by a replica.

The prefill and decode deployments of :mod:`eldr.integrations.ray.app` are plain Serve
deployments whose replicas each start one vLLM-CPU OpenAI server with exactly the
command and environment of :mod:`eldr.deploy.local` (``engine_command``/``engine_env``:
eldr's CPU KV connector on a shared store, the capture plugin, 32-token blocks, eager),
wait until it answers ``/health``, and register its URL in the app's decode table
(:mod:`eldr.integrations.ray.table`). Serve's periodic ``check_health`` asks the engine's
``/health`` and, when it answers, registers again: the table's heartbeat. An engine that
exited fails the check, Serve replaces the replica, and the new replica takes the dead
one's slot.

The engine runs in its own session (``eldr.deploy.processes.ChildProcess``: stopped by
its process group, vLLM's engine-core and worker processes included). A replica Serve
kills hard never runs its destructor, and vLLM's engine core outlives its API server
(seen: orphaned engine cores holding 2 GB each after a Serve shutdown), so a small
watchdog process (:data:`WATCHDOG`) kills the engine's whole process group once the
replica process is gone.

Requests never pass through the replica: the ingress talks HTTP to the engine's URL
(the table's), so streaming, usage and errors are vLLM's own bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eldr.deploy.processes import ChildProcess

__all__ = ["WATCHDOG", "EngineServer", "EngineSpec", "engine_argv"]

# argv[1]: the replica's pid, argv[2]: the engine's process group. The watchdog is the
# replica's child in a session of its own: when the replica dies it is re-parented, and
# then stops the engine's group (SIGTERM, SIGKILL after 5 s); it exits once the group is
# gone.
WATCHDOG = """
import os, signal, sys, time
owner, group = int(sys.argv[1]), int(sys.argv[2])
while True:
    time.sleep(1.0)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        break
    if os.getppid() != owner:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            time.sleep(wait)
        break
"""


@dataclass(frozen=True)
class EngineSpec:
    """What every engine of one role runs; validated on construction."""

    role: str  # "prefill" or "decode"
    model: str  # a local model folder
    served_name: str = "tiny"  # the model name clients use
    store: str | None = None  # the KV connector's shared directory; None: no connector
    max_model_len: int = 1024
    dtype: str = "float32"
    max_num_seqs: int = 16
    cores: tuple[int, ...] = ()  # CPU cores engines are pinned to, by replica rank; (): all
    chat_template: str | None = None  # a template file, for models that have none
    extra_args: tuple[str, ...] = ()  # appended to the engine's command line
    env: tuple[tuple[str, str], ...] = ()  # added to the engine's environment
    ready_timeout: float = 600.0  # seconds the engine may take to answer /health
    # where the engine listens: loopback on one machine; 0.0.0.0 across hosts (the table
    # then gets the Ray node's IP)
    host: str = "127.0.0.1"
    log_dir: str | None = None  # engine logs; None: $ELDR_RAY_LOG_DIR, else a temp folder
    # the engine's argv; "{port}" in it is replaced by the engine's port. None: vLLM-CPU
    # with eldr cluster's settings (tests start stand-in engines with their own command)
    command: tuple[str, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if self.command is None and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model {self.model!r}: no config.json there (a local model "
                             f"folder is needed)")
        if not self.ready_timeout > 0:
            raise ValueError(f"ready_timeout must be > 0, got {self.ready_timeout!r}")


def engine_argv(spec: EngineSpec, port: int) -> list[str]:
    """The engine's command line: ``spec.command`` with its port, else ``eldr cluster``'s
    vLLM-CPU engine (:func:`eldr.deploy.local.engine_command`)."""
    if spec.command is not None:
        return [a.replace("{port}", str(port)) for a in spec.command]
    from eldr.deploy.local import ClusterSpec, engine_command

    cluster = ClusterSpec(model=spec.model, served_name=spec.served_name, host=spec.host,
                          max_model_len=spec.max_model_len, dtype=spec.dtype,
                          max_num_seqs=spec.max_num_seqs,
                          extra_engine_args=tuple(spec.extra_args))
    template = Path(spec.chat_template) if spec.chat_template else None
    store = Path(spec.store) if spec.store else None
    return engine_command(cluster, port, store, template, decode=spec.role == "decode")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the replica process dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class EngineServer:
    """The body of a prefill or decode replica: start the engine, heartbeat, stop it.

    ``table``: an object with an async ``register(role, replica, url, pid, node)`` and
    ``unregister(replica)`` (the decode table deployment's handle, wrapped by the app).
    """

    def __init__(self, spec: EngineSpec, table) -> None:
        from eldr.deploy.local import engine_env, plugin_pythonpath
        from eldr.deploy.processes import free_port

        self.spec = spec
        self.table = table
        self.replica, rank, self.node = _replica_identity()
        port = free_port(spec.host)
        self.url = f"http://{_reachable_host(spec.host)}:{port}"
        logdir = Path(spec.log_dir or os.environ.get("ELDR_RAY_LOG_DIR") or _default_logdir())
        logdir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.replica)
        workdir = logdir / "plugin"
        cores = spec.cores or tuple(sorted(os.sched_getaffinity(0)))
        env = engine_env(cores[rank % len(cores)], plugin_pythonpath(workdir))
        env.update(dict(spec.env))
        self.child = _EngineProcess(f"{spec.role} engine of {self.replica}",
                                    engine_argv(spec, port), env, logdir / f"{safe}.log")
        self.child.start()
        self.watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(self.child.pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        self.child.wait_ready(self.url + "/health", time.monotonic() + spec.ready_timeout)
        self.registered = False

    @property
    def pid(self) -> int | None:
        return self.child.pid

    async def heartbeat(self) -> None:
        """Serve's health check: the engine must answer ``/health``; then (re)register."""
        from eldr.deploy.processes import http_status

        if not self.child.is_running():
            raise RuntimeError(f"the {self.spec.role} engine exited "
                               f"({self.child.returncode}):\n{self.child.log_tail(1500)}")
        import asyncio

        status = await asyncio.get_running_loop().run_in_executor(
            None, http_status, self.url + "/health", 5.0)
        if status != 200:
            raise RuntimeError(f"the {self.spec.role} engine at {self.url} answers /health "
                               f"with {status}")
        await self.table.register(self.spec.role, self.replica, self.url, self.pid, self.node)
        self.registered = True

    def stop(self) -> None:
        self.child.stop(grace=15.0)
        try:
            self.watchdog.wait(timeout=5.0)  # it exits once the engine's group is gone
        except subprocess.TimeoutExpired:
            self.watchdog.kill()

    def info(self) -> dict:
        return {"role": self.spec.role, "replica": self.replica, "url": self.url,
                "pid": self.pid, "node": self.node}


class _EngineProcess(ChildProcess):
    """``ChildProcess`` whose engine is told to stop when this process dies."""

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # closed in stop()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)


def _reachable_host(host: str) -> str:
    """The address other nodes reach an engine listening on ``host`` at: the Ray node's IP
    for a wildcard address, else ``host`` itself."""
    if host not in ("0.0.0.0", "::"):
        return host
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # not in Ray (unit tests)
        return "127.0.0.1"


def _replica_identity() -> tuple[str, int, str | None]:
    """(replica id, rank, node id) of the Serve replica running this code; outside Serve
    (unit tests): the process id, rank 0, no node."""
    try:
        import ray
        from ray import serve

        ctx = serve.get_replica_context()
        rank = getattr(ctx, "rank", 0)
        rank = int(getattr(rank, "rank", rank) or 0)
        return ctx.replica_id.unique_id, rank, ray.get_runtime_context().get_node_id()
    except Exception:  # not in a replica
        return f"pid-{os.getpid()}", 0, None


def _default_logdir() -> str:
    import tempfile

    return str(Path(tempfile.gettempdir()) / f"eldr-ray-engines-{os.getuid()}")
