"""End to end: one bad request, or one dying engine, does not take ``eldr cluster`` down.

One ``eldr cluster --prefill 1 --decode 2`` (a subprocess, as an operator runs it: the tiny
MoE, eldr's KV connector, ``eldr serve`` in front) and one plain vLLM instance of the same
model (no connector) as the reference, for the whole module.

Checks (issue "One bad request must not take down the cluster"):
- prompts of 1, 2 and 31 tokens (token ids; short texts for chat), completions and chat,
  JSON and SSE, answer 200 with the plain instance's greedy text: vLLM's ExampleConnector
  killed every engine that saw a one-token prompt (docs/failures.md). Through the
  cluster's router (which may serve short prompts whole on a decoder) and through a
  second router in front of the same engines that always disaggregates
  (``--short-prompt-tokens 0``, where ``eldr serve`` has that option): prefill, KV store
  and decode of a one-token prompt; then ~100-token prompts still flow;
- SIGKILL to one decoder's process group with 8 requests in flight: each completes 200
  or ends with a clear JSON error (no hang, no traceback, never "poison": one death is
  not a poison request), ``eldr cluster`` logs the restart, the router's /health shows the
  decoder healthy again, traffic reaches it again, and stopping reports the restart.

About 4 engines (≈ 12 GB of RAM) and 4–6 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _engines import (
    MODEL_NAME,
    READY_TIMEOUT_S,
    ClusterProcess,
    _engine,
    _free_port,
    _plugin_pythonpath,
    _Proc,
    _request,
    _skip_reason,
    _text,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8  # the short-prompt answers
LONG_TOKENS = 64  # the requests in flight when a decoder dies
RESTART_TIMEOUT_S = 300  # eldr cluster --ready-timeout: a restarted engine's readiness
SOURCE = (  # written for this test; tokenized by the reference for exact-length prompts
    "The harbour town wakes before dawn. Fishing boats return with the night's catch, "
    "gulls circle the masts, and the market opens its shutters one by one. By seven the "
    "bakers have sold their first loaves, the ferry to the islands sounds its horn, and "
    "children walk along the sea wall to the school behind the church. In winter the "
    "storms close the harbour for days; the old men mend nets in the boat sheds and talk "
    "about the great flood of their childhood, when the water reached the steps of the "
    "town hall and the mayor rowed to work. Summer brings visitors, sailing races and "
    "long evenings on the terraces, where the fish soup is served with bread and garlic "
    "and the talk turns to the weather, the prices and the new road to the city.")


class Setup:
    def __init__(self, cluster: ClusterProcess, reference: str, ids: list[int],
                 pd_router: str | None) -> None:
        self.cluster, self.reference, self.ids = cluster, reference, ids
        self.pd_router = pd_router  # a router that disaggregates every prompt, or None

    @property
    def url(self) -> str:
        return self.cluster.url

    def routers(self) -> list[str]:
        return [self.url, *([self.pd_router] if self.pd_router else [])]


def _always_disaggregating_router(cluster: ClusterProcess, tmp, procs: dict) -> str | None:
    """A second ``eldr serve`` in front of the cluster's engines that sends every prompt
    through a prefill (``--short-prompt-tokens 0``); None where ``eldr serve`` has no such
    option (then the cluster's own router disaggregates short prompts)."""
    import subprocess
    import sys

    usage = subprocess.run([sys.executable, "-m", "eldr", "serve", "--help"],
                           capture_output=True, text=True, check=True).stdout
    if "--short-prompt-tokens" not in usage:
        return None
    port = _free_port()
    cmd = [sys.executable, "-m", "eldr", "serve", "--port", str(port),
           "--health-interval", "1", "--short-prompt-tokens", "0"]
    for name, (url, _pid) in cluster.engines.items():
        cmd += ["--prefill" if name.startswith("prefill") else "--decode", url]
    procs["pd_router"] = _Proc("pd_router", cmd, dict(os.environ), tmp / "pd_router.log")
    procs["pd_router"].start()
    url = f"http://127.0.0.1:{port}"
    procs["pd_router"].wait_ready(url + "/health", time.monotonic() + 60)
    return url


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("cluster_faults")
    pythonpath = _plugin_pythonpath(tmp)
    started = time.monotonic()
    reference, ref_url = _engine("reference", tmp, sorted(os.sched_getaffinity(0))[-1],
                                 kv=False, pythonpath=pythonpath)
    cluster, procs = None, {}
    try:
        reference.start()
        cluster = ClusterProcess(tmp, [
            "--prefill", "1", "--decode", "2", "--port", "0", "--log-dir", str(tmp / "logs"),
            "--ready-timeout", str(RESTART_TIMEOUT_S),
            "--serve-args", "--health-interval 1"], pythonpath)
        deadline = time.monotonic() + READY_TIMEOUT_S
        reference.wait_ready(ref_url + "/health", deadline)
        cluster.wait_ready(deadline)
        print(f"cluster and reference ready in {time.monotonic() - started:.0f} s")
        status, _, raw = _request(ref_url + "/tokenize", {"model": MODEL_NAME,
                                                          "prompt": SOURCE})
        assert status == 200, raw
        ids = json.loads(raw)["tokens"]
        assert len(ids) >= 140, len(ids)
        yield Setup(cluster, ref_url, ids, _always_disaggregating_router(cluster, tmp, procs))
    finally:
        for proc in procs.values():
            proc.stop()
        if cluster is not None:
            cluster.stop()
        reference.stop()


def _body(prompt, *, chat: bool, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _assert_like_reference(setup: Setup, prompt, *, chat: bool,
                           routers: list[str] | None = None) -> None:
    body = _body(prompt, chat=chat)
    s_ref, _, ref = _request(setup.reference + _path(chat), body)
    assert s_ref == 200, ref
    want = _text(ref, chat=chat, stream=False)
    for router in routers or [setup.url]:
        for stream in (False, True):
            status, hdr, got = _request(router + _path(chat), {**body, "stream": stream})
            assert status == 200, (router, prompt, stream, got[:500])
            if router == setup.pd_router:  # prefilled, its KV through the connector
                assert hdr.get("X-Eldr-Prefill") not in (None, "none"), hdr
            assert _text(got, chat=chat, stream=stream) == want, (router, prompt, stream)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_short_prompts_are_answered_like_a_plain_engine(faults, chat):
    prompts = (["hi", "Why?", "Tell me about the harbour."] if chat
               else [faults.ids[:1], faults.ids[5:7], faults.ids[10:41]])  # 1, 2, 31 tokens
    for _round in range(2):  # twice: the store now holds what the first round left there
        for prompt in prompts:
            _assert_like_reference(faults, prompt, chat=chat, routers=faults.routers())
    for router in faults.routers():
        health = json.loads(_request(router + "/health")[2])
        assert health["status"] == "ok", health  # no engine died
    assert "exited" not in faults.cluster.lines()


def test_normal_traffic_flows_after_the_short_prompts(faults):
    for start in (0, 20, 40):
        _assert_like_reference(faults, faults.ids[start:start + 100], chat=False)


def _outcome(status: int, raw: bytes, *, stream: bool) -> str:
    """'ok', or 'error' for a clear JSON error (a JSON body, or a stream's last event);
    fails on anything else."""
    text = raw.decode(errors="replace")
    assert "Traceback" not in text, text[:1000]
    assert "poison" not in text.lower(), text[:1000]  # one engine death is not poison
    if status != 200:
        doc = json.loads(raw)  # a JSON error, never an HTML page or a bare string
        assert "error" in doc, doc
        return "error"
    if not stream:
        doc = json.loads(raw)
        assert doc["usage"]["completion_tokens"] == LONG_TOKENS, doc
        return "ok"
    events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events, text[-500:]
    if events[-1] != "[DONE]":
        # The decoder died after the stream started: the router ends the stream with one
        # SSE error event and no [DONE] (docs/serve.md), so a client that only waits for
        # [DONE] sees the answer cut, not complete.
        last = json.loads(events[-1])
        assert "error" in last and last["error"]["code"] == 502, text[-500:]
        assert not any("error" in json.loads(e) for e in events[:-1]), text[-1000:]
        return "error"
    docs = [json.loads(e) for e in events[:-1]]
    assert not any("error" in d for d in docs), text[-1000:]  # an error is the last event
    assert sum(len(c.get("text", "")) > 0 for d in docs for c in d.get("choices", [])) > 0
    return "ok"


def test_a_decoder_killed_under_load_is_restarted_and_used_again(faults):
    cluster = faults.cluster
    victim, (victim_url, victim_pid) = "decode-1", cluster.engines["decode-1"]
    names = [d["name"] for d in json.loads(_request(faults.url + "/health")[2])["decode"]]
    victim_index = 1  # eldr cluster lists its decoders in order: decode-0, decode-1

    def send(k: int):
        stream = k % 2 == 1
        body = {**_body(faults.ids[k * 5:k * 5 + 100], chat=False, max_tokens=LONG_TOKENS),
                "ignore_eos": True, "stream": stream}
        status, _, raw = _request(faults.url + "/v1/completions", body, timeout=240)
        return status, raw, stream

    killed_at = None
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, k) for k in range(8)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill when the victim is busy
            health = json.loads(_request(faults.url + "/health")[2])
            if health["decode"][victim_index]["in_flight"] > 0:
                break
            time.sleep(0.05)
        os.killpg(victim_pid, signal.SIGKILL)  # the API server and its engine core
        killed_at = time.monotonic()
        results = [f.result() for f in futures]  # urllib's timeout: no hang goes unseen
    outcomes = [_outcome(status, raw, stream=stream) for status, raw, stream in results]
    print(f"requests in flight at the kill: {outcomes.count('ok')} answered 200, "
          f"{outcomes.count('error')} a clear JSON error")

    # eldr cluster restarts it: one log line, then the router takes it back
    deadline = killed_at + RESTART_TIMEOUT_S + 30
    while not re.search(rf"^{victim}: ready again", cluster.lines(), re.M):
        assert cluster.proc.poll() is None, cluster.lines()[-3000:]  # it keeps serving
        assert time.monotonic() < deadline, cluster.lines()[-3000:]
        time.sleep(1)
    restarted_after = time.monotonic() - killed_at
    assert re.search(rf"^{victim} exited with code -9 \(SIGKILL\): restart 1 in 1 s",
                     cluster.lines(), re.M), cluster.lines()[-3000:]
    while True:
        health = json.loads(_request(faults.url + "/health")[2])
        if health["decode"][victim_index]["healthy"]:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.5)
    print(f"{victim} restarted and ready {restarted_after:.0f} s after the kill, healthy in "
          f"the router after {time.monotonic() - killed_at:.0f} s")
    assert _request(victim_url + "/health")[0] == 200  # same port

    # traffic reaches it again (the load-aware policies spread concurrent requests)
    seen = set()
    for _ in range(5):
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda k: _request(faults.url + "/v1/completions", _body(
                faults.ids[k * 7:k * 7 + 100], chat=False, max_tokens=16)), range(6)))
        assert [s for s, _, _ in replies] == [200] * 6, [r[2][:300] for r in replies]
        seen |= {h.get("X-Eldr-Decoder") for _, h, _ in replies}
        if names[victim_index] in seen:
            break
    assert names[victim_index] in seen, seen


def test_stopping_reports_the_restarts(faults):
    cluster = faults.cluster
    assert cluster.proc.poll() is None, cluster.lines()[-3000:]  # it kept serving
    killed = "decode-1 exited" in cluster.lines()  # the test above ran
    assert cluster.stop() == 0
    assert re.search(rf"^restarts: prefill-0 0, decode-0 0, decode-1 {int(killed)}, "
                     rf"router 0$", cluster.lines(), re.M), cluster.lines()[-2000:]
