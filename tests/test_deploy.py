"""eldr.deploy without vLLM: the cluster's spec, engine command lines, process groups and
the connector store's pruning (the real cluster: tests/e2e/test_clients_e2e.py)."""

import json
import os
import signal
import sys
import time

import pytest

from eldr.capture import tiny_moe_dir
from eldr.deploy import ChildProcess, ClusterSpec, LocalCluster, engine_command
from eldr.deploy.local import BLOCK_SIZE, has_chat_template, router_command


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
    assert kv == {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    assert cmd[-2:] == ["--seed", "1"]
    assert "--kv-transfer-config" not in engine_command(spec, 1, None, None)  # a plain one


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


def test_the_grafana_dashboard_charts_only_metrics_the_router_exports():
    """docs/grafana/eldr-router.json: valid JSON, every metric it queries is one of the
    router's families, and every family is on some panel."""
    import re
    from pathlib import Path
    from types import SimpleNamespace

    from eldr.proxy.metrics import RouterMetrics

    path = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "eldr-router.json"
    dash = json.loads(path.read_text())
    used = {re.sub(r"_(bucket|sum|count)$", "", name)
            for panel in dash["panels"] for target in panel["targets"]
            for name in re.findall(r"\beldr_[a-z_]+", target["expr"])}
    metrics = RouterMetrics(SimpleNamespace(prefill=[], decode=[]))
    exported = set(metrics.registry.names)
    assert used <= exported, used - exported
    assert exported <= used, exported - used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
