"""End to end: ``eldr orchestrate`` serves completions over real vLLM-CPU engines (one
prefill with the capture plugin, two decoders of the tiny MoE over the ExampleConnector
store) taking every decode decision from the selection API of ``eldr serve --workers 2``.

Checks (issue 23 item 5):
- completions through the orchestrator, streamed and not, give the tokens ``eldr serve``
  gives for the same prompts (greedy; both run prefill and decode on the same engines);
- the reservations are the router's state: a held stream shows as one reservation and as
  load in ``/v1/eldr/workers`` and ``/health`` (any of the two workers answers), and all
  are gone once the requests ended, a client that left mid-stream included;
- a reservation nobody releases expires and holds nothing after;
- ``--select-on tokens`` (the reservation made on the prompt before the prefill) serves
  the same tokens.

About 4 minutes on 2 cores, most of it the three engines starting (in parallel).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
from _engines import _free_port, _Proc, _request, _text, engine_set

pytestmark = pytest.mark.e2e

TOKEN = "orchestrate-e2e-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = ["def quicksort(items):", "The court held that the contract"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with engine_set(tmp_path_factory, "orchestrate_e2e", [
            ("prefill", True), ("decode0", True), ("decode1", True)]) as (tmp, urls, procs):
        env = {**os.environ, "ELDR_ADMIN_TOKEN": TOKEN}
        port = _free_port()
        router = _Proc("router", [
            sys.executable, "-m", "eldr", "serve", "--prefill", urls["prefill"],
            "--decode", urls["decode0"], "--decode", urls["decode1"], "--workers", "2",
            "--port", str(port), "--health-interval", "1", "--decode-timeout", "60"],
            env, tmp / "router.log")
        procs["router"], urls["router"] = router, f"http://127.0.0.1:{port}"
        router.start()
        router.wait_ready(urls["router"] + "/health", time.monotonic() + 60)
        port = _free_port()
        orch = _Proc("orchestrate", [
            sys.executable, "-m", "eldr", "orchestrate", "--router", urls["router"],
            "--prefill", urls["prefill"], "--port", str(port), "--timeout", "60"],
            env, tmp / "orchestrate.log")
        procs["orchestrate"], urls["orchestrate"] = orch, f"http://127.0.0.1:{port}"
        port = _free_port()
        early = _Proc("orchestrate-tokens", [
            sys.executable, "-m", "eldr", "orchestrate", "--router", urls["router"],
            "--prefill", urls["prefill"], "--port", str(port), "--timeout", "60",
            "--select-on", "tokens"], env, tmp / "orchestrate-tokens.log")
        procs["orchestrate-tokens"], urls["orchestrate-tokens"] = early, \
            f"http://127.0.0.1:{port}"
        orch.start()
        early.start()
        orch.wait_ready(urls["orchestrate"] + "/health", time.monotonic() + 60)
        early.wait_ready(urls["orchestrate-tokens"] + "/health", time.monotonic() + 60)
        yield urls


def _workers(urls) -> dict[str, tuple[float, int]]:
    status, _, raw = _request(urls["router"] + "/v1/eldr/workers", headers=AUTH)
    assert status == 200, raw
    return {w["name"]: (w["load"], w["reservations"]) for w in json.loads(raw)["workers"]}


def _settled(urls, timeout: float = 10.0) -> dict[str, tuple[float, int]]:
    deadline = time.monotonic() + timeout
    while True:
        got = _workers(urls)
        if all(v == (0.0, 0) for v in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_completions_through_the_orchestrator_match_the_router(deployment):
    urls = deployment
    for stream in (False, True):
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "stream": stream}
            s1, h1, raw1 = _request(urls["orchestrate"] + "/v1/completions", body)
            s2, _, raw2 = _request(urls["router"] + "/v1/completions", body)
            assert s1 == s2 == 200, (raw1, raw2)
            assert h1["X-Eldr-Decoder"] in ("decode-0", "decode-1")
            assert _text(raw1, chat=False, stream=stream) == \
                _text(raw2, chat=False, stream=stream)
    assert _settled(urls) == {"decode-0": (0.0, 0), "decode-1": (0.0, 0)}


def test_a_held_stream_is_load_and_a_client_that_leaves_releases_it(deployment):
    urls = deployment
    host, port = urls["orchestrate"].removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 900,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # decoding
        during = _workers(urls)
        _, _, raw = _request(urls["router"] + "/health")
        health = {d["name"]: d["load"] for d in json.loads(raw)["decode"]}
    finally:
        sock.close()  # the client leaves mid-stream
    assert sorted(during.values()) == [(0.0, 0), (1.0, 1)]
    assert sorted(health.values()) == [0.0, 1.0]  # the proxy's own view
    assert _settled(urls) == {"decode-0": (0.0, 0), "decode-1": (0.0, 0)}


def test_a_reservation_nobody_releases_expires(deployment):
    urls = deployment
    status, _, raw = _request(urls["router"] + "/v1/eldr/reserve", {"ttl": 1},
                              headers=AUTH)
    assert status == 201, raw
    rid = json.loads(raw)["reservation"]["id"]
    time.sleep(2.0)
    status, _, raw = _request(urls["router"] + f"/v1/eldr/reservations/{rid}", headers=AUTH)
    assert status == 200 and json.loads(raw)["reservation"]["outcome"] == "expired"
    status, _, raw = _request(urls["router"] + f"/v1/eldr/reservations/{rid}/release", {},
                              headers=AUTH)
    assert status == 410, raw
    assert _settled(urls) == {"decode-0": (0.0, 0), "decode-1": (0.0, 0)}


def test_selecting_before_the_prefill_serves_the_same_tokens(deployment):
    """--select-on tokens: the reservation is made on the prompt before the prefill runs
    (this router has no artifact, so no prompt predictor: by load, and the answer says so)."""
    urls = deployment
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0}
    s1, h1, raw1 = _request(urls["orchestrate-tokens"] + "/v1/completions", body)
    s2, _, raw2 = _request(urls["router"] + "/v1/completions", body)
    assert s1 == s2 == 200, (raw1, raw2)
    assert h1["X-Eldr-Input"] == "prompt; fallback=no_prompt_predictor"
    assert _text(raw1, chat=False, stream=False) == _text(raw2, chat=False, stream=False)
    assert _settled(urls) == {"decode-0": (0.0, 0), "decode-1": (0.0, 0)}
