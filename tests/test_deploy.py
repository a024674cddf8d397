"""eldr.deploy: the cluster's spec, engine command lines, process groups, the connector
store's pruning, the supervision that restarts what exited (fake processes, an injected
clock) and the KV connector's rule (its vLLM side only where vLLM is installed; the real
cluster: tests/e2e/test_clients_e2e.py, tests/e2e/test_cluster_faults_e2e.py)."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from eldr.capture import tiny_moe_dir
from eldr.deploy import ChildProcess, ClusterSpec, LocalCluster, engine_command, local
from eldr.deploy.local import (
    BLOCK_SIZE,
    RestartPolicy,
    connector_config,
    has_chat_template,
    kv_prefix_tokens,
    router_command,
)


def _spec(**kw) -> ClusterSpec:
    return ClusterSpec(model=str(tiny_moe_dir()), **kw)


@pytest.mark.parametrize("kw, match", [
    ({"model": "/nonexistent"}, "config.json"),
    ({"num_prefill": 0}, "num_prefill"),
    ({"num_decode": 1.5}, "num_decode"),
    ({"port": 70000}, "port"),
    ({"artifact": "/nonexistent"}, "artifact"),
    ({"trace": "/nonexistent.npz"}, "trace"),
    ({"store_ttl": 0}, "store_ttl"),
    ({"max_model_len": 8}, "max_model_len"),
    ({"learn": __file__}, "not a directory"),
    ({"restart": 3}, "RestartPolicy"),
])
def test_bad_cluster_specs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        _spec(**kw) if "model" not in kw else ClusterSpec(**kw)


def test_engine_command_carries_the_pd_settings(tmp_path):
    spec = _spec(max_model_len=512, extra_engine_args=("--seed", "1"))
    cmd = engine_command(spec, 8123, tmp_path / "kv", tmp_path / "t.jinja")
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in cmd and "--no-enable-prefix-caching" in cmd
    assert cmd[cmd.index("--block-size") + 1] == str(BLOCK_SIZE) == "32"
    assert cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--chat-template") + 1] == str(tmp_path / "t.jinja")
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "EldrExampleConnector",
                  "kv_connector_module_path": "eldr.deploy.connector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    assert cmd[-2:] == ["--seed", "1"]
    assert "--kv-transfer-config" not in engine_command(spec, 1, None, None)  # a plain one


def test_decoders_may_run_another_layout_of_the_same_model(tmp_path):
    narrow = json.loads((tiny_moe_dir() / "config.json").read_text())
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps({**narrow, "moe_intermediate_size": 2048}))
    spec = _spec(decode_model=str(wide))
    prefill = engine_command(spec, 1, None, None)
    decode = engine_command(spec, 2, None, None, decode=True)
    assert prefill[prefill.index("--model") + 1] == str(tiny_moe_dir())
    assert decode[decode.index("--model") + 1] == str(wide)
    assert engine_command(_spec(), 2, None, None, decode=True)[
        prefill.index("--model") + 1] == str(tiny_moe_dir())  # no decode model: the model
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**narrow, "num_local_experts": 32,
                                                   "vocab_size": 1000}))
    with pytest.raises(ValueError, match="differs in vocab_size, num_local_experts"):
        _spec(decode_model=str(other))
    with pytest.raises(ValueError, match=r"no readable config\.json"):
        _spec(decode_model=str(tmp_path / "missing"))


def test_router_command_forwards_learn_and_serve_args(tmp_path):
    urls = {"prefill0": "http://p:1", "decode0": "http://d:1", "decode1": "http://d:2"}
    spec = _spec(learn=str(tmp_path / "learn"), serve_args=("--learn-min-requests", "80"))
    cmd = router_command(spec, urls, None, 9000)
    assert cmd[:4] == [sys.executable, "-m", "eldr", "serve"]
    assert cmd[cmd.index("--port") + 1] == "9000" and "--artifact" not in cmd
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--decode"] == \
        ["http://d:1", "http://d:2"]
    assert cmd[cmd.index("--learn") + 1] == str(tmp_path / "learn")
    assert cmd[-2:] == ["--learn-min-requests", "80"]
    # with --learn and neither --artifact nor --trace the router starts without one
    assert LocalCluster(spec)._artifact() is None
    plain = router_command(_spec(policy="jsq"), urls, "/art", 1)
    assert plain[plain.index("--artifact") + 1] == "/art" and "--learn" not in plain
    assert plain[plain.index("--policy") + 1] == "jsq"


def test_the_tiny_moe_needs_a_chat_template(tmp_path):
    assert not has_chat_template(tiny_moe_dir())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{x}}"}))
    assert has_chat_template(tmp_path)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_child_is_stopped_with_every_process_it_started(tmp_path, sig):
    # the child starts a grandchild that ignores SIGTERM, as an engine core might hang
    child = ChildProcess("c", ["sh", "-c", "(trap '' TERM; sleep 60) & sleep 60"],
                         dict(os.environ), tmp_path / "c.log")
    child.start()
    pgid = child.pid
    time.sleep(0.3)
    assert child.is_running() and _group_alive(pgid)
    child.stop(sig, grace=2.0)
    assert not _group_alive(pgid)
    child.stop()  # twice is fine


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_stops_when_its_parent_is_killed(tmp_path, sig):
    """``eldr cluster`` (or a test run) killed outright cannot stop its children; each
    child is in its own session, so nothing else reaches it: it stops on its own."""
    script = ("import os, sys, time\n"
              "from eldr.deploy import ChildProcess\n"
              "c = ChildProcess('c', ['sleep', '60'], dict(os.environ), sys.argv[1])\n"
              "c.start()\n"
              "print(c.pid, flush=True)\n"
              "time.sleep(60)\n")
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "c.log")],
                              stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(parent.stdout.readline())
        assert _group_alive(pid)
        parent.send_signal(sig)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(pid)
    finally:
        parent.kill()
        parent.wait()
        if pid is not None and _group_alive(pid):  # failed: not left behind by the test
            os.killpg(pid, signal.SIGKILL)


def test_the_parent_death_signal_is_asked_for_on_the_main_thread_only():
    """The kernel signals the child when the THREAD that started it exits: a child started
    from a worker thread would be killed with that thread, so none is asked for there."""
    import threading

    from eldr.deploy.processes import parent_death_signal

    assert callable(parent_death_signal()) == sys.platform.startswith("linux")
    got = []
    t = threading.Thread(target=lambda: got.append(parent_death_signal()))
    t.start()
    t.join()
    assert got == [None]


def test_the_store_keeps_fresh_entries_and_prunes_old_ones(tmp_path):
    cluster = LocalCluster(_spec(store_ttl=60))
    cluster.workdir = tmp_path
    store = cluster.store
    for name in ("old", "fresh"):
        (store / name).mkdir(parents=True)
        (store / name / "layer0.safetensors").write_bytes(b"x" * 10)
    now = time.time()
    os.utime(store / "old", (now - 120, now - 120))
    assert cluster.prune_store(now) == 1
    assert sorted(os.listdir(store)) == ["fresh"]
    cluster.workdir = None  # not ours to delete


def test_cluster_command_is_registered():
    from eldr.cli import build_parser

    args = build_parser().parse_args(["cluster", "--prefill", "2", "--decode", "3"])
    assert (args.prefill, args.decode, args.model) == (2, 3, "tiny")


@pytest.mark.parametrize("argv, match", [
    (["--decode-model", "wide:x"], "WIDTH must be an integer"),
    (["--model", "somewhere", "--decode-model", "wide:64"], "use it with --model tiny"),
])
def test_cluster_decode_model_wide_refusals(argv, match):
    from eldr.cli import build_parser
    from eldr.commands import cluster as command

    with pytest.raises(ValueError, match=match):
        command.run(build_parser().parse_args(["cluster", *argv]))


def test_the_grafana_dashboard_charts_only_metrics_the_router_exports():
    """docs/grafana/eldr-router.json: valid JSON, every metric it queries is one of the
    router's families (the selection API's included), and every family is on some panel."""
    import re
    from pathlib import Path
    from types import SimpleNamespace

    from eldr.proxy.metrics import RouterMetrics

    path = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "eldr-router.json"
    dash = json.loads(path.read_text())
    used = {re.sub(r"_(bucket|sum|count)$", "", name)
            for panel in dash["panels"] for target in panel["targets"]
            for name in re.findall(r"\beldr_[a-z_]+", target["expr"])}
    from eldr.proxy.selection import Selection

    metrics = RouterMetrics(SimpleNamespace(prefill=[], decode=[]))
    Selection(None, None, metrics)  # the selection API's families, on the same registry
    exported = set(metrics.registry.names)
    assert used <= exported, used - exported
    assert exported <= used, exported - used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# -- the KV connector: eldr's rule, and vLLM's ExampleConnector less its short-prompt bug -----
@pytest.mark.parametrize("n, block, expected", [
    (0, 32, 0), (1, 32, 0), (2, 32, 0), (31, 32, 0), (32, 32, 0),  # at most one block
    (33, 32, 32), (34, 32, 32), (64, 32, 32), (65, 32, 64), (1000, 32, 992),
    (1, 1, 0), (2, 1, 1), (5, 4, 4), (9, 4, 8),
])
def test_the_connector_moves_whole_blocks_and_leaves_a_token_to_compute(n, block, expected):
    assert kv_prefix_tokens(n, block) == expected


def test_the_connector_prefix_rule_holds_for_every_length():
    for block in (1, 16, 32, 128):
        for n in range(1, 4 * block + 3):
            p = kv_prefix_tokens(n, block)
            # whole blocks, shorter than the prompt, and no whole block left out
            assert p % block == 0 and 0 <= p < n and n - p <= block
    for bad in (0, -32, 1.5):
        with pytest.raises(ValueError, match="block_size"):
            kv_prefix_tokens(40, bad)


def test_engines_load_eldrs_connector_by_module_path(tmp_path):
    kv = connector_config(tmp_path / "kv")
    assert kv["kv_connector_module_path"] == "eldr.deploy.connector"
    assert kv["kv_role"] == "kv_both"
    # the module path names an importable module of this package (vLLM imports it)
    import importlib.util

    assert importlib.util.find_spec(kv["kv_connector_module_path"]) is not None
    assert "import vllm" not in Path(local.__file__).read_text()  # only connector.py does


def _connectors(tmp_path):
    """eldr's and vLLM's stock connector on one store, without a vLLM engine: only the
    fields the scheduler side reads (``__init__`` wants a whole VllmConfig)."""
    pytest.importorskip("vllm")
    pytest.importorskip("torch")
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
    )

    from eldr.deploy.connector import EldrExampleConnector

    out = []
    for cls in (EldrExampleConnector, ExampleConnector):
        conn = object.__new__(cls)
        conn._block_size, conn._storage_path = BLOCK_SIZE, str(tmp_path)
        conn._requests_need_load = {}
        out.append(conn)
    return out


def _request(ids, rid="r"):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=rid, prompt_token_ids=list(ids), mm_features=[])


def _store(conn, ids):
    """Mark ``ids`` stored, as the connector's save does (a folder named by their hash)."""
    import torch

    conn._generate_foldername_debug(torch.tensor(list(ids)), [], create_folder=True)


def test_a_one_token_prompt_matches_nothing_where_vllms_connector_matches_minus_a_block(
        tmp_path):
    ours, stock = _connectors(tmp_path)
    _store(ours, [])  # what any prompt of at most one block left in vLLM's store
    one = _request([17])
    assert stock.get_num_new_matched_tokens(one, 0) == (-BLOCK_SIZE, False)  # the bug
    assert ours.get_num_new_matched_tokens(one, 0) == (0, False)
    for n in (2, 31, 32):
        assert ours.get_num_new_matched_tokens(_request(range(n)), 0) == (0, False)


def test_a_long_prompt_matches_the_prefix_its_save_stored(tmp_path):
    ours, stock = _connectors(tmp_path)
    ids = list(range(100, 165))  # 65 tokens: stored as its first 64
    assert ours.get_num_new_matched_tokens(_request(ids), 0) == (0, False)  # nothing yet
    _store(ours, ids[:64])
    assert ours.get_num_new_matched_tokens(_request(ids), 0) == (64, False)
    assert ours.get_num_new_matched_tokens(_request(ids), 32) == (32, False)  # rest only
    assert ours.get_num_new_matched_tokens(_request(ids), 64) == (0, False)
    # vLLM's own looks for a 32-token key it never stored for this prompt
    assert stock.get_num_new_matched_tokens(_request(ids), 0) == (0, False)
    forty = ids[:40]
    assert ours.get_num_new_matched_tokens(_request(forty), 0) == (0, False)
    _store(ours, forty[:32])
    assert ours.get_num_new_matched_tokens(_request(forty), 0) == (32, False)


def _step(*prompts):
    """A scheduler step that schedules ``prompts`` as new requests (fields the stock
    ``build_connector_meta`` reads)."""
    from types import SimpleNamespace

    new = [SimpleNamespace(req_id=f"r{i}", prompt_token_ids=list(ids), mm_features=[],
                           block_ids=(list(range(len(ids) // BLOCK_SIZE + 1)),))
           for i, ids in enumerate(prompts)]
    return SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[],
                                                                 resumed_req_ids=set()))


def test_prompts_of_at_most_one_block_are_not_stored(tmp_path):
    ours, stock = _connectors(tmp_path)
    short, long = [5], list(range(40))
    stored = stock.build_connector_meta(_step(short, long)).requests
    assert [len(r.token_ids) for r in stored] == [0, 32]  # vLLM's: 0 tokens, one shared key
    meta = ours.build_connector_meta(_step(short, long, list(range(32))))
    assert [(len(r.token_ids), r.is_store) for r in meta.requests] == [(32, True)]
    assert meta.requests[0].token_ids.tolist() == long[:32]
    # a request that matched is loaded, with the tokens it matched
    _store(ours, long[:32])
    req = _request(long, rid="r0")
    matched, _ = ours.get_num_new_matched_tokens(req, 0)
    ours.update_state_after_alloc(req, None, matched)
    meta = ours.build_connector_meta(_step(long))
    assert [(len(r.token_ids), r.is_store) for r in meta.requests] == [(32, False)]


# -- supervision: restarts, back-off, giving up ------------------------------------------------
class _FakeChild:
    """A ChildProcess stand-in: exits when told, counts starts and stops."""

    def __init__(self, name: str) -> None:
        self.name, self.log_path, self.pid = name, Path(f"{name}.log"), 100
        self.running, self.code, self.starts, self.stops = True, None, 0, []

    def is_running(self) -> bool:
        return self.running

    @property
    def returncode(self):
        return None if self.running else self.code

    def exit(self, code: int) -> None:
        self.running, self.code = False, code

    def start(self) -> None:
        self.starts, self.running, self.code, self.pid = self.starts + 1, True, None, self.pid + 1

    def stop(self, sig=signal.SIGTERM, grace=30.0) -> None:
        self.stops.append(sig)
        self.running, self.code = False, None


class _Rig:
    """A cluster of fakes: prefill-0, decode-0, decode-1 and the router, all up at t=0;
    ``status[name]`` is what a readiness probe of that process answers."""

    NAMES = ("prefill-0", "decode-0", "decode-1", "router")

    def __init__(self, **policy) -> None:
        self.lines: list[str] = []
        self.status = dict.fromkeys(self.NAMES, 200)
        self.probes: list[str] = []
        spec = _spec(ready_timeout=100, restart=RestartPolicy(**policy))
        self.cluster = LocalCluster(spec, log=self.lines.append, probe=self._probe)
        self.procs = {name: _FakeChild(name) for name in self.NAMES}
        for name, proc in self.procs.items():
            self.cluster.watch(name, proc, f"http://{name}/health", 0.0)

    def _probe(self, url: str):
        name = url.split("/")[2]
        self.probes.append(name)
        return self.status[name]

    def state(self, name: str) -> str:
        return self.cluster.watched[name].state


def test_an_engine_that_exits_is_restarted_and_polled_until_ready():
    rig = _Rig()
    c, victim = rig.cluster, rig.procs["decode-1"]
    assert c.supervise(1.0) is None and rig.probes == []  # all up: nobody probed
    victim.exit(-9)
    assert c.supervise(5.0) is None
    assert victim.stops == [signal.SIGKILL]  # its engine core, if any, goes too
    assert rig.lines[-1] == ("decode-1 exited with code -9 (SIGKILL): restart 1 in 1 s "
                             "(log decode-1.log)")
    assert c.supervise(5.5) is None and victim.starts == 0  # backing off
    assert c.supervise(6.0) is None and victim.starts == 1
    assert rig.state("decode-1") == "starting"
    rig.status["decode-1"] = None  # loading its weights
    for t in (7.0, 8.0, 9.0):
        assert c.supervise(t) is None
    assert rig.probes == ["decode-1"] * 3  # one short probe per step, nothing waited on
    rig.status["decode-1"] = 200
    assert c.supervise(10.0) is None and rig.state("decode-1") == "up"
    assert rig.lines[-1] == "decode-1: ready again 4 s after restart 1"
    assert c.restarts == {"prefill-0": 0, "decode-0": 0, "decode-1": 1, "router": 0}
    assert [p.starts for p in rig.procs.values()] == [0, 0, 1, 0]


def test_restarts_back_off_exponentially_up_to_a_bound_and_start_over_when_stable():
    rig = _Rig(first_delay=1.0, max_delay=30.0, stable_after=60.0)
    c, proc = rig.cluster, rig.procs["prefill-0"]
    t, delays = 0.0, []
    for _ in range(7):  # dies right after every start
        proc.exit(1)
        c.supervise(t)
        delays.append(c.watched["prefill-0"].restart_at - t)
        t = c.watched["prefill-0"].restart_at
        c.supervise(t)  # started
        t += 1.0
        c.supervise(t)  # ready (probe 200)
        assert rig.state("prefill-0") == "up"
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    t += 60.0  # then it runs a minute
    proc.exit(1)
    c.supervise(t)
    assert c.watched["prefill-0"].restart_at - t == 1.0
    assert c.restarts["prefill-0"] == 8


def test_an_engine_that_fails_three_starts_in_a_row_is_given_up():
    rig = _Rig()
    c = rig.cluster
    rig.procs["decode-0"].exit(1)
    c.supervise(0.0)
    t = 1.0
    c.supervise(t)  # start 1
    rig.status["decode-0"] = None  # never answers
    assert c.supervise(t + 99.0) is None and rig.state("decode-0") == "starting"
    assert c.supervise(t + 100.0) is None  # not ready in ready_timeout: failed start 1
    assert rig.procs["decode-0"].stops[-1] == signal.SIGKILL
    assert "not ready 100 s after restart 1 (failed start 1 of 3): restart 2 in 2 s" in \
        rig.lines[-1]
    t += 102.0
    c.supervise(t)  # start 2
    rig.procs["decode-0"].exit(1)  # dies while loading
    assert c.supervise(t + 1.0) is None
    assert "exited with code 1 before it was ready (failed start 2 of 3)" in rig.lines[-1]
    t += 5.0
    c.supervise(t)  # start 3
    rig.procs["decode-0"].exit(1)
    # the other decoder still serves: the cluster goes on without decode-0
    assert c.supervise(t + 1.0) is None and rig.state("decode-0") == "given_up"
    assert "given up after 3 failed starts in a row" in rig.lines[-1]
    starts = rig.procs["decode-0"].starts
    assert c.supervise(t + 1000.0) is None and rig.procs["decode-0"].starts == starts
    assert c.restarts["decode-0"] == 3


def _give_up(rig: _Rig, name: str, t: float) -> float:
    """Make ``name`` fail every start until it is given up; the time after."""
    rig.status[name] = None
    rig.procs[name].exit(1)
    while rig.state(name) != "given_up":
        t += 1.0
        if rig.cluster.supervise(t) is not None:
            break
        if rig.procs[name].is_running():
            rig.procs[name].exit(1)
    return t


def test_the_cluster_stops_when_a_role_has_no_engine_left():
    rig = _Rig()
    t = _give_up(rig, "decode-0", 0.0)
    assert rig.state("decode-0") == "given_up" and rig.cluster.supervise(t) is None
    t = _give_up(rig, "decode-1", t)
    assert rig.cluster.supervise(t) == "no decode engine left (decode-0, decode-1 given up)"
    rig = _Rig()
    t = _give_up(rig, "prefill-0", 0.0)
    assert rig.cluster.supervise(t) == "no prefill engine left (prefill-0 given up)"


def test_the_router_is_restarted_too_and_ready_while_it_sees_no_engine():
    rig = _Rig()
    c = rig.cluster
    rig.procs["router"].exit(1)
    assert c.supervise(3.0) is None
    assert rig.lines[-1].startswith("router (eldr serve, eldr's own process) exited with "
                                    "code 1: restart 1 in 1 s")
    c.supervise(4.0)
    rig.status["router"] = 503  # it answers; the engines' health is its own business
    assert c.supervise(5.0) is None and rig.state("router") == "up"
    t = _give_up(rig, "router", 100.0)
    assert c.supervise(t) == "the router failed to start again; given up"


def test_a_slow_start_holds_up_no_other_restart():
    rig = _Rig()
    c = rig.cluster
    rig.status["decode-1"] = None
    rig.procs["decode-1"].exit(-9)
    c.supervise(0.0)
    c.supervise(1.0)  # decode-1 starting, not answering
    rig.procs["prefill-0"].exit(-9)
    c.supervise(2.0)  # scheduled
    c.supervise(3.0)  # started
    c.supervise(4.0)  # answered
    assert rig.procs["prefill-0"].starts == 1 and rig.state("prefill-0") == "up"
    assert rig.state("decode-1") == "starting"


def test_stop_reports_the_restart_counts():
    rig = _Rig()
    rig.procs["decode-1"].exit(-9)
    rig.cluster.supervise(0.0)
    rig.cluster.stop()
    assert rig.lines[-1] == "restarts: prefill-0 0, decode-0 0, decode-1 1, router 0"
    assert rig.cluster.watched == {}
    rig.cluster.stop()  # twice is fine, and says nothing more
    assert rig.lines[-1].startswith("restarts:") and len(rig.lines) == 2


def test_a_real_child_killed_with_its_group_is_restarted(tmp_path):
    lines = []
    spec = _spec(restart=RestartPolicy(first_delay=0.1))
    cluster = LocalCluster(spec, log=lines.append, probe=lambda url: 200)
    child = ChildProcess("decode-0", ["sh", "-c", "sleep 60 & sleep 60"], dict(os.environ),
                         tmp_path / "d.log")
    child.start()
    try:
        cluster.watch("decode-0", child, "http://unused/health", time.monotonic())
        first = child.pid
        os.killpg(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while cluster.restarts["decode-0"] == 0 or cluster.watched["decode-0"].state != "up":
            assert time.monotonic() < deadline, lines
            assert cluster.supervise(time.monotonic()) is None
            time.sleep(0.05)
        assert child.is_running() and child.pid != first and not _group_alive(first)
        assert "exited with code -9 (SIGKILL): restart 1 in 0.1 s" in lines[0]
    finally:
        child.stop(grace=2.0)


def test_eldr_cluster_stops_with_exit_code_1_when_the_cluster_cannot_go_on(monkeypatch,
                                                                           capsys):
    import eldr.commands.cluster as command
    from eldr.cli import build_parser

    steps = iter([None, None, "no decode engine left (decode-0 given up)"])

    class Cluster:
        logs, stopped = Path("logs"), False

        def __init__(self, spec, log):
            self.log = log

        def start(self):
            return "http://127.0.0.1:1"

        def supervise(self, now):
            return next(steps)

        def prune_store(self):
            return 0

        def stop(self):
            Cluster.stopped = True

    monkeypatch.setattr(local, "LocalCluster", Cluster)
    monkeypatch.setattr(command.time, "sleep", lambda s: None)
    args = build_parser().parse_args(["cluster", "--port", "0"])
    assert command.run(args) == 1 and Cluster.stopped
    err = capsys.readouterr().err
    assert "error: no decode engine left (decode-0 given up); stopping" in err


def test_router_command_gives_the_router_the_tokenizer_and_chat_template(tmp_path):
    urls = {"prefill0": "http://p:1", "decode0": "http://d:1"}
    template = tmp_path / "chat_template.jinja"
    cmd = router_command(_spec(), urls, "/art", 1, template)
    assert cmd[cmd.index("--tokenizer") + 1] == str(Path(tiny_moe_dir()).absolute())
    assert cmd[cmd.index("--chat-template") + 1] == str(template)
    # the operator's own choice wins, and nothing is passed twice
    own = router_command(_spec(serve_args=("--tokenizer", "/mine")), urls, "/art", 1, None)
    assert own.count("--tokenizer") == 1 and own[-1] == "/mine"
    assert "--chat-template" not in own
    # a model folder without tokenizer.json: no --tokenizer
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((Path(tiny_moe_dir()) / "config.json").read_bytes())
    assert "--tokenizer" not in router_command(ClusterSpec(model=str(bare)), urls, None, 1)
