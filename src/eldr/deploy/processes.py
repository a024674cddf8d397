"""Child processes that are always stopped: own session, stopped by process group id.

vLLM's API server forks an engine-core process (and, on CPU, a worker); killing only the
PID it was started with would leave those running. Each child therefore starts in its own
session (``start_new_session``), so its process group id is its PID and
``os.killpg(pid, ...)`` reaches every process it started, and only those.

Its own session also takes it out of its parent's reach when the parent dies without
stopping it (SIGKILL, or a SIGTERM Python does not handle: ``eldr cluster`` killed, a test
run killed by a timeout): the engines went on running, tens of GB of them, under init. So
on Linux each child also asks the kernel for SIGTERM when the thread that started it exits
(:func:`parent_death_signal`); it then stops as on ``stop()``'s first signal (vLLM's
server stops its engine core on SIGTERM).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["ChildProcess", "NotReady", "free_port", "http_status", "parent_death_signal"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class NotReady(RuntimeError):
    """A child exited, or did not answer its readiness URL in time (the message says
    which, with the end of its log)."""


def parent_death_signal(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process
    dies (Linux ``prctl(PR_SET_PDEATHSIG)``), even from SIGKILL; None where that cannot be
    had (not Linux, no libc), and when called off the main thread: the kernel sends the
    signal when the THREAD that started the child exits, which for a worker thread is not
    this process's death.

    A parent that died between the fork and the ``prctl`` is caught by comparing the
    child's parent with the one that started it: the child then signals itself."""
    if not sys.platform.startswith("linux") \
            or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
    except (OSError, AttributeError):
        return None
    parent, number = os.getpid(), int(sig)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, number, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), number)

    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The HTTP status ``url`` answers a GET with, or None when it does not answer within
    ``timeout`` s (a readiness probe: short, so that polling one process holds up no
    other)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


class ChildProcess:
    """One command run in its own session, its output appended to ``log``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name  # for messages
        self.cmd = cmd  # argv
        self.env = env  # the whole environment of the child
        self.log_path = Path(log)  # stdout and stderr, appended
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # closed in stop()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True,
                                     preexec_fn=parent_death_signal())

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (−N: killed by signal N), else None."""
        return None if self.proc is None else self.proc.poll()

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def wait_ready(self, url: str, deadline: float) -> None:
        """Poll ``url`` until it answers 200; ``NotReady`` if the child exits first or
        ``deadline`` (``time.monotonic()``) passes."""
        while True:
            if not self.is_running():
                code = None if self.proc is None else self.proc.returncode
                raise NotReady(f"{self.name} exited with {code}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise NotReady(f"{self.name} not ready at {url} in time:\n{self.log_tail()}")
            time.sleep(1)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Signal the child's process group, wait ``grace`` s, then SIGKILL the group.

        The group is signalled even when the leader already exited: its engine-core
        children may still run."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(pgid, grace)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _kill_group(pgid: int, grace: float) -> None:
    """SIGKILL what is left of group ``pgid`` and wait (bounded) until it is gone."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)  # anyone left?
        except ProcessLookupError:
            return
        except PermissionError:  # a reused group id of someone else's: not ours
            return
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.1)
