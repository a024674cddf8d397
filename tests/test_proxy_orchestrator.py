"""``eldr orchestrate`` against stand-in engines and a real router: every decode decision from
the selection API, whole request lives (completed, failed, cancelled by the client), the
reservations released into the router's own state, and clear errors."""

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from _proxy_fakes import FakeEngine, cluster, domain_counts, run
from eldr.cli import main
from eldr.proxy.orchestrator import OrchestrateConfig, Orchestrator
from eldr.proxy.selection import service as selection_service

TOKEN = "orchestrate-token-1"


def _events(router) -> dict[str, float]:
    m = router.selection.selection.m_events
    return {e: m.get(event=e) for e in ("reserved", "prefill_complete", "completed", "failed",
                                        "cancelled", "expired")}


async def _orchestrator(router_client, prefills, **kw):
    config = OrchestrateConfig(router=str(router_client.make_url("")).rstrip("/"),
                               prefill_urls=tuple(p.url for p in prefills), token=TOKEN, **kw)
    client = TestClient(TestServer(Orchestrator(config).make_app(), port=0,
                                   handler_cancellation=True))
    await client.start_server()
    return client


async def _wait(predicate, timeout: float = 5.0) -> bool:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def test_a_completion_runs_prefill_and_decode_where_the_api_reserved():
    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN) as (router, rc, prefills, decs):
            orch = await _orchestrator(rc, prefills)
            try:
                resp = await orch.post("/v1/completions",
                                       json={"model": "tiny", "prompt": "write code now"})
                doc, decoder = await resp.json(), resp.headers["X-Eldr-Decoder"]
                stream = await orch.post("/v1/completions", json={
                    "model": "tiny", "prompt": "the law says", "stream": True})
                text = await stream.text()
                models = (await orch.get("/v1/models")).status
                health = await (await orch.get("/health")).json()
            finally:
                await orch.close()
            return (doc, decoder, stream.headers["X-Eldr-Decoder"], text, models, health,
                    prefills[0].requests, [d.requests for d in decs], _events(router),
                    router.pool.tracker.loads.tolist())

    doc, first, second, text, models, health, pre, dec, events, loads = run(go())
    assert doc["choices"][0]["text"] == "tok0tok1tok2"
    assert (first, second) == ("w-code", "w-other")  # the payload's locality, via the API
    assert text.rstrip().endswith("data: [DONE]")
    assert models == 200 and health["workers"] == ["w-code", "w-other"]
    assert [r["kv_transfer_params"]["do_remote_decode"] for r in pre] == [True, True]
    assert [r["max_tokens"] for r in pre] == [1, 1]
    assert len(dec[0]) == len(dec[1]) == 1 and "eldr" not in dec[0][0].get(
        "kv_transfer_params", {})  # the payload is the router's, not the decoder's
    assert events == {"reserved": 2, "prefill_complete": 2, "completed": 2, "failed": 0,
                      "cancelled": 0, "expired": 0}
    assert loads == [0.0, 0.0]


def test_a_failed_decode_is_released_as_failed_and_relayed():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (router, rc, prefills, decs):
            for d in decs:
                d.mode = "500"
            orch = await _orchestrator(rc, prefills)
            try:
                resp = await orch.post("/v1/completions", json={"model": "tiny", "prompt": "x y"})
                status = resp.status
            finally:
                await orch.close()
            return status, _events(router), router.pool.tracker.loads.tolist()

    status, events, loads = run(go())
    assert status == 500
    assert events["failed"] == 1 and events["completed"] == 0
    assert loads == [0.0, 0.0]


def test_a_client_that_leaves_cancels_its_reservation():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (router, rc, prefills, decs):
            for d in decs:
                d.hold = asyncio.Event()
            orch = await _orchestrator(rc, prefills)
            try:
                task = asyncio.ensure_future(orch.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "a b c",
                                             "stream": True}))
                await _wait(lambda: any(d.requests for d in decs))
                held = router.pool.tracker.loads.tolist()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await _wait(lambda: _events(router)["cancelled"] == 1)
                for d in decs:
                    d.hold.set()
            finally:
                await orch.close()
            return held, _events(router), router.pool.tracker.loads.tolist()

    held, events, loads = run(go())
    assert sorted(held) == [0.0, 1.0]  # the reservation held one decoder
    assert events["cancelled"] == 1
    assert loads == [0.0, 0.0]


def test_selecting_on_the_prompt_reserves_before_the_prefill(monkeypatch):
    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN) as (router, rc, prefills, _d):
            encoder = router.state.encoder
            seen = []

            def predict(ids):
                seen.append((list(ids), len(prefills[0].requests)))
                return encoder.transform_one(domain_counts("law")), None

            monkeypatch.setattr(selection_service, "_prompt_predict", lambda state: predict)
            orch = await _orchestrator(rc, prefills, select_on="tokens")
            try:
                ids = await orch.post("/v1/completions",
                                      json={"model": "tiny", "prompt": [5, 6, 7]})
                # text, and no tokenizer behind this router: routed by load, and said so
                text = await orch.post("/v1/completions",
                                       json={"model": "tiny", "prompt": "write some code"})
                got = [(r.status, r.headers["X-Eldr-Decoder"], r.headers["X-Eldr-Input"])
                       for r in (ids, text)]
            finally:
                await orch.close()
            return got, seen, _events(router)

    got, seen, events = run(go())
    assert got[0] == (200, "w-other", "prompt")  # the prediction, not the prefill's payload
    assert seen == [([5, 6, 7], 0)]  # predicted before the prefill
    assert got[1][0] == 200 and got[1][2] == "prompt; fallback=no_tokenizer"
    assert events["completed"] == 2


def test_without_the_selection_api_the_client_gets_a_clear_503():
    async def go():
        async with cluster(policy="jsq", admin_token="another-token") as (_r, rc, prefills, _d):
            orch = await _orchestrator(rc, prefills)
            try:
                wrong = await orch.post("/v1/completions", json={"model": "tiny",
                                                                 "prompt": "a b"})
                wrong_doc = (wrong.status, await wrong.json())
                bad = await orch.post("/v1/completions", data=b"{nope")
                no_prompt = await orch.post("/v1/completions", json={"model": "tiny"})
                health = (await orch.get("/health")).status
            finally:
                await orch.close()
        gone = await _orchestrator_gone(prefills)
        return wrong_doc, bad.status, no_prompt.status, health, gone

    wrong, bad, no_prompt, health, gone = run(go())
    assert wrong[0] == 401 and "admin token" in wrong[1]["error"]["message"]
    assert (bad, no_prompt, health) == (400, 400, 503)
    assert gone[0] == 503 and "cannot be reached" in gone[1]


async def _without_router(calls):
    """``calls(client)`` on an orchestrator whose router does not answer (one stand-in
    prefill engine behind it)."""
    engine = await FakeEngine("p").start()
    config = OrchestrateConfig(router="http://127.0.0.1:9", prefill_urls=(engine.url,),
                               token=TOKEN, timeout=2.0)
    client = TestClient(TestServer(Orchestrator(config).make_app(), port=0))
    await client.start_server()
    try:
        return await calls(client)
    finally:
        await client.close()
        await engine.close()


async def _orchestrator_gone(prefills):
    """An orchestrator whose router does not answer: what a completion gets."""
    async def complete(client):
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
        return resp.status, (await resp.json())["error"]["message"]
    return await _without_router(complete)


def test_register_adds_the_decoders_the_router_lacks():
    async def go():
        extra = await FakeEngine("d-new").start()
        try:
            async with cluster(policy="jsq", admin_token=TOKEN) as (router, rc, prefills, decs):
                orch = await _orchestrator(rc, prefills, register=(
                    ("w-new", extra.url), (None, decs[0].url)))  # the second: known already
                await orch.close()
                return [i.name for i in router.pool.decode]
        finally:
            await extra.close()

    assert run(go()) == ["w-code", "w-other", "w-new"]


@pytest.mark.parametrize("argv, says", [
    (["--router", "http://r:1", "--prefill", "http://p:1"], "admin token"),
    (["--router", "ftp://r", "--prefill", "http://p:1"], "must look like http://HOST:PORT"),
    (["--router", "http://r:1", "--prefill", "http://p:1", "--register", "=http://d:1"],
     "worker id before '=' is empty"),
])
def test_bad_arguments_end_with_one_line_and_exit_2(argv, says, capsys, monkeypatch):
    monkeypatch.delenv("ELDR_ADMIN_TOKEN", raising=False)
    assert main(["orchestrate", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_unknown_paths_and_wrong_methods_get_eldr_serves_json_errors():
    async def calls(client):
        out = []
        for method, path in (("GET", "/nowhere"), ("GET", "/v1/completions"),
                             ("DELETE", "/health")):
            resp = await client.request(method, path)
            out.append((resp.status, resp.content_type, resp.headers.get("Allow"),
                        await resp.json()))
        return out

    missing, get_completions, delete_health = run(_without_router(calls))
    assert missing[:3] == (404, "application/json", None)
    assert missing[3]["error"]["message"] == "no route GET /nowhere"
    assert missing[3]["error"]["code"] == 404
    assert get_completions[:3] == (405, "application/json", "POST")
    assert get_completions[3]["error"]["code"] == 405
    assert delete_health[0] == 405 and "GET" in delete_health[2]
