"""eldr.deploy: the cluster's spec, engine command lines, process groups, the connector
store's pruning and the KV connector's rule (its vLLM side only where vLLM is installed;
the real cluster: tests/e2e/test_clients_e2e.py)."""

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
