"""``eldr serve --learn`` with stand-in engines: start with no artifact, collect, fit, swap."""

import asyncio
import time
import zlib

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from _learn_data import E, L, token_counts
from _proxy_fakes import FakeEngine
from eldr.capture.payload import encode_counts
from eldr.commands.serve import configure, start_artifact
from eldr.learn.config import LearnConfig
from eldr.proxy.app import Router
from eldr.proxy.config import ServeConfig
from eldr.proxy.metrics import parse_samples


class TwoDomainEngine(FakeEngine):
    """A prefill whose payload is the synthetic model's counts (L=4, E=16, k=2) of the
    prompt's domain: 'code' prompts route like domain 0, the others like domain 1."""

    def _prefill_answer(self, prompt: str, n_prompt: int, body: dict) -> dict:
        doc = super()._prefill_answer(prompt, n_prompt, body)
        rng = np.random.default_rng(zlib.crc32(prompt.encode()))
        domain = next((d for d, w in enumerate(DOMAIN_WORDS) if w in prompt), 1)
        counts = token_counts(rng, domain, n_prompt)
        doc["kv_transfer_params"]["eldr"] = {**encode_counts(counts), "tokens": n_prompt}
        return doc


DOMAIN_WORDS = ("code", "law", "poem", "math")  # a prompt's word → its synthetic domain


def _prompt(i: int, domains=(0, 1)) -> str:
    word = DOMAIN_WORDS[domains[i % len(domains)]]
    return " ".join(["please", word, "now"] + [f"w{j}" for j in range(i % 7)])


async def _send(client, n: int, domains=(0, 1), start: int = 0) -> None:
    for first in range(start, start + n, 8):
        rs = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": "tiny", "prompt": _prompt(i, domains)})
            for i in range(first, min(first + 8, start + n))))
        assert [r.status for r in rs] == [200] * len(rs)


async def _cluster(tmp_path, policy="eldr_cost", **learn_kw):
    prefill = await TwoDomainEngine("p0").start()
    decoders = [await TwoDomainEngine(f"d{k}").start() for k in range(2)]
    config = ServeConfig(prefill_urls=(prefill.url,), decode_urls=tuple(d.url for d in decoders),
                         health_interval=0.05, health_timeout=1.0, unhealthy_after=1,
                         policy=policy, stand_in=policy != "eldr_cost",
                         short_prompt_tokens=0)  # short test prompts: through the PD flow
    router = Router(config)  # eldr_cost, no artifact
    router.learn(LearnConfig(directory=str(tmp_path / "learn"),
                             **{"min_requests": 40, **learn_kw}))
    client = TestClient(TestServer(router.make_app(), port=0))
    await client.start_server()
    return router, client, [prefill, *decoders]


def test_starts_without_an_artifact_collects_fits_and_swaps(tmp_path):
    async def go():
        router, client, engines = await _cluster(tmp_path)
        try:
            assert router.state.artifact is None and router.state.encoder is None
            before = await (await client.get("/metrics")).text()
            assert 'eldr_learn_fits_total{result="refused"} 0' in before
            assert "eldr_learn_swaps_total 0" in before
            t0 = time.perf_counter()
            await _send(client, 40)
            learner = router.learner.learner
            assert learner.fit_task is not None  # the 40th request started the fit
            await learner.fit_task
            seconds = time.perf_counter() - t0
            page = await (await client.get("/metrics")).text()
            r = await client.post("/v1/completions", json={"model": "tiny",
                                                           "prompt": _prompt(1)})
            assert r.status == 200
            return router, page, seconds
        finally:
            await client.close()
            for e in engines:
                await e.close()

    router, page, seconds = asyncio.run(go())
    fit = router.learner.learner.state["last"]["seconds"]
    print(f"\nfirst fit: 40 requests, {seconds:.2f} s from the first request to the swap "
          f"(the fit itself {fit:.2f} s in its process)")
    art = str(tmp_path / "learn" / "artifacts" / "0001")
    assert router.state.artifact == art and router.config.artifact == art
    assert router.state.policy.name == "eldr_cost" and router.state.predictor is not None
    assert (router.state.num_layers, router.state.num_experts) == (L, E)
    recs = router.learner.learner.buffer.snapshot()
    assert {r.output_tokens for r in recs} == {3}  # the answers' usage.completion_tokens
    assert {r.decoder for r in recs} <= {"decode-0", "decode-1"}
    assert all(r.decode_counts is None for r in recs)  # the engines send none (yet)
    got = parse_samples(page, ["eldr_learn_swaps_total", "eldr_learn_fits_total",
                               "eldr_learn_requests_total", "eldr_artifact_reloads_total"])
    assert got["eldr_learn_swaps_total"] == 1 and got["eldr_learn_fits_total"] == 1
    assert got["eldr_learn_requests_total"] == 40
    assert 'eldr_learn_requests_total{result="collected"} 40' in page
    assert 'eldr_learn_buffer_requests{kind="all"} 40' in page
    assert "eldr_learn_artifact_score " in page
    # the buffer was written at shutdown, and a restart starts with the learned artifact
    assert (tmp_path / "learn" / "buffer" / "trace.npz").is_file()
    assert start_artifact(LearnConfig(directory=str(tmp_path / "learn"))) == art


def test_a_domain_mix_shift_is_detected_and_a_refit_swaps_in(tmp_path):
    async def go():
        router, client, engines = await _cluster(tmp_path, drift_window=20)
        try:
            learner = router.learner.learner
            await _send(client, 40, domains=(0, 1))
            await learner.fit_task
            assert learner.detector is not None
            await _send(client, 40, domains=(0, 1), start=40)  # same mix: quiet
            assert learner.state["drifts"] == 0
            for start in range(80, 200, 8):  # the mix moves to the other two domains
                await _send(client, 8, domains=(2, 3), start=start)
                await asyncio.sleep(0.01)  # let the drift tests (threads) report
                if learner.state["accepted"] == 2:
                    break
            if learner.fit_task is not None:
                await learner.fit_task
            page = await (await client.get("/metrics")).text()
            return router, learner, page
        finally:
            await client.close()
            for e in engines:
                await e.close()

    router, learner, page = asyncio.run(go())
    assert learner.state["drifts"] == 1 and learner.state["accepted"] == 2
    assert learner.state["last"]["reason"] == "drift"
    assert router.state.artifact == str(tmp_path / "learn" / "artifacts" / "0002")
    assert 'eldr_learn_drift_detections_total{signal="shift"} 1' in page
    assert 'eldr_learn_swaps_total 2' in page


def test_serve_arguments_and_restart_artifact(tmp_path):
    from eldr.cli import build_parser
    from eldr.commands.serve import config_from_args

    args = build_parser().parse_args(["serve", "--prefill", "http://p:1", "--decode",
                                      "http://d:1", "--learn", str(tmp_path),
                                      "--learn-min-requests", "60"])
    config, learn = configure(config_from_args(args), args)
    assert learn.min_requests == 60 and learn.directory == str(tmp_path)
    assert config.artifact is None  # nothing learned yet: start without one
    args = build_parser().parse_args(["serve", "--prefill", "http://p:1", "--decode",
                                      "http://d:1"])
    assert configure(config_from_args(args), args)[1] is None


def test_a_decoder_added_after_the_first_fit_gets_its_own_cluster_at_the_refit(tmp_path):
    async def go():
        router, client, engines = await _cluster(tmp_path)
        extra = await TwoDomainEngine("d2").start()
        try:
            learner = router.learner.learner
            await _send(client, 42, domains=(0, 1, 2))  # three domains, two decoders
            await learner.fit_task
            first = router.state.artifact
            await router.elastic.add(extra.url, "d-new")  # fitted for 2: refit for 3
            assert learner.state["drift_point"] is not None
            await _send(client, 8, domains=(0, 1, 2), start=42)  # starts the refit
            await learner.fit_task
            return router, learner, first, len(extra.requests)
        finally:
            await client.close()
            for e in (*engines, extra):
                await e.close()

    router, learner, first, new_requests = asyncio.run(go())
    assert first == str(tmp_path / "learn" / "artifacts" / "0001")
    assert learner.state["accepted"] == 2, learner.state["last"]["reasons"]
    assert router.state.artifact == str(tmp_path / "learn" / "artifacts" / "0002")
    assert router.state.worker_names == ("decode-0", "decode-1", "d-new")
    assert router.state.policy.num_workers == 3 and new_requests > 0
    from eldr.fit import artifact

    assert tuple(artifact.load(router.state.artifact).worker_ids) == router.state.worker_names


def test_with_two_workers_one_learns_from_both_and_its_swap_reaches_both(tmp_path):
    """``eldr serve --workers 2 --learn DIR``: worker 0 learns, worker 1 forwards its
    completed requests to it, so 40 requests over both fit the first artifact
    (``--learn-min-requests 40``); the swap reaches both workers with the learned path."""
    import json
    import os
    import re
    import signal
    import socket
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    token = "learn-workers-token"
    learn_dir = tmp_path / "learn"
    art = str(learn_dir / "artifacts" / "0001")

    def call(base, path, body=None):
        req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"},
                                     data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=10) as resp:  # a new connection each call
            raw = resp.read()
            return raw if path == "/metrics" else json.loads(raw)

    async def go():
        prefill = await TwoDomainEngine("p0").start()
        decoders = [await TwoDomainEngine(f"d{k}").start() for k in range(2)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        err = open(tmp_path / "serve.log", "w+")  # read at the end
        proc = subprocess.Popen(
            [sys.executable, "-m", "eldr", "serve", "--prefill", prefill.url,
             *[a for d in decoders for a in ("--decode", d.url)], "--port", str(port),
             "--workers", "2", "--health-interval", "0.2", "--learn", str(learn_dir),
             "--learn-min-requests", "40", "--short-prompt-tokens", "0"], stderr=err,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "ELDR_ADMIN_TOKEN": token})
        try:
            for _ in range(600):
                await asyncio.sleep(0.1)
                try:
                    await asyncio.to_thread(call, base, "/health")
                    break
                except OSError:
                    continue
            for _ in range(600):  # both workers listen (each says so)
                if (tmp_path / "serve.log").read_text().count("listening on") >= 2:
                    break
                await asyncio.sleep(0.1)
            for first in range(0, 40, 4):
                docs = await asyncio.gather(*(asyncio.to_thread(
                    call, base, "/v1/completions", {"model": "tiny", "prompt": _prompt(i)})
                    for i in range(first, first + 4)))
                assert all(d["choices"] for d in docs)
            processes = {rid.rsplit("-", 1)[0] for rid in prefill.request_ids}
            seen: set = set()
            for _ in range(240):  # the fit runs in worker 0's fit process
                await asyncio.sleep(0.25)
                seen = {(await asyncio.to_thread(call, base, "/health"))["artifact"]
                        for _ in range(8)}
                if seen == {art}:
                    break
            pages = [(await asyncio.to_thread(call, base, "/metrics")).decode()
                     for _ in range(12)]
            status = []
            for _ in range(12):  # the learner's state: worker 0's, the other says where
                try:
                    status.append((200, (await asyncio.to_thread(
                        call, base, "/admin/learn"))["requests"]))
                except urllib.error.HTTPError as exc:
                    status.append((exc.code, json.loads(exc.read())["error"]["message"]))
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
            err.seek(0)
            return processes, seen, pages, status, proc.returncode, err.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            for e in (prefill, *decoders):
                await e.close()

    processes, seen, pages, status, rc, log = asyncio.run(go())
    assert len(processes) == 2, processes  # both workers served requests
    assert seen == {art}, log  # the learned artifact runs in every worker
    learner_pages = [p for p in pages if "eldr_learn_swaps_total 1" in p]
    assert learner_pages, log  # worker 0 answered at least one of the 12 scrapes
    # all 40 requests reached worker 0's buffer: its own and worker 1's forwarded
    assert all('eldr_learn_requests_total{result="collected"} 40' in p for p in learner_pages)
    forwarder_pages = [p for p in pages if "eldr_learn_swaps_total" not in p]
    assert forwarder_pages, log  # worker 1 answered some: it counts what it forwarded
    for page in forwarder_pages:
        sent = re.search(r'^eldr_learn_forwarded_total\{result="sent"\} (\S+)$', page, re.M)
        assert sent and 0 < float(sent.group(1)) < 40, page[-2000:]
        assert 'eldr_learn_forwarded_total{result="dropped"} 0.0' in page
    assert sum('eldr_artifact_reloads_total{result="ok"} 1.0' in p for p in pages) == 12
    assert (200, 40) in status and all(s == (200, 40) or (s[0] == 503 and "worker 0" in s[1])
                                       for s in status), status
    assert rc == 0, log


def test_the_band_policy_learns_with_eldr_cost_standing_in_until_the_first_artifact(tmp_path):
    """``--policy eldr --learn``: no artifact yet, so eldr_cost routes; the first learned
    artifact switches the router to the band policy itself."""
    async def go():
        router, client, engines = await _cluster(tmp_path, policy="eldr")
        try:
            before = router.state.policy.name
            await _send(client, 40)
            await router.learner.learner.fit_task
            await _send(client, 8, start=40)
            return before, router
        finally:
            await client.close()
            for e in engines:
                await e.close()

    before, router = asyncio.run(go())
    assert before == "eldr_cost" and router.state.artifact is not None
    assert router.state.policy.name == "eldr" and router.state.tau is not None


def test_without_learning_the_band_policy_still_needs_an_artifact(tmp_path):
    import pytest

    from eldr.cli import build_parser
    from eldr.commands.serve import config_from_args
    from eldr.proxy.request.decision import build_state

    with pytest.raises(ValueError, match="needs a routing artifact"):
        build_state(ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",),
                                policy="eldr"))
    args = build_parser().parse_args(["serve", "--prefill", "http://p:1", "--decode",
                                      "http://d:1", "--policy", "eldr", "--learn",
                                      str(tmp_path)])
    config, _ = configure(config_from_args(args), args)
    assert config.stand_in and build_state(config).policy.name == "eldr_cost"


class TailOnlyEngine(TwoDomainEngine):
    """Prompts with 'cached' in them come back as a KV connector's prefix hit would: the
    payload counts (and its ``tokens``) cover only the last 2 prompt tokens; usage says
    the whole prompt."""

    def _prefill_answer(self, prompt: str, n_prompt: int, body: dict) -> dict:
        doc = super()._prefill_answer(prompt, n_prompt, body)
        if "cached" in prompt:
            rng = np.random.default_rng(zlib.crc32(prompt.encode()))
            doc["kv_transfer_params"]["eldr"] = {**encode_counts(token_counts(rng, 0, 2)),
                                                 "tokens": 2}
        return doc


def test_counts_of_part_of_a_prompt_are_not_learned_from(tmp_path):
    async def go():
        prefill = await TailOnlyEngine("p0").start()
        decoders = [await TwoDomainEngine(f"d{k}").start() for k in range(2)]
        config = ServeConfig(prefill_urls=(prefill.url,),
                             decode_urls=tuple(d.url for d in decoders), policy="eldr_cost",
                             short_prompt_tokens=0)
        router = Router(config)
        router.learn(LearnConfig(directory=str(tmp_path / "learn"), min_requests=40))
        client = TestClient(TestServer(router.make_app(), port=0))
        await client.start_server()
        try:
            for i in range(12):
                prompt = _prompt(i) + (" cached w1 w2 w3" if i % 3 == 0 else "")
                r = await client.post("/v1/completions", json={"model": "tiny",
                                                               "prompt": prompt})
                assert r.status == 200
            return router, await (await client.get("/metrics")).text()
        finally:
            await client.close()
            for e in [prefill, *decoders]:
                await e.close()

    router, page = asyncio.run(go())
    recs = router.learner.learner.buffer.snapshot()
    assert len(recs) == 8 and all(r.prompt_tokens > 2 for r in recs)
    assert 'eldr_learn_requests_total{result="partial"} 4' in page
    assert 'eldr_learn_requests_total{result="collected"} 8' in page


class TokenIdEngine(TwoDomainEngine):
    """A prefill that answers ``return_token_ids`` as vLLM does for completions
    (``choices[0].prompt_token_ids``, only when asked): word ids, one per token."""

    def _prefill_answer(self, prompt: str, n_prompt: int, body: dict) -> dict:
        doc = super()._prefill_answer(prompt, n_prompt, body)
        if body.get("return_token_ids") is True:  # the learning router asks for them
            words = prompt.split()
            doc["choices"][0]["prompt_token_ids"] = [
                zlib.crc32(words[i % len(words)].encode()) % 1000 for i in range(n_prompt)]
        return doc


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_prompts_are_learned_as_hashed_bags_and_the_fit_gets_a_prompt_predictor(
        tmp_path, with_tokenizer):
    from eldr.capture import tiny_moe_dir
    from eldr.fit import artifact as artifact_io
    from eldr.fit.prompt import tokenizer_fingerprint

    tokenizer = str(tiny_moe_dir()) if with_tokenizer else None

    async def go():
        prefill = await TokenIdEngine("p0").start()
        decoders = [await TwoDomainEngine(f"d{k}").start() for k in range(2)]
        config = ServeConfig(prefill_urls=(prefill.url,),
                             decode_urls=tuple(d.url for d in decoders), policy="eldr_cost",
                             short_prompt_tokens=0, tokenizer=tokenizer)
        router = Router(config)
        router.learn(LearnConfig(directory=str(tmp_path / "learn"), min_requests=40))
        client = TestClient(TestServer(router.make_app(), port=0))
        await client.start_server()
        try:
            await _send(client, 40)
            await router.learner.learner.fit_task
            return router
        finally:
            await client.close()
            for e in [prefill, *decoders]:
                await e.close()

    router = asyncio.run(go())
    recs = router.learner.learner.buffer.snapshot()
    assert len(recs) == 40 and all(r.prompt_hashes is not None for r in recs)
    assert all(r.prompt_hashes.size == 2 * r.prompt_tokens - 1 for r in recs)
    art = router.state.artifact
    assert art == str(tmp_path / "learn" / "artifacts" / "0001")
    learned = artifact_io.load(art)
    pred = learned.prompt_predictor
    assert pred is not None and learned.fit_stats["prompt_predictor"] is not None
    seen = max(r.max_token_id for r in recs)
    if with_tokenizer:  # the router's tokenizer names the predictor's vocabulary
        assert pred.vocab_size == 4096
        assert pred.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
        ids = np.array([3, 17, 3, 4095])  # an id no prompt had is still this vocabulary's
        with pytest.raises(ValueError, match="unknown token id 4096"):
            learned.route_inputs_from_prompt(np.array([3, 4096]))  # outside it: refused
    else:  # without one it records the ids it has seen, and hashes larger ones too
        assert pred.vocab_size == seen + 1 and pred.tokenizer_fingerprint == ""
        assert pred.vocab_source == "calibration"
        with pytest.raises(ValueError, match="unknown token id -1"):
            learned.route_inputs_from_prompt(np.array([3, -1]))
        ids = np.array([3, 17, 3, seen + 1])
    sig, profile = learned.route_inputs_from_prompt(ids)  # routes before prefill
    assert sig.shape == (learned.centroids.shape[1],) and profile.shape == (L, E)
    # the buffer on disk keeps the bags, not the ids
    assert (tmp_path / "learn" / "buffer" / "prompts.npz").is_file()
