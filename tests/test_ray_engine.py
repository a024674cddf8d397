"""The Ray app's engine replicas (eldr.integrations.ray.engine): the command they run and
the watchdog that stops an engine whose replica died hard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from eldr.integrations.ray.engine import WATCHDOG, EngineSpec, engine_argv

# a stand-in replica: starts an "engine" (a process group of two sleepers) and the
# watchdog, prints the engine's group id, then waits to be killed
REPLICA = f"""
import os, subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(600)']); time.sleep(600)"], start_new_session=True)
subprocess.Popen([sys.executable, "-c", {WATCHDOG!r}, str(os.getpid()), str(engine.pid)],
                 start_new_session=True)
print(engine.pid, flush=True)
time.sleep(600)
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_watchdog_stops_the_engine_group_when_its_replica_is_killed():
    replica = subprocess.Popen([sys.executable, "-c", REPLICA], stdout=subprocess.PIPE)
    group = int(replica.stdout.readline())
    try:
        time.sleep(1.5)
        assert _group_alive(group)  # alive while its replica is
        replica.send_signal(signal.SIGKILL)
        replica.wait()
        deadline = time.monotonic() + 15
        while _group_alive(group):
            assert time.monotonic() < deadline, "the engine outlived its replica"
            time.sleep(0.2)
    finally:
        if _group_alive(group):
            os.killpg(group, signal.SIGKILL)


def test_the_engine_command_is_eldr_clusters_or_a_given_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    spec = EngineSpec(role="prefill", model=str(tmp_path), store="/kv")
    argv = engine_argv(spec, 8100)
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--port") + 1] == "8100"
    with pytest.raises(ValueError, match="role"):
        EngineSpec(role="router", model=str(tmp_path))
    with pytest.raises(ValueError, match=r"config\.json"):
        EngineSpec(role="decode", model=str(tmp_path / "missing"))
