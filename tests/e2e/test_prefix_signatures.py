"""End to end: exact prefill signatures under vLLM's prefix caching (the engine's signature
cache, :mod:`eldr.capture.enginecache`).

One prefill engine (prefix caching on, 32-token blocks, a KV cache of only 32 blocks so
the test can churn it) and one decode engine of the shipped tiny MoE, both with
``ExampleConnector``, and ``eldr serve`` (default policy ``eldr_cost``, which reads every
payload) in front. A request with ``prompt_logprobs`` skips reading vLLM's prefix cache
(and the connector), so it is the cold reference of any prompt on the same engine.

Checks, in order, on the one deployment:
- the same long prompt twice, and prompts sharing a 200-token system prompt with different
  tails: the warm payloads (vLLM reports prefix-cache hits) equal the cold counts exactly
  and cover the whole prompt, and the first token is the cold one;
- through the router: ``eldr_partial_signatures_total`` stays 0, answers equal the
  prefill engine's own greedy tokens;
- after churning the KV cache (evictions, slots reused for other content): warm payloads
  are still exact, and a prompt whose blocks came back through the connector (no rows) is
  marked partial with counts that are a subset of the cold ones: never stale.

About 2–3 minutes on two busy cores (two engines start in parallel).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from _engines import _free_port, _model_dir, _plugin_pythonpath, _skip_reason

from eldr.deploy.local import connector_config
from eldr.deploy.processes import parent_death_signal

pytestmark = pytest.mark.e2e

READY_TIMEOUT_S = 420
BLOCK = 32  # vLLM-CPU's attention takes multiples of 32
NUM_BLOCKS = 32  # KV cache of the prefill engine: 31 usable blocks, 992 tokens
MODEL = "tiny"


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def _metric(page: str, name: str) -> float:
    """Sum of a metric's samples on a Prometheus page (0 when absent)."""
    return sum(float(line.split()[-1]) for line in page.splitlines()
               if line.startswith((f"{name}{{", f"{name} ")))


class _Proc:
    """A subprocess in its own session, stopped by its process group id."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path) -> None:
        self.name, self.log = name, log
        self._out = open(log, "w")  # closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=parent_death_signal())  # killed run: stops

    def wait_ready(self, url: str, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n"
                            f"{self.log.read_text(errors='replace')[-4000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} not ready:\n{self.log.read_text()[-4000:]}")
            time.sleep(1)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        self._out.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("prefix_sig")
    kv = connector_config(tmp / "kv")  # eldr cluster's connector (eldr.deploy.connector)
    pythonpath = _plugin_pythonpath(tmp)
    cores = sorted(os.sched_getaffinity(0))
    procs: dict[str, _Proc] = {}
    urls: dict[str, str] = {}
    try:
        for i, (name, extra) in enumerate([
                ("prefill", ["--num-gpu-blocks-override", str(NUM_BLOCKS)]), ("decode", [])]):
            port = _free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(_model_dir()), "--served-model-name", MODEL,
                   "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
                   "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
                   "--block-size", str(BLOCK), "--max-num-seqs", "8",
                   "--kv-transfer-config", json.dumps(kv), *extra]
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                   "VLLM_NO_USAGE_STATS": "1", "ELDR_CAPTURE": "prefill",
                   "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)]),
                   "PYTHONPATH": pythonpath}
            procs[name] = _Proc(name, cmd, env, tmp / f"{name}.log")
            urls[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        for name in ("prefill", "decode"):
            procs[name].wait_ready(urls[name] + "/health", deadline)
        port = _free_port()
        procs["router"] = _Proc("router", [
            sys.executable, "-m", "eldr", "serve", "--prefill", urls["prefill"],
            "--decode", urls["decode"], "--port", str(port), "--health-interval", "1"],
            dict(os.environ), tmp / "router.log")
        urls["router"] = f"http://127.0.0.1:{port}"
        procs["router"].wait_ready(urls["router"] + "/health", time.monotonic() + 60)
        yield urls, procs
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()
        shutil.rmtree(tmp / "kv", ignore_errors=True)  # the ExampleConnector never cleans up


# -- helpers ------------------------------------------------------------------------------------
_RNG = np.random.default_rng(15)


def _ids(n: int) -> list[int]:
    return _RNG.integers(5, 4000, size=n).tolist()


SYSTEM = _ids(200)  # 6.25 blocks shared by the chat-like prompts
LONG = _ids(300)


def _prefill(urls, ids, *, cold: bool = False) -> tuple[np.ndarray, int, str, int]:
    """(counts, tokens the payload covers, first token, prompt tokens) of one prefill leg;
    ``cold`` asks for prompt logprobs, which makes vLLM skip its prefix cache."""
    from eldr.capture.payload import decode_payload

    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    if cold:
        body["prompt_logprobs"] = 1
    doc = _post(urls["prefill"] + "/v1/completions", body)
    payload = doc["kv_transfer_params"]["eldr"]
    assert payload["v"] == 2
    got = decode_payload(payload, num_layers=payload["shape"][0],
                         num_experts=payload["shape"][1])
    return got.counts, got.tokens, doc["choices"][0]["text"], doc["usage"]["prompt_tokens"]


def _hits(urls) -> float:
    return _metric(_get(urls["prefill"] + "/metrics"), "vllm:prefix_cache_hits_total")


def _assert_exact_when_warm(urls, ids):
    """Send ``ids`` (its prefix already cached), then a cold reference: equal, whole."""
    hits = _hits(urls)
    warm = _prefill(urls, ids)
    assert _hits(urls) > hits, "no prefix-cache hit: the test would prove nothing"
    cold = _prefill(urls, ids, cold=True)
    np.testing.assert_array_equal(warm[0], cold[0])
    assert warm[1] == cold[1] == warm[3] == len(ids)  # tokens == the whole prompt
    assert warm[2] == cold[2]  # the engine's output is unchanged


# -- the tests (in order, on one deployment) ----------------------------------------------------
def test_engine_logs_say_the_plugin_and_cache_are_on(cluster):
    urls, procs = cluster
    _prefill(urls, _ids(40))  # the cache is made on the first rows
    log = procs["prefill"].log.read_text(errors="replace")
    assert "eldr capture plugin active" in log
    assert f"signature cache of {BLOCK}-token blocks on" in log
    line = next(x for x in log.splitlines() if "eldr signature cache:" in x)
    assert f"{NUM_BLOCKS} blocks" in line
    print(line)


def test_same_long_prompt_twice_is_exact(cluster):
    urls, _ = cluster
    first = _prefill(urls, LONG)
    assert first[1] == first[3] == len(LONG)
    _assert_exact_when_warm(urls, LONG)


def test_shared_system_prompt_with_different_tails_is_exact(cluster):
    urls, _ = cluster
    _prefill(urls, SYSTEM + _ids(30))
    for n in (37, 45, 56):  # tails ending inside a block and on a block boundary (256)
        _assert_exact_when_warm(urls, SYSTEM + _ids(n))


def test_router_sees_no_partial_signature_and_same_answers(cluster):
    urls, _ = cluster
    page = _get(urls["router"] + "/metrics")
    partial0 = _metric(page, "eldr_partial_signatures_total")
    # fresh prompts: LONG's blocks may have been evicted by now, and the connector would
    # load them back without rows (partial, as the last test shows)
    long2, system2 = _ids(250), _ids(160)
    prompts = [long2, long2, system2 + _ids(50), system2 + _ids(20)]
    for ids in prompts:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0}
        routed = _post(urls["router"] + "/v1/completions", body)
        direct = _post(urls["prefill"] + "/v1/completions", body)  # one engine, no PD
        assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    page = _get(urls["router"] + "/metrics")
    assert _metric(page, "eldr_partial_signatures_total") == partial0 == 0
    assert _metric(page, "eldr_signatures_total") >= len(prompts)
    assert _metric(page, "eldr_routing_fallbacks_total") == 0


def test_eviction_keeps_rows_exact_and_never_stale(cluster):
    urls, _ = cluster
    for _ in range(4):  # 4 x 9 new blocks > the 31 the cache holds: everything churns
        _prefill(urls, _ids(300))
    shared = _ids(160)  # computed into reused slots, then hit
    _prefill(urls, shared + _ids(33))
    _assert_exact_when_warm(urls, shared + _ids(41))
    # LONG's blocks were evicted, but the connector still stores its whole prompt: vLLM
    # loads them back without computing, so no row exists for them. The payload must say
    # so (fewer tokens) and hold a subset of the true counts, never another block's rows.
    counts, tokens, _, n = _prefill(urls, LONG)
    cold, cold_tokens, _, _ = _prefill(urls, LONG, cold=True)
    assert cold_tokens == n == len(LONG)
    assert tokens <= n and (counts <= cold).all()
    top_k = int(cold.sum(axis=1)[0]) // n
    assert (counts.sum(axis=1) == tokens * top_k).all()
    print(f"after eviction, a connector-loaded prompt: payload covers {tokens} of {n} "
          f"tokens")
