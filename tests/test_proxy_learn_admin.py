"""``GET /admin/learn`` and ``/admin/learn/trace``: the learner over HTTP (stand-in engines)."""

import asyncio
import io

import numpy as np
from aiohttp.test_utils import TestClient, TestServer

from _proxy_fakes import cluster
from test_proxy_learning import TwoDomainEngine, _send

TOKEN = "learn-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_status_and_trace_of_a_learning_router(tmp_path):
    from eldr.learn.config import LearnConfig
    from eldr.proxy.app import Router
    from eldr.proxy.config import ServeConfig

    async def go():
        prefill = await TwoDomainEngine("p0").start()
        decoders = [await TwoDomainEngine(f"d{k}").start() for k in range(2)]
        engines = [prefill, *decoders]
        config = ServeConfig(prefill_urls=(prefill.url,),
                             decode_urls=tuple(d.url for d in decoders), admin_token=TOKEN,
                             health_interval=0.05, health_timeout=1.0, unhealthy_after=1,
                             short_prompt_tokens=0)  # short test prompts: PD flow
        router = Router(config)
        router.learn(LearnConfig(directory=str(tmp_path / "learn"), min_requests=40))
        client = TestClient(TestServer(router.make_app(), port=0))
        await client.start_server()
        try:
            out = {"unauthorized": (await client.get("/admin/learn")).status}
            empty = await client.get("/admin/learn/trace", headers=AUTH)
            out["empty"] = (empty.status, (await empty.json())["error"]["message"])
            await _send(client, 40)
            await router.learner.learner.fit_task
            out["status"] = await (await client.get("/admin/learn", headers=AUTH)).json()
            r = await client.get("/admin/learn/trace", headers=AUTH)
            out["trace"] = (r.status, r.headers["X-Eldr-Requests"], await r.read())
            out["post"] = (await client.post("/admin/learn", headers=AUTH)).status
            bad = await client.get("/admin/learn/trace?decode_only=maybe", headers=AUTH)
            out["bad"] = bad.status
            only = await client.get("/admin/learn/trace?decode_only=1", headers=AUTH)
            out["decode_only"] = only.status  # the stand-in engines send no decode counts
            return out
        finally:
            await client.close()
            for e in engines:
                await e.close()

    out = asyncio.run(go())
    assert out["unauthorized"] == 401
    assert out["empty"] == (409, "the learn buffer holds no requests")
    status = out["status"]
    assert status["requests"] == 40 and status["seen"] == 40 and status["accepted"] == 1
    assert status["artifact"] and status["fit_running"] is False
    code, n, data = out["trace"]
    assert code == 200 and n == "40"
    arrays = np.load(io.BytesIO(data))
    assert arrays["prefill_counts"].shape[0] == 40  # the project's trace format
    assert out["post"] == 405 and out["bad"] == 400 and out["decode_only"] == 409


def test_a_router_without_learn_says_so():
    async def go():
        async with cluster(admin_token=TOKEN) as (_, client, _p, _d):
            r = await client.get("/admin/learn", headers=AUTH)
            return r.status, await r.json()

    status, doc = asyncio.run(go())
    assert status == 404 and "--learn" in doc["error"]["message"]
