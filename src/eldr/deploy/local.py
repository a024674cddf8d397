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
its process group. While it runs, :meth:`LocalCluster.supervise` restarts an engine (or the
router) that exited, with the same command, port and core, after a bounded exponential
back-off (:class:`RestartPolicy`); the router's health checks take a dead engine out of
rotation meanwhile and back once it answers again.

The connector never deletes what it stores: entries older than ``store_ttl`` seconds are
deleted while the cluster runs (:meth:`LocalCluster.prune_store`). A decoder reads a
prompt's KV within a second of its prefill; if an entry is gone sooner than that, the
decoder recomputes the prompt (same tokens, slower), so pruning never changes an answer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eldr.deploy.processes import ChildProcess, free_port, http_status

__all__ = ["CHAT_TEMPLATE", "ClusterSpec", "LocalCluster", "RestartPolicy", "Watched",
           "connector_config", "engine_command", "kv_prefix_tokens", "plugin_pythonpath",
           "router_command"]

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
class RestartPolicy:
    """How :meth:`LocalCluster.supervise` restarts a process that exited; validated on
    construction.

    Restart ``n`` of an unbroken streak waits ``min(first_delay · 2^(n−1), max_delay)`` s:
    one crash is repaired within seconds, while a process that dies on every start (out of
    memory, its port taken) is not restarted in a tight loop. The streak starts over once
    the process has run ``stable_after`` s since it became ready. ``max_failed_starts``
    starts in a row that never became ready (answered ``/health`` within the spec's
    ``ready_timeout``) give the process up: it is not started again.
    """

    first_delay: float = 1.0  # seconds before the first restart of a streak
    max_delay: float = 30.0  # the back-off's bound
    stable_after: float = 60.0  # seconds up after which the streak starts over
    max_failed_starts: int = 3  # starts in a row that never became ready: given up

    def __post_init__(self) -> None:
        if not 0 < self.first_delay <= self.max_delay:
            raise ValueError(f"restart delays must satisfy 0 < first_delay <= max_delay, "
                             f"got {self.first_delay!r}, {self.max_delay!r}")
        if not self.stable_after > 0:
            raise ValueError(f"stable_after must be > 0, got {self.stable_after!r}")
        if not isinstance(self.max_failed_starts, int) or self.max_failed_starts < 1:
            raise ValueError(f"max_failed_starts must be an integer >= 1, got "
                             f"{self.max_failed_starts!r}")

    def delay(self, streak: int) -> float:
        """Seconds before restart ``streak`` (1: the first) of an unbroken streak."""
        return min(self.max_delay, self.first_delay * 2.0 ** min(max(streak - 1, 0), 64))


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
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # after a process exits
    # decoders run this folder instead of ``model``: the SAME function with other weights'
    # layout (the wide tiny MoE, eldr.capture.wide), so KV and routing stay exchangeable
    decode_model: str | None = None

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
        if not isinstance(self.restart, RestartPolicy):
            raise ValueError(f"restart must be a RestartPolicy, got {self.restart!r}")
        if self.decode_model is not None:
            _check_same_function(self.model, self.decode_model)


def router_command(spec: ClusterSpec, engine_urls: dict[str, str], artifact: str | None,
                   port: int, chat_template: Path | None = None) -> list[str]:
    """``eldr serve``'s command line in front of ``engine_urls`` ({name: url}, prefill
    engines named ``prefill*``). The router gets the model's tokenizer and the engines'
    chat template (``chat_template``, when the cluster wrote one), so it can route on an
    artifact's prompt predictor before prefill, unless ``serve_args`` name their own."""
    cmd = [sys.executable, "-m", "eldr", "serve", "--host", spec.host, "--port", str(port)]
    given = set(spec.serve_args)
    if "--tokenizer" not in given and (Path(spec.model) / "tokenizer.json").is_file():
        cmd += ["--tokenizer", str(Path(spec.model).absolute())]
    if "--chat-template" not in given and chat_template is not None:
        cmd += ["--chat-template", str(chat_template)]
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


def _check_same_function(model: str, decode_model: str) -> None:
    """A decode model must compute what the prefill model computes: same architecture,
    layers, experts, top-k, hidden size and vocabulary (only the expert width may differ,
    as in the zero-padded wide tiny MoE); else the KV handed over is another model's."""
    configs = []
    for label, folder in (("--model", model), ("--decode-model", decode_model)):
        try:
            configs.append(json.loads((Path(folder) / "config.json").read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{label} {folder}: no readable config.json ({exc})") from None
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "num_experts_per_tok",
            "num_local_experts", "num_experts")
    differ = [k for k in keys if configs[0].get(k) != configs[1].get(k)]
    if differ:
        raise ValueError(f"--decode-model {decode_model}: not the same model as --model "
                         f"{model} (differs in {', '.join(differ)})")


def engine_command(spec: ClusterSpec, port: int, store: Path | None,
                   chat_template: Path | None, *, decode: bool = False) -> list[str]:
    """The vLLM-CPU engine's argv (``store``: the KV connector's directory, or None for a
    plain instance; ``decode``: a decode engine, which runs ``spec.decode_model`` when
    set)."""
    model = spec.decode_model if decode and spec.decode_model is not None else spec.model
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model), "--served-model-name", spec.served_name,
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


@dataclass
class Watched:
    """One process :meth:`LocalCluster.supervise` keeps running, and where it stands
    (mutable: each step updates it)."""

    proc: ChildProcess
    role: str  # "prefill", "decode" or "router"
    ready_url: str  # answers when the process is ready (its /health)
    state: str = "up"  # up | starting (restarted, not ready yet) | waiting | given_up
    since: float = 0.0  # clock time it became ready (up) or was started (starting)
    restart_at: float = 0.0  # clock time it starts again (waiting)
    restarts: int = 0  # restarts so far
    streak: int = 0  # restarts since it last ran stable_after seconds
    failed_starts: int = 0  # starts in a row that did not become ready

    def ready(self, status: int | None) -> bool:
        """Whether ``status`` (of ``ready_url``; None: no answer) means ready. An engine
        answers 200 once it serves; the router answers 503 while it sees no healthy
        engine of a role, which after its own restart is the engines' business."""
        return status == 200 or (self.role == "router" and status == 503)


class LocalCluster:
    """Start, watch and stop a local PD cluster (``with LocalCluster(spec) as c: c.url``).

    ``start()`` returns once the router answers ``/health``; ``supervise(now)``, called
    about once a second, restarts what exited (:class:`RestartPolicy`) and says when the
    cluster cannot go on; ``stop()`` stops every process it started (router first), logs
    the restart counts and removes its directory. Safe to call twice.

    ``clock`` (``time.monotonic``) and ``probe`` (url -> HTTP status or None,
    :func:`eldr.deploy.processes.http_status`) are there for tests.
    """

    def __init__(self, spec: ClusterSpec, *, log=print,
                 probe: Callable[[str], int | None] = http_status,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.log = log  # progress lines
        self.probe = probe
        self.clock = clock
        self.workdir: Path | None = None  # the temporary directory the cluster owns
        self.engines: dict[str, ChildProcess] = {}  # name -> process (prefill-i, decode-k)
        self.engine_urls: dict[str, str] = {}
        self.router: ChildProcess | None = None
        self.url: str | None = None  # the router's base URL
        self.artifact: str | None = None  # the artifact the router runs with
        self.logs: Path | None = None  # the folder of the processes' logs
        self.watched: dict[str, Watched] = {}  # what supervise() keeps running, by name

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

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far per process name (engines, then the router)."""
        return {name: w.restarts for name, w in self.watched.items()}

    def start(self) -> str:
        """Start every engine, wait until each answers /health (``NotReady`` if one exits
        or the spec's ``ready_timeout`` passes: a first start that fails is a setup
        problem, reported at once), then the router; its URL."""
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
        self.chat_template = template
        pythonpath = plugin_pythonpath(self.workdir)
        cores = sorted(os.sched_getaffinity(0))
        roles = [f"prefill-{i}" for i in range(spec.num_prefill)] + \
                [f"decode-{k}" for k in range(spec.num_decode)]
        for n, name in enumerate(roles):
            port = free_port(spec.host)
            proc = ChildProcess(name, engine_command(spec, port, self.store, template,
                                                     decode=name.startswith("decode")),
                                engine_env(cores[n % len(cores)], pythonpath),
                                self.logs / f"{name}.log")
            proc.start()  # all engines start in parallel
            self.engines[name], self.engine_urls[name] = proc, f"http://{spec.host}:{port}"
            self.log(f"{name}: {self.engine_urls[name]} (pid {proc.pid}, log {proc.log_path})")
        self.artifact = self._artifact()
        deadline = time.monotonic() + spec.ready_timeout
        for name, proc in self.engines.items():
            proc.wait_ready(self.engine_urls[name] + "/health", deadline)
        now = self.clock()
        for name, proc in self.engines.items():
            self.watch(name, proc, self.engine_urls[name] + "/health", now)
        self._start_router(pythonpath)
        return self.url

    def watch(self, name: str, proc: ChildProcess, ready_url: str, now: float) -> Watched:
        """Hand a started, ready process to :meth:`supervise` (role from its name:
        ``prefill*``, ``decode*`` or ``router``)."""
        role = next((r for r in ("prefill", "decode", "router") if name.startswith(r)), None)
        if role is None:
            raise ValueError(f"{name!r}: not a prefill, decode or router process name")
        self.watched[name] = Watched(proc, role, ready_url, since=now)
        return self.watched[name]

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
        fit = [sys.executable, "-m", "eldr", "fit", trace, "--decoders", str(spec.num_decode),
               "-o", str(out)]
        if (Path(spec.model) / "tokenizer.json").is_file():  # the prompt predictor's
            fit += ["--tokenizer", str(Path(spec.model).absolute())]
        done = subprocess.run(fit,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ValueError(f"eldr fit {trace} failed: {done.stderr.strip()[-500:]}")
        self.log(f"artifact: fitted on {trace} for {spec.num_decode} decoders")
        return str(out)

    def _start_router(self, pythonpath: str) -> None:
        spec = self.spec
        port = spec.port or free_port(spec.host)
        cmd = router_command(spec, self.engine_urls, self.artifact, port,
                             getattr(self, "chat_template", None))
        self.router = ChildProcess("router", cmd, {**os.environ, "PYTHONPATH": pythonpath},
                                   self.logs / "router.log")
        self.router.start()
        self.url = f"http://{spec.host}:{port}"
        self.router.wait_ready(self.url + "/health", time.monotonic() + 60)
        self.watch("router", self.router, self.url + "/health", self.clock())
        self.log(f"router: {self.url} (pid {self.router.pid}, log {self.router.log_path})")

    # -- supervision ---------------------------------------------------------------------
    def supervise(self, now: float | None = None) -> str | None:
        """One supervision step at ``now`` (the clock's time); None while the cluster
        serves, else why it has to stop.

        A process that exited is restarted with the same command, port and core after
        the policy's back-off; a restarted one is polled (one short ``/health`` probe per
        step, never waited on, so one slow start holds up nothing else) until it answers
        or the spec's ``ready_timeout`` passes. The router takes a dead engine out of
        rotation through its own health checks and back once it answers. The cluster has
        to stop when the router is given up, or every engine of a role.
        """
        now = self.clock() if now is None else now
        policy = self.spec.restart
        for name, w in self.watched.items():
            if w.state == "up" and not w.proc.is_running():
                code = w.proc.returncode
                w.proc.stop(signal.SIGKILL, grace=5.0)  # what it left of its group
                if now - w.since >= policy.stable_after:
                    w.streak = 0
                self._schedule(name, w, now, _exit_words(code))
            elif w.state == "starting":
                if not w.proc.is_running():
                    code = w.proc.returncode
                    w.proc.stop(signal.SIGKILL, grace=5.0)
                    self._failed_start(name, w, now, f"{_exit_words(code)} before it was "
                                                     f"ready")
                elif w.ready(self.probe(w.ready_url)):
                    self.log(f"{name}: ready again {now - w.since:.0f} s after restart "
                             f"{w.restarts}")
                    w.state, w.since, w.failed_starts = "up", now, 0
                elif now - w.since >= self.spec.ready_timeout:
                    w.proc.stop(signal.SIGKILL, grace=5.0)
                    self._failed_start(name, w, now, f"not ready {self.spec.ready_timeout:g}"
                                                     f" s after restart {w.restarts}")
            elif w.state == "waiting" and now >= w.restart_at:
                w.proc.start()
                w.state, w.since = "starting", now
                self.log(f"{name}: restart {w.restarts} started (pid {w.proc.pid})")
        return self._stop_reason()

    def _schedule(self, name: str, w: Watched, now: float, why: str) -> None:
        w.streak += 1
        w.restarts += 1
        delay = self.spec.restart.delay(w.streak)
        w.state, w.restart_at = "waiting", now + delay
        who = f"{name} (eldr serve, eldr's own process)" if w.role == "router" else name
        self.log(f"{who} {why}: restart {w.restarts} in {delay:g} s (log {w.proc.log_path})")

    def _failed_start(self, name: str, w: Watched, now: float, why: str) -> None:
        w.failed_starts += 1
        limit = self.spec.restart.max_failed_starts
        if w.failed_starts < limit:
            self._schedule(name, w, now, f"{why} (failed start {w.failed_starts} of {limit})")
            return
        w.state = "given_up"
        self.log(f"{name} {why}: given up after {limit} failed starts in a row (log "
                 f"{w.proc.log_path})")

    def _stop_reason(self) -> str | None:
        router = self.watched.get("router")
        if router is not None and router.state == "given_up":
            return "the router failed to start again; given up"
        for role in ("prefill", "decode"):
            mine = [n for n, w in self.watched.items() if w.role == role]
            if mine and all(self.watched[n].state == "given_up" for n in mine):
                return f"no {role} engine left ({', '.join(mine)} given up)"
        return None

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
        """Stop the router, then every engine (by process group), log how often each was
        restarted, and remove the cluster's directory (logs, store, artifact)."""
        for proc in reversed(self.processes()):
            proc.stop()
        if self.watched:
            self.log("restarts: " + ", ".join(f"{n} {k}" for n, k in self.restarts.items()))
            self.watched.clear()
        self.router = None
        self.engines.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def _exit_words(code: int | None) -> str:
    """'exited with code 1', 'exited with code -9 (SIGKILL)'."""
    if code is not None and code < 0:
        try:
            return f"exited with code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited with code {code}"
