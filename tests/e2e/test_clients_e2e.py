"""End to end with clients nobody here wrote: the ``openai`` package and vLLM's own
benchmark client (``vllm.benchmarks.serve``), through a PD cluster started by
``eldr cluster`` (1 prefill + 1 decode vLLM-CPU engine of the tiny MoE, the capture plugin,
an artifact fitted on the shipped trace, ``eldr serve`` in front), each compared token for
token (greedy, seeded) with a plain vLLM instance of the same model.

Checks (issue 14):
- openai: completions and chat, JSON and streams with usage, equal to the plain
  instance; its errors raise the same exception classes; every stream read to ``[DONE]``
  counts as a completed request (no client disconnect);
- vllm bench serve without ``--model`` (it reads ``root`` off ``/v1/models`` and aligns its
  tokenizer through ``/tokenize``): the same generated texts, 0 failed requests; the
  figures of both runs are printed side by side;
- vLLM's auxiliary routes answer as the plain instance does;
- ``eldr cluster`` stops on SIGTERM with every process and its directory gone.

About 3 engines (≈ 9 GB of RAM) and 2–3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _engines import (
    MODEL_NAME,
    READY_TIMEOUT_S,
    _engine,
    _metric,
    _plugin_pythonpath,
    _request,
    _skip_reason,
)

from eldr.deploy.processes import parent_death_signal

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
PROMPTS = [
    "The history of the printing press begins in",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Les montagnes de la région sont couvertes de neige pendant",
    "A contract is void when one of the parties",
]


class Cluster:
    """``eldr cluster`` as a subprocess, and the plain reference instance beside it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc: subprocess.Popen | None = None
        self.out = tmp / "cluster.out"
        self.url: str | None = None  # the router
        self.reference: str | None = None
        self.pids: list[int] = []  # process group leaders eldr cluster started
        self.workdir: Path | None = None

    def lines(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            text = self.lines()
            m = re.search(r"^ready: (\S+)", text, re.M)
            if m:
                self.url = m.group(1)
                self.pids = [int(p) for p in re.findall(r"\(pid (\d+),", text)]
                self.workdir = Path(re.search(r"^workdir: (\S+)", text, re.M).group(1))
                return
            if self.proc.poll() is not None:
                pytest.fail(f"eldr cluster exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(1)
        pytest.fail(f"eldr cluster not ready in time:\n{self.lines()[-3000:]}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(timeout=30)
        self.proc = None
        return code


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("openai")
    tmp = tmp_path_factory.mktemp("clients_e2e")
    pythonpath = _plugin_pythonpath(tmp)
    reference, ref_url = _engine("reference", tmp, sorted(os.sched_getaffinity(0))[-1],
                                 kv=False, pythonpath=pythonpath)
    c = Cluster(tmp)
    log = open(c.out, "w")  # closed below
    try:
        reference.start()
        c.proc = subprocess.Popen(
            [sys.executable, "-m", "eldr", "cluster", "--prefill", "1", "--decode", "1",
             "--port", "0", "--log-dir", str(tmp / "logs")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=parent_death_signal(),  # a killed test run stops it (and its engines)
            env={**os.environ, "PYTHONPATH": pythonpath})
        deadline = time.monotonic() + READY_TIMEOUT_S
        reference.wait_ready(ref_url + "/health", deadline)
        c.wait_ready(deadline)
        c.reference = ref_url
        yield c
    finally:
        c.stop()
        reference.stop()
        log.close()


def _clients(c: Cluster):
    import openai

    return (openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0),
            openai.OpenAI(base_url=c.reference + "/v1", api_key="unused", max_retries=0))


def _streamed(stream, chat: bool) -> tuple[str, object]:
    text, usage = [], None
    for chunk in stream:
        for choice in chunk.choices:
            text.append((choice.delta.content or "") if chat else choice.text)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), usage


def test_openai_client_matches_a_plain_instance(cluster):
    router, plain = _clients(cluster)
    page0 = _request(cluster.url + "/metrics")[2].decode()
    checks = 0
    for prompt in PROMPTS:
        kw = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 7}
        ref = plain.completions.create(prompt=prompt, **kw)
        got = router.completions.create(prompt=prompt, **kw)
        assert got.choices[0].text == ref.choices[0].text
        assert got.usage.prompt_tokens == ref.usage.prompt_tokens
        assert got.usage.completion_tokens == ref.usage.completion_tokens
        text, usage = _streamed(router.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw), False)
        assert text == ref.choices[0].text
        assert (usage.prompt_tokens, usage.completion_tokens) == \
            (ref.usage.prompt_tokens, ref.usage.completion_tokens)
        messages = [{"role": "user", "content": prompt}]
        ref = plain.chat.completions.create(messages=messages, **kw)
        got = router.chat.completions.create(messages=messages, **kw)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.usage.prompt_tokens == ref.usage.prompt_tokens
        text, usage = _streamed(router.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kw), True)
        assert text == ref.choices[0].message.content
        assert usage.completion_tokens == ref.usage.completion_tokens
        checks += 4
    page1 = _request(cluster.url + "/metrics")[2].decode()
    # every stream was read to [DONE] and closed: completed, never a disconnect
    assert _metric(page1, "eldr_client_disconnects_total") == \
        _metric(page0, "eldr_client_disconnects_total")
    for endpoint in ("completions", "chat"):
        done = (_metric(page1, "eldr_requests_total", endpoint=endpoint, status="200")
                - _metric(page0, "eldr_requests_total", endpoint=endpoint, status="200"))
        assert done == 2 * len(PROMPTS)
    # the openai package's requests (httpx) are the common case the fast front answers
    # itself (eldr.proxy.front): none was handed to aiohttp
    front = (_metric(page1, "eldr_http_front_requests_total")
             - _metric(page0, "eldr_http_front_requests_total"))
    assert front == 4 * len(PROMPTS), page1
    print(f"openai client: {checks} comparisons equal to the plain instance, {front:.0f} "
          f"requests answered by the fast front")


@pytest.mark.parametrize("case", ["unknown_model", "negative_max_tokens", "over_context"])
def test_openai_errors_raise_the_same_exception_classes(cluster, case):
    import openai

    router, plain = _clients(cluster)
    kw = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
    if case == "unknown_model":
        kw["model"] = "no-such-model"
    elif case == "negative_max_tokens":
        kw["max_tokens"] = -5
    else:
        kw["max_tokens"] = 5000  # --max-model-len 1024
    raised = []
    for client in (plain, router):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(**kw)
        raised.append((type(info.value), info.value.status_code))
    assert raised[0] == raised[1]
    assert raised[0][0] in (openai.NotFoundError, openai.BadRequestError)


def _bench(base_url: str, result_dir: Path) -> dict:
    """vllm bench serve, driven from Python (the vllm console script is missing in
    vllm-cpu), without --model: it reads the first model's id and root off /v1/models."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
        "--num-prompts", "24", "--max-concurrency", "8", "--seed", "0", "--temperature", "0",
        "--ignore-eos", "--save-detailed", "--disable-tqdm", "--num-warmups", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--result-dir", str(result_dir)])
    return main(args)


def test_vllm_bench_serve_matches_a_plain_instance(cluster, capsys):
    plain = _bench(cluster.reference, cluster.tmp / "bench_plain")
    routed = _bench(cluster.url, cluster.tmp / "bench_router")
    assert routed["failed"] == plain["failed"] == 0
    assert routed["completed"] == plain["completed"] == 24
    assert routed["generated_texts"] == plain["generated_texts"]
    rows = [("request throughput (req/s)", "request_throughput", 2),
            ("output throughput (tok/s)", "output_throughput", 1),
            ("median TTFT (ms)", "median_ttft_ms", 1),
            ("median TPOT (ms)", "median_tpot_ms", 2),
            ("median E2E latency (ms)", "median_e2el_ms", 1),
            ("failed requests", "failed", 0)]
    with capsys.disabled():
        print("\n| vllm bench serve (24 prompts, 64 in / 16 out, concurrency 8) "
              "| plain instance | through eldr serve (1P1D) |\n|---|---|---|")
        for label, key, digits in rows:
            print(f"| {label} | {plain[key]:.{digits}f} | {routed[key]:.{digits}f} |")


def test_auxiliary_routes_answer_as_a_plain_instance(cluster):
    def call(base, path, body=None):
        status, _, raw = _request(base + path, body)
        return status, json.loads(raw)

    for path, body in [("/version", None), ("/tokenize", {"model": MODEL_NAME,
                                                          "prompt": PROMPTS[0]}),
                       ("/detokenize", {"model": MODEL_NAME, "tokens": [278, 76, 382]}),
                       ("/v1/no-such-route", None)]:
        assert call(cluster.url, path, body) == call(cluster.reference, path, body), path
    assert _request(cluster.url + "/ping")[0] == 200
    mine = call(cluster.url, "/v1/models")[1]["data"][0]
    ref = call(cluster.reference, "/v1/models")[1]["data"][0]
    volatile = ("created", "permission")
    assert {k: v for k, v in mine.items() if k not in volatile} == \
        {k: v for k, v in ref.items() if k not in volatile}
    assert set(mine) == set(ref) >= {"id", "root", "max_model_len", "permission"}


def test_cluster_stops_cleanly_on_sigterm(cluster):
    status, _, raw = _request(cluster.url + "/v1/completions", {
        "model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert status == 200, raw
    assert cluster.workdir.is_dir() and len(cluster.pids) == 3  # prefill, decode, router
    assert cluster.stop() == 0
    assert "stopped" in cluster.lines()
    for pid in cluster.pids:  # every process group it started is gone
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert not cluster.workdir.exists()  # connector store, artifact: removed
