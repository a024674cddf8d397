"""The Ray Serve PD app (eldr.integrations.ray.app): its arguments, Ray's version, and the
whole app on a local Ray with stand-in engines (no vLLM).

The stand-in engines (tests/_ray_standin_engine.py) are processes the engine replicas
start instead of vLLM: their prefill answers carry the eldr payload of the prompt's
expert counts ("code" prompts experts 0-3, others 4-7), and the artifact is fitted on a
trace of exactly those two families, so each family has its decoder. The Serve test runs on
a Ray cluster of two nodes on this machine (decoders on the worker node, prefill and two
ingress replicas on the head) and checks that the decoders are placed there, that the
decoder each request got is the one the artifact names for its payload, with the two
ingress replicas sharing one table, that every reservation is released, and that a
decode engine killed before its first byte is retried on the other decoder.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from _proxy_fakes import TOP_K, E, L, domain_counts
from eldr.integrations.ray import check_ray_version, parse_args
from eldr.integrations.ray.engine import EngineSpec, engine_argv

HERE = Path(__file__).resolve().parent


def _model(tmp_path) -> str:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


def _args(model: str, *, decode_replicas: int = 2, store: str = "/tmp/kv", **eldr) -> dict:
    def conf(n: int) -> dict:
        return {"model_loading_config": {"model_id": "tiny", "model_source": model},
                "deployment_config": {"num_replicas": n},
                "engine_kwargs": {"max_model_len": 512, "dtype": "float32",
                                  "kv_transfer_config": {
                                      "kv_connector": "EldrExampleConnector",
                                      "kv_connector_extra_config": {
                                          "shared_storage_path": store}}}}
    return {"prefill_config": conf(1), "decode_config": conf(decode_replicas),
            "eldr": {"policy": "jsq", **eldr}}


# -- arguments ------------------------------------------------------------------------------
def test_args_shaped_like_ray_pd_builder_become_engine_specs(tmp_path):
    model = _model(tmp_path)
    args = _args(model)
    args["decode_config"]["engine_kwargs"]["max_num_batched_tokens"] = 4096
    args["decode_config"]["runtime_env"] = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "2"}}
    conf = parse_args(args)
    assert conf.model_id == "tiny" and conf.table.num_decode == 2
    assert conf.decode.store == conf.prefill.store == "/tmp/kv"
    assert conf.decode.max_model_len == 512
    assert conf.decode.env == (("VLLM_CPU_KVCACHE_SPACE", "2"),)
    assert conf.decode_deployment["num_replicas"] == 2
    argv = engine_argv(conf.decode, 8123)
    # eldr cluster's engine: eldr's CPU connector on the shared store, 32-token blocks
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "EldrExampleConnector" in argv[argv.index("--kv-transfer-config") + 1]
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[-2:] == ["--max-num-batched-tokens", "4096"]
    stand_in = EngineSpec(role="decode", model="x", command=("serve", "--port", "{port}"))
    assert engine_argv(stand_in, 9) == ["serve", "--port", "9"]
    assert conf.relay.stream_write_timeout == 60.0
    args["eldr"]["stream_write_timeout"] = 5
    assert parse_args(args).relay.stream_write_timeout == 5.0
    assert conf.table.cost_layer_stride == 1  # eldr_cost prices every layer unless asked
    args["eldr"]["cost_layer_stride"] = 3
    assert parse_args(args).table.cost_layer_stride == 3


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("decode_config"), "decode_config is required"),
    (lambda a: a.update(extra=1), "unknown args"),
    (lambda a: a["eldr"].update(colour="red"), "unknown eldr settings"),
    (lambda a: a["decode_config"].update(eldr_engine={"colour": 1}), "eldr_engine: unknown"),
    (lambda a: a["decode_config"]["deployment_config"].update(num_replicas=0), "num_replicas"),
    (lambda a: a["decode_config"]["engine_kwargs"].update(enforce_eager=False), "enforce_eager"),
    (lambda a: a["decode_config"]["engine_kwargs"].update(
        kv_transfer_config={"kv_connector": "NixlConnector"}), "only eldr's CPU connector"),
    (lambda a: a["decode_config"]["model_loading_config"].update(model_id="other"),
     "different model ids"),
    (lambda a: a["eldr"].update(artifact="/nonexistent/artifact"), "not a directory"),
    (lambda a: a["eldr"].update(stream_write_timeout=0), "stream_write_timeout must be > 0"),
    (lambda a: a["eldr"].update(cost_layer_stride=0), "cost_layer_stride"),
    (lambda a: a["decode_config"]["model_loading_config"].update(model_source="/nonexistent"),
     "no config.json"),
])
def test_bad_args_are_clear_errors(tmp_path, change, message):
    args = _args(_model(tmp_path))
    change(args)
    with pytest.raises(ValueError, match=message):
        parse_args(args)


def test_a_ray_outside_the_tested_range_is_refused_or_warned():
    assert check_ray_version("2.60.0") == "2.60.0"
    assert check_ray_version("2.60.3") == "2.60.3"
    for version in ("2.59.1", "2.61.0", "3.0.0"):
        with pytest.raises(RuntimeError, match=r"tested with Ray >= 2\.60\.0, < 2\.61\.0"):
            check_ray_version(version)
    with pytest.warns(UserWarning, match=r"2\.61\.0"):
        assert check_ray_version("2.61.0", allow_untested=True) == "2.61.0"


# -- the app on Ray, stand-in engines --------------------------------------------------------
def _families_artifact(tmp_path) -> Path:
    """An artifact of the stand-ins' model (L, E, k) fitted on the two prompt families."""
    from eldr.fit import artifact
    from eldr.traces.trace import Trace, TraceMeta

    R = 40
    dom = np.arange(R) % 2
    lens = 2 + np.arange(R) % 3
    counts = np.zeros((R, L, E), dtype=np.int32)  # n tokens, each choosing its 4 experts
    for r in range(R):
        counts[r, :, 4 * dom[r]:4 * dom[r] + 4] = lens[r]
    trace = Trace(meta=TraceMeta("standin", L, E, TOP_K, source="test"),
                  prefill_counts=counts, decode_counts=counts,
                  prompt_lens=lens.astype(np.int64), output_lens=lens.astype(np.int64) + 1,
                  domains=dom.astype(np.int32), domain_names=("code", "law"))
    fitted = artifact.fit_artifact(trace, worker_ids=["d0", "d1"], tau=0.0, n_init=1,
                                   random_state=0, prompt_predictor=False)
    return artifact.save(fitted, tmp_path / "artifact")


def _expected(art_dir: Path, prompt: str) -> str:
    from eldr.fit import artifact

    art = artifact.load(art_dir)
    sims = np.asarray(art.centroids) @ art.encoder.transform(domain_counts(prompt))
    return str(art.worker_ids[int(np.argmax(sims))])


def _post(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _table(base: str) -> dict:
    with urllib.request.urlopen(base + "/eldr/table", timeout=30) as r:
        return json.loads(r.read())


def _settled(base: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = _table(base)
        if snap["held"] == 0 or time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


def _leave_mid_stream(base: str, prompt: str) -> None:
    """Open a streamed completion, read its first event, check it holds its decoder, and
    close the connection."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": prompt, "max_tokens": 200, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert b"data: " in resp.fp.readline() + resp.fp.readline()
    assert _table(base)["held"] == 1
    conn.sock.shutdown(2)
    conn.close()


@pytest.mark.slow
def test_the_app_on_two_ray_nodes_routes_on_the_payload_and_releases_everything(tmp_path):
    from _ray_serve import two_node_serve

    art = _families_artifact(tmp_path)
    args = _args(_model(tmp_path), store=str(tmp_path / "kv"), policy="eldr",
                 artifact=str(art), tau=0.0)
    for role in ("prefill_config", "decode_config"):
        args[role]["eldr_engine"] = {"command": [sys.executable,
                                                 str(HERE / "_ray_standin_engine.py"),
                                                 "{port}", role.split("_")[0]],
                                     "ready_timeout": 60}
        args[role]["deployment_config"]["health_check_period_s"] = 3.0
    # decoders on the worker node; prefill and ingress on the head
    args["decode_config"]["deployment_config"]["ray_actor_options"] = {
        "resources": {"eldr_worker": 1}}
    args["prefill_config"]["deployment_config"]["ray_actor_options"] = {
        "resources": {"eldr_head": 1}}
    args["ingress_deployment_config"] = {"num_replicas": 2,
                                         "ray_actor_options": {"resources": {"eldr_head": 1}}}
    with two_node_serve() as (base, head, worker):
        from ray import serve

        from eldr.integrations.ray import build_eldr_pd_app

        t0 = time.monotonic()
        serve.run(build_eldr_pd_app(args), name="eldr", route_prefix="/")
        deadline = time.monotonic() + 60
        while not all(d["healthy"] for d in _table(base)["decoders"]):
            assert time.monotonic() < deadline, _table(base)
            time.sleep(0.2)
        print(f"app ready in {time.monotonic() - t0:.1f} s")
        snap = _table(base)
        assert [d["node"] for d in snap["decoders"]] == [worker, worker]
        assert [p["node"] for p in snap["prefills"]] == [head]
        prompts = ["code: a quicksort", "the law of contracts", "more code", "a legal brief"]
        for stream in (False, True):
            for prompt in prompts:
                status, hdr, raw = _post(base + "/v1/completions", {
                    "model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": stream})
                assert status == 200, raw
                assert hdr["X-Eldr-Decoder"] == _expected(art, prompt), (prompt, hdr)
                assert hdr["X-Eldr-Input"] == "payload"
                assert b"decode-tok2" in raw  # the decoder's own tokens, relayed
        status, hdr, raw = _post(base + "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "code"}],
            "max_tokens": 3})
        assert status == 200 and hdr["X-Eldr-Decoder"] == _expected(art, "code")
        snap = _settled(base)
        assert snap["held"] == 0 and [d["load"] for d in snap["decoders"]] == [0.0, 0.0]
        assert snap["counters"]["reservations:completed"] == 9
        assert len({d["replica"] for d in snap["decoders"]}) == 2

        # a client that leaves mid-stream: Serve cancels the ingress, which releases
        _leave_mid_stream(base, "code, slowly")
        # Serve's cancellation reaches the ingress through the proxy and the replica's
        # event loop: seconds when the machine is busy (it took over 10 s in runs beside
        # vLLM engines on this 2-core machine), well under a second when idle
        deadline = time.monotonic() + 45
        while _table(base)["counters"].get("reservations:cancelled", 0) != 1:
            assert time.monotonic() < deadline, _table(base)
            time.sleep(0.1)
        snap = _settled(base)
        assert snap["held"] == 0 and [d["load"] for d in snap["decoders"]] == [0.0, 0.0]

        # a decode engine killed before its first byte: retried on the other decoder
        victim_name = _expected(art, "code")
        victim = next(d for d in snap["decoders"] if d["name"] == victim_name)
        os.killpg(victim["pid"], signal.SIGKILL)
        status, hdr, raw = _post(base + "/v1/completions", {
            "model": "tiny", "prompt": "code after the kill", "max_tokens": 3})
        assert status == 200, raw
        assert hdr["X-Eldr-Decoder"] != victim_name and hdr["X-Eldr-Attempts"] == "2"
        snap = _settled(base)
        assert snap["held"] == 0 and snap["counters"]["reservations:failed"] == 1
        assert snap["counters"]["reservations:completed"] == 10
        # Serve replaces the dead replica; the new one takes the dead one's slot
        deadline = time.monotonic() + 60
        while True:
            decoders = {d["name"]: d for d in _table(base)["decoders"]}
            if decoders[victim_name]["healthy"] and \
                    decoders[victim_name]["replica"] != victim["replica"]:
                break
            assert time.monotonic() < deadline, decoders
            time.sleep(0.5)
        status, hdr, raw = _post(base + "/v1/completions", {
            "model": "tiny", "prompt": "code once more", "max_tokens": 3})
        assert status == 200 and hdr["X-Eldr-Decoder"] == victim_name
        serve.delete("eldr")
