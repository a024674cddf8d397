"""A local PD cluster on CPUs: N prefill + M decode vLLM-CPU engines, ``eldr serve`` in front.

What it starts (the settings the end-to-end tests use, docs/serve.md "Launching the vLLM
instances"):

- every engine: ``python -m vllm.entrypoints.openai.api_server --enforce-eager
  --block-size 32`` with ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache) and
  :class:`eldr.deploy.connector.EldrExampleConnector` (``kv_both``; vLLM's
  ``ExampleConnector`` less its short-prompt bug, docs/failures.md) on one shared store
  directory: the CPU stand-in for NIXL. 32-token blocks because the connector moves whole
  blocks only (vLLM-CPU's default of 128 would move nothing for short prompts); prefix
  caching off, so each prefill computes (and the capture plugin counts) its whole prompt;
- the capture plugin (entry point ``vllm.general_plugins: eldr_capture``) is active in
  every engine with ``ELDR_CAPTURE=prefill``; only prefill answers carry its payload;
- a chat template when the model's tokenizer has none (the tiny MoE has none);
- one engine per core, round robin (``VLLM_CPU_OMP_THREADS_BIND``);
- the routing artifact: the one given, else fitted (``eldr fit``) on the given trace, else
  on the shipped tiny-MoE trace when the model is the tiny MoE, else none (``eldr_cost``
  runs without one);
- ``eldr serve`` with every engine.

Everything lives in one temporary directory the cluster owns (logs, the connector's store,
the artifact) and is removed by :meth:`LocalCluster.stop`, which stops every process by
its process group. The connector never deletes what it stores: entries older than
``store_ttl`` seconds are deleted while the cluster runs (:meth:`LocalCluster.prune_store`).
A decoder reads a prompt's KV within a second of its prefill; if an entry is gone sooner
than that, the decoder recomputes the prompt (same tokens, slower), so pruning never
changes an answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eldr.deploy.processes import ChildProcess, free_port

__all__ = ["CHAT_TEMPLATE", "ClusterSpec", "LocalCluster", "connector_config",
           "engine_command", "kv_prefix_tokens", "plugin_pythonpath", "router_command"]

BLOCK_SIZE = 32  # tokens per KV block: the connector moves whole blocks only
# the engines' KV connector, loaded by vLLM by module path (vLLM is imported only there)
CONNECTOR_MODULE = "eldr.deploy.connector"
CONNECTOR_CLASS = "EldrExampleConnector"
# a minimal role-tagged template, for models whose tokenizer defines none
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "<|assistant|>")


def kv_prefix_tokens(num_tokens: int, block_size: int) -> int:
    """How many leading tokens of an ``num_tokens``-token prompt the KV connector stores,
    looks up and loads: the longest whole-block prefix shorter than the prompt; 0 (nothing
    stored, nothing matched) for a prompt of at most one block.

    Whole blocks because the connector moves blocks; shorter than the prompt because the
    engine must compute the last prompt token itself to sample the first output token.
    :class:`eldr.deploy.connector.EldrExampleConnector` applies it; vLLM 0.32's
    ``ExampleConnector`` matches ``(n − 2) // b · b`` tokens instead, −b for a one-token
    prompt, which kills the engine (docs/failures.md).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    return max(0, (num_tokens - 1) // block_size * block_size)


def connector_config(store: Path | str) -> dict:
    """vLLM's ``--kv-transfer-config`` of every engine: eldr's connector (by module path),
    ``kv_both`` (vLLM decides per request from its ``kv_transfer_params`` whether the
    engine stores or loads), one shared ``store`` directory."""
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}


@dataclass(frozen=True)
class ClusterSpec:
    """What ``eldr cluster`` starts; validated on construction."""

    model: str  # a local model folder
    served_name: str = "tiny"  # the model name clients use
    num_prefill: int = 1  # prefill engines
    num_decode: int = 2  # decode engines
    host: str = "127.0.0.1"  # where the router and engines listen
    port: int = 8000  # the router's port (0: a free one)
    artifact: str | None = None  # routing artifact; None: fitted from ``trace``, if any
    trace: str | None = None  # trace to fit the artifact on
    policy: str | None = None  # eldr serve --policy; None: its default
    max_model_len: int = 1024  # context length of every engine
    dtype: str = "float32"  # engine dtype (float32: exact CPU kernels for the tiny model)
    max_num_seqs: int = 16  # concurrent sequences per engine
    store_ttl: float = 120.0  # seconds a connector store entry is kept
    ready_timeout: float = 600.0  # seconds all engines may take to start
    extra_engine_args: tuple[str, ...] = ()  # appended to every engine's command line
    log_dir: str | None = None  # where the logs go (kept); None: the cluster's directory
    learn: str | None = None  # eldr serve --learn DIR; without artifact/trace: start with none
    serve_args: tuple[str, ...] = ()  # appended to the router's command line

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there (a local model "
                             f"folder is needed)")
        for name in ("num_prefill", "num_decode"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"{name} must be an integer in [1, 64], got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.artifact is not None and not Path(self.artifact).is_dir():
            raise ValueError(f"--artifact {self.artifact}: not a directory")
        if self.trace is not None and not Path(self.trace).is_file():
            raise ValueError(f"--trace {self.trace}: no such file")
        for name in ("store_ttl", "ready_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_model_len < BLOCK_SIZE:
            raise ValueError(f"max_model_len must be >= {BLOCK_SIZE}")
        if self.learn is not None and Path(self.learn).exists() and \
                not Path(self.learn).is_dir():
            raise ValueError(f"--learn {self.learn}: not a directory")
        if any(not isinstance(a, str) for a in self.serve_args):
            raise ValueError("serve_args must be strings")


def router_command(spec: ClusterSpec, engine_urls: dict[str, str], artifact: str | None,
                   port: int) -> list[str]:
    """``eldr serve``'s command line in front of ``engine_urls`` ({name: url}, prefill
    engines named ``prefill*``)."""
    cmd = [sys.executable, "-m", "eldr", "serve", "--host", spec.host, "--port", str(port)]
    for name, url in engine_urls.items():
        cmd += ["--prefill" if name.startswith("prefill") else "--decode", url]
    if artifact is not None:
        cmd += ["--artifact", artifact]
    if spec.policy is not None:
        cmd += ["--policy", spec.policy]
    if spec.learn is not None:
        cmd += ["--learn", str(Path(spec.learn).absolute())]
    return cmd + list(spec.serve_args)


def has_chat_template(model: str | Path) -> bool:
    """Whether the model's tokenizer defines a chat template (vLLM needs one for chat)."""
    model = Path(model)
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((model / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


def engine_command(spec: ClusterSpec, port: int, store: Path | None,
                   chat_template: Path | None) -> list[str]:
    """The vLLM-CPU engine's argv (``store``: the KV connector's directory, or None for a
    plain instance)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(spec.model), "--served-model-name", spec.served_name,
           "--host", spec.host, "--port", str(port), "--max-model-len", str(spec.max_model_len),
           "--dtype", spec.dtype, "--enforce-eager", "--no-enable-prefix-caching",
           "--max-num-seqs", str(spec.max_num_seqs), "--block-size", str(BLOCK_SIZE)]
    if chat_template is not None:
        cmd += ["--chat-template", str(chat_template)]
    if store is not None:
        cmd += ["--kv-transfer-config", json.dumps(connector_config(store))]
    return cmd + list(spec.extra_engine_args)


def engine_env(core: int, pythonpath: str) -> dict[str, str]:
    """The environment of one engine pinned to ``core`` (the defaults below yield to the
    caller's environment; the core and the path do not)."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "ELDR_CAPTURE": "prefill", **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": str(core), "PYTHONPATH": pythonpath}


def plugin_pythonpath(workdir: Path) -> str:
    """PYTHONPATH under which vLLM loads the eldr plugin in every process.

    vLLM finds plugins through the ``vllm.general_plugins`` entry point, declared by eldr's
    package metadata. An editable install made before the entry point existed lacks it: a
    throwaway dist-info under ``workdir`` declares it then.
    """
    from importlib.metadata import entry_points

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    src = str(Path(__file__).resolve().parents[2])  # this eldr, also in the engines
    if src not in paths:
        paths.insert(0, src)
    if not any(ep.name == "eldr_capture" for ep in entry_points(group="vllm.general_plugins")):
        info = workdir / "plugin_path" / "eldr_plugin-0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: eldr-plugin\nVersion: 0\n")
        (info / "entry_points.txt").write_text(
            "[vllm.general_plugins]\neldr_capture = eldr.capture.vllm_plugin:register\n")
        paths.insert(0, str(workdir / "plugin_path"))
    return os.pathsep.join(paths)


class LocalCluster:
    """Start, watch and stop a local PD cluster (``with LocalCluster(spec) as c: c.url``).

    ``start()`` returns once the router answers ``/health``; ``stop()`` stops every
    process it started (router first) and removes its directory. Safe to call twice.
    """

    def __init__(self, spec: ClusterSpec, *, log=print) -> None:
        self.spec = spec
        self.log = log  # progress lines
        self.workdir: Path | None = None  # the temporary directory the cluster owns
        self.engines: dict[str, ChildProcess] = {}  # name -> process (prefill-i, decode-k)
        self.engine_urls: dict[str, str] = {}
        self.router: ChildProcess | None = None
        self.url: str | None = None  # the router's base URL
        self.artifact: str | None = None  # the artifact the router runs with
        self.logs: Path | None = None  # the folder of the processes' logs

    @property
    def store(self) -> Path:
        return self.workdir / "kv_store"

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def processes(self) -> list[ChildProcess]:
        return [*self.engines.values(), *([self.router] if self.router else [])]

    def start(self) -> str:
        spec = self.spec
        self.workdir = Path(tempfile.mkdtemp(prefix="eldr-cluster-"))
        self.store.mkdir()
        self.log(f"workdir: {self.workdir} (connector store, artifact; removed on stop)")
        logs = Path(self.spec.log_dir) if self.spec.log_dir else self.workdir
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        template = None
        if not has_chat_template(spec.model):
            template = self.workdir / "chat_template.jinja"
            template.write_text(CHAT_TEMPLATE)
        pythonpath = plugin_pythonpath(self.workdir)
        cores = sorted(os.sched_getaffinity(0))
        roles = [f"prefill-{i}" for i in range(spec.num_prefill)] + \
                [f"decode-{k}" for k in range(spec.num_decode)]
        for n, name in enumerate(roles):
            port = free_port(spec.host)
            proc = ChildProcess(name, engine_command(spec, port, self.store, template),
                                engine_env(cores[n % len(cores)], pythonpath),
                                self.logs / f"{name}.log")
            proc.start()  # all engines start in parallel
            self.engines[name], self.engine_urls[name] = proc, f"http://{spec.host}:{port}"
            self.log(f"{name}: {self.engine_urls[name]} (pid {proc.pid}, log {proc.log_path})")
        self.artifact = self._artifact()
        deadline = time.monotonic() + spec.ready_timeout
        for name, proc in self.engines.items():
            proc.wait_ready(self.engine_urls[name] + "/health", deadline)
        self._start_router(pythonpath)
        return self.url

    def _artifact(self) -> str | None:
        spec = self.spec
        if spec.artifact is not None:
            return spec.artifact
        trace = spec.trace
        if trace is None and spec.learn is not None:
            return None  # learned from the traffic (or the artifact learned last in DIR)
        if trace is None:
            from eldr.capture import tiny_moe_dir, tiny_moe_trace_path

            if Path(spec.model).resolve() != Path(tiny_moe_dir()).resolve():
                return None  # no trace of this model: eldr_cost runs without an artifact
            trace = str(tiny_moe_trace_path())
        out = self.workdir / "artifact"
        done = subprocess.run([sys.executable, "-m", "eldr", "fit", trace, "--decoders",
                               str(spec.num_decode), "-o", str(out)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ValueError(f"eldr fit {trace} failed: {done.stderr.strip()[-500:]}")
        self.log(f"artifact: fitted on {trace} for {spec.num_decode} decoders")
        return str(out)

    def _start_router(self, pythonpath: str) -> None:
        spec = self.spec
        port = spec.port or free_port(spec.host)
        cmd = router_command(spec, self.engine_urls, self.artifact, port)
        self.router = ChildProcess("router", cmd, {**os.environ, "PYTHONPATH": pythonpath},
                                   self.logs / "router.log")
        self.router.start()
        self.url = f"http://{spec.host}:{port}"
        self.router.wait_ready(self.url + "/health", time.monotonic() + 60)
        self.log(f"router: {self.url} (pid {self.router.pid}, log {self.router.log_path})")

    def dead(self) -> list[str]:
        """Names of processes that exited on their own."""
        return [p.name for p in self.processes() if not p.is_running()]

    def prune_store(self, now: float | None = None) -> int:
        """Delete connector store entries older than ``store_ttl`` s; the number deleted."""
        now = time.time() if now is None else now
        removed = 0
        try:
            entries = list(os.scandir(self.store))
        except OSError:
            return 0
        for entry in entries:
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime < self.spec.store_ttl:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
                removed += 1
            except OSError:  # an entry written or removed meanwhile
                continue
        return removed

    def stop(self) -> None:
        """Stop the router, then every engine (by process group), and remove the
        cluster's directory (logs, store, artifact)."""
        for proc in reversed(self.processes()):
            proc.stop()
        self.router = None
        self.engines.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
