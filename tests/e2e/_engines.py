"""What the end-to-end tests share: locating the model, starting vLLM-CPU engines (with the
settings of :mod:`eldr.deploy.local`, the same ``eldr cluster`` uses), and HTTP helpers.

Every process runs in its own session and is stopped by its process group id.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

READY_TIMEOUT_S = 420
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "<|assistant|>")  # equal to eldr.deploy.local.CHAT_TEMPLATE


# -- locating what the test needs ---------------------------------------------------------
def _model_dir() -> Path:
    env = os.environ.get("ELDR_E2E_MODEL")
    if env:
        return Path(env)
    try:
        from eldr.capture import tiny_moe_dir

        return Path(tiny_moe_dir())
    except (ImportError, ValueError):  # not shipped (yet): the skip reason names the path
        return Path(__file__).resolve().parents[2] / "src" / "eldr" / "data" / "tiny_moe"


def _trace_path() -> Path | None:
    env = os.environ.get("ELDR_E2E_TRACE")
    if env:
        return Path(env)
    try:
        from eldr.capture import tiny_moe_trace_path

        return Path(tiny_moe_trace_path())
    except (ImportError, ValueError):  # not shipped (yet)
        return None


def _skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'eldr[vllm]')"
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # a broken torchvision next to CPU torch, for one
        return f"vllm is not importable: {exc}"
    if importlib.util.find_spec("aiohttp") is None:
        return "aiohttp is not installed (pip install 'eldr[serve]')"
    if not (_model_dir() / "config.json").is_file():
        return f"the tiny MoE is not shipped yet (no {_model_dir() / 'config.json'})"
    if importlib.util.find_spec("eldr.capture.vllm_plugin") is None:
        return "the eldr capture plugin (eldr.capture.vllm_plugin) is not there yet"
    return None


def _no_artifact_reason() -> str | None:
    """Why the eldr policy cannot run (the router then runs round_robin), or None."""
    if importlib.util.find_spec("eldr.fit.artifact") is None:
        return "eldr.fit.artifact (eldr fit) is not there yet"
    if _trace_path() is None and (importlib.util.find_spec("torch") is None
                                  or importlib.util.find_spec("transformers") is None):
        return "no tiny-MoE trace shipped, and no torch/transformers to capture one"
    return None


def _plugin_pythonpath(tmp: Path) -> str:
    """PYTHONPATH under which vLLM loads the eldr plugin (eldr.deploy.local)."""
    from eldr.deploy.local import plugin_pythonpath

    return plugin_pythonpath(tmp)


def _free_port() -> int:
    from eldr.deploy import free_port

    return free_port()


# -- HTTP helpers ---------------------------------------------------------------------------
def _request(url: str, body=None, *, data: bytes | None = None, timeout: float = 120,
             headers: dict | None = None):
    """(status, headers, bytes) of a POST (body/data) or GET; HTTP errors are returned."""
    if body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _text(raw: bytes, *, chat: bool, stream: bool) -> str:
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    out = []
    for event in raw.decode().split("\n\n"):
        if not event.startswith("data: ") or event == "data: [DONE]":
            continue
        doc = json.loads(event[6:])
        assert "error" not in doc, doc
        for choice in doc.get("choices", []):
            out.append((choice.get("delta") or {}).get("content") or "" if chat
                       else choice.get("text", ""))
    return "".join(out)


def _metric(page: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as prometheus_client
    line_start = f"{name}{{{want}}} " if labels else f"{name} "
    for line in page.splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    return 0.0


# -- processes ------------------------------------------------------------------------------
class _Proc:
    """A subprocess in its own session, stopped by its process group id
    (:class:`eldr.deploy.ChildProcess`; a failed start fails the test)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path) -> None:
        from eldr.deploy import ChildProcess

        self.child = ChildProcess(name, cmd, env, log)
        self.name, self.cmd, self.env, self.log_path = name, cmd, env, log

    @property
    def proc(self):
        return self.child.proc

    def start(self) -> None:
        self.child.start()

    def log_tail(self, n: int = 3000) -> str:
        return self.child.log_tail(n)

    def wait_ready(self, url: str, deadline: float) -> None:
        from eldr.deploy.processes import NotReady

        try:
            self.child.wait_ready(url, deadline)
        except NotReady as exc:
            pytest.fail(str(exc))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.child.stop(sig)


def _engine(name: str, tmp: Path, core: int, *, kv: bool, pythonpath: str) -> tuple[_Proc, str]:
    """One engine of the tiny MoE (or ``ELDR_E2E_MODEL``) with ``eldr cluster``'s settings:
    eldr's KV connector (vLLM's ExampleConnector less its short-prompt bug,
    eldr.deploy.connector) on ``tmp/kv`` when ``kv`` (a plain reference instance
    otherwise)."""
    from eldr.deploy.local import ClusterSpec, engine_command, engine_env

    port = _free_port()
    spec = ClusterSpec(model=str(_model_dir()), served_name=MODEL_NAME)
    template = tmp / "chat_template.jinja"
    if not template.is_file():
        template.write_text(CHAT_TEMPLATE)
    cmd = engine_command(spec, port, tmp / "kv" if kv else None, template)
    return (_Proc(name, cmd, engine_env(core, pythonpath), tmp / f"{name}.log"),
            f"http://127.0.0.1:{port}")


def _start_engines(tmp: Path, layout, procs: dict, urls: dict, pythonpath: str) -> None:
    """Start engines ``layout`` = [(name, kv), ...] in parallel, each pinned to a core in
    turn, into ``procs``/``urls`` (filled as they start, so the caller's ``finally`` stops
    whatever did start), and wait until every one answers /health."""
    import time

    cores = sorted(os.sched_getaffinity(0))
    for i, (name, kv) in enumerate(layout):
        procs[name], urls[name] = _engine(name, tmp, cores[i % len(cores)], kv=kv,
                                          pythonpath=pythonpath)
        procs[name].start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    for name, _kv in layout:
        procs[name].wait_ready(urls[name] + "/health", deadline)


@contextlib.contextmanager
def engine_set(tmp_path_factory, name: str, layout):
    """A module fixture's engines: skip when vLLM or the model is missing, start ``layout``
    ([(engine name, kv)]) in a fresh ``name`` directory with a connector store, give
    (tmp, urls, procs) (the caller may add processes, a router, to ``procs``), then stop
    every process and empty the store (the connector never cleans up)."""
    import shutil

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "kv").mkdir()
    procs: dict[str, _Proc] = {}
    urls: dict[str, str] = {}
    try:
        _start_engines(tmp, layout, procs, urls, _plugin_pythonpath(tmp))
        yield tmp, urls, procs
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()
        shutil.rmtree(tmp / "kv", ignore_errors=True)


class ClusterProcess:
    """``eldr cluster`` as a subprocess (an operator's view): its output in ``out``, the
    router's URL and each engine's URL and pid read off its lines, stopped by SIGTERM to
    its process group (eldr cluster then stops its own processes)."""

    def __init__(self, tmp: Path, args: list[str], pythonpath: str) -> None:
        import subprocess
        import sys

        self.out = tmp / "cluster.out"
        self._log = open(self.out, "w")  # closed in stop()
        from eldr.deploy.processes import parent_death_signal

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eldr", "cluster", *args], stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=parent_death_signal(),  # a killed test run stops it (and its engines)
            env={**os.environ, "PYTHONPATH": pythonpath})
        self.url: str | None = None  # the router
        self.engines: dict[str, tuple[str, int]] = {}  # name -> (url, pid of the first start)
        self.exit_code: int | None = None

    def lines(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_ready(self, deadline: float) -> None:
        import re
        import time

        while time.monotonic() < deadline:
            text = self.lines()
            m = re.search(r"^ready: (\S+)", text, re.M)
            if m:
                self.url = m.group(1)
                self.engines = {name: (url, int(pid)) for name, url, pid in re.findall(
                    r"^((?:prefill|decode)-\d+): (\S+) \(pid (\d+),", text, re.M)}
                return
            if self.proc.poll() is not None:
                pytest.fail(f"eldr cluster exited with {self.proc.returncode}:\n"
                            f"{text[-3000:]}")
            time.sleep(1)
        pytest.fail(f"eldr cluster not ready in time:\n{self.lines()[-3000:]}")

    def stop(self) -> int | None:
        """SIGTERM, then (after 120 s) SIGKILL to its group and to the group of every
        process it said it started (each runs in its own session); its exit code."""
        import re
        import subprocess

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.exit_code = self.proc.wait(timeout=30)
            for pid in {int(p) for p in re.findall(r"\(pid (\d+)", self.lines())}:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        self._log.close()
        return self.exit_code
