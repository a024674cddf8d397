"""The elastic decoder pool (eldr.proxy.control.elastic): decoders added and removed under load."""

import asyncio
import json

import numpy as np
import pytest

from _proxy_fakes import FakeEngine, cluster, run, until
from eldr.proxy.config import read_decoders_file
from eldr.proxy.control import admin as admin_mod
from eldr.proxy.request.decision import WorkerMismatch

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _json(r):
    return r.status, await r.json()


class _Load:
    """``width`` clients each sending streaming requests back to back until stopped."""

    def __init__(self, client, width: int = 8) -> None:
        self.client, self.width = client, width
        self.results: list[tuple[int, bytes, str | None]] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _one(self, i: int) -> None:
        prompt = ("write code " if i % 2 else "a law text ") + "x " * (i % 5)
        r = await self.client.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "stream": True})
        self.results.append((r.status, await r.read(), r.headers.get("X-Eldr-Decoder")))

    async def _loop(self, start: int) -> None:
        i = start
        while not self._stop.is_set():
            await self._one(i)
            i += self.width

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(w)) for w in range(self.width)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def _gone(client, name: str, timeout: float = 15.0) -> None:
    for _ in range(int(timeout / 0.02)):
        _, doc = await _json(await client.get("/admin/decoders", headers=AUTH))
        if name not in [d["name"] for d in doc["decoders"]]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} was not removed within {timeout} s")


@pytest.mark.parametrize("policy", ["eldr", "eldr_cost", "jsq", "p2c", "round_robin"])
def test_add_under_load_takes_requests_and_remove_drains_with_no_failure(policy):
    async def go():
        async with cluster(policy=policy, admin_token=TOKEN, engine_kw={"tokens": 6}) as (
                router, client, _p, decoders):
            extra = await FakeEngine("d2", tokens=6).start()
            for engine in (*decoders, extra):
                engine.mode = "slow"  # 6 tokens, 50 ms apart: requests overlap
            load = _Load(client)
            load.start()
            await asyncio.sleep(0.6)
            added = await _json(await client.post(
                "/admin/decoders", json={"url": extra.url, "name": "w-new"}, headers=AUTH))
            await asyncio.sleep(1.0)
            new_requests = len(extra.requests)
            # remove w-code while requests run there
            gone = router.pool.decode[0]
            for _ in range(400):  # (a moment when it has none is possible: wait it out)
                if gone.in_flight >= 2:
                    break
                await asyncio.sleep(0.005)
            # no await between reading its decisions and the start of its drain (the same
            # call as DELETE /admin/decoders/w-code, which other tests send over HTTP)
            decided = router.metrics.decisions.get(policy=policy, decoder="w-code")
            in_flight = gone.in_flight
            await router.elastic.remove("w-code")
            await _gone(client, "w-code")
            await asyncio.sleep(0.4)
            await load.stop()
            after = router.metrics.decisions.get(policy=policy, decoder="w-code")
            page = await (await client.get("/metrics")).text()
            urls = (decoders[1].url, extra.url)
            await extra.close()
            return (router, decoders, urls, load.results, added, new_requests, in_flight,
                    decided, after, page, gone)

    (router, decoders, urls, results, added, new_requests, in_flight, decided, after,
     page, gone) = run(go())
    assert added[0] == 201 and added[1]["added"]["name"] == "w-new"
    assert added[1]["added"]["healthy"] is True
    assert new_requests > 0  # the new decoder took requests at once
    assert in_flight > 0  # the drain had requests to wait for
    # zero failed requests: every stream complete, nothing aborted at the removed decoder
    assert len(results) > 30
    for status, body, _ in results:
        assert status == 200, body
        events = [e for e in body.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and "tok5" in events[-2]
    assert decoders[0].aborted == 0 and router.metrics.retries.get() == 0
    assert decoders[0].finished_streams == len(decoders[0].requests) == decided
    assert after == decided  # nothing new went to it once it drained
    assert {d for _, _, d in results} == {"w-code", "w-other", "w-new"}
    # one consistent state: pool, tracker, policy, snapshot, config
    assert [i.name for i in router.pool.decode] == ["w-other", "w-new"]
    assert [i.index for i in router.pool.decode] == [0, 1]
    assert router.state.worker_names == ("w-other", "w-new")
    assert router.state.policy.num_workers == 2 and router.pool.tracker.loads.shape == (2,)
    assert router.config.decode_urls == urls
    assert router.config.decode_ids == ("w-other", "w-new")
    assert gone.removed and gone.in_flight == 0
    if policy == "eldr_cost":
        assert len(router.state.policy.footprint) == 0  # every request released
    for action in ("added", "draining", "removed"):
        assert f'eldr_decoder_pool_changes_total{{action="{action}"}} 1.0' in page
    assert 'eldr_decoder_in_flight{decoder="w-code"}' not in page
    assert 'eldr_decoder_draining{decoder="w-new"} 0.0' in page
    assert 'eldr_routing_decisions_total{decoder="w-new",policy="' in page


def test_a_new_band_decoder_splits_the_busiest_cluster():
    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN) as (router, client, _p, _d):
            for _ in range(3):  # 'code' prompts: w-code's cluster is the busiest
                assert (await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": "write code"})).status == 200
            extra = await FakeEngine("d2").start()
            status = (await client.post("/admin/decoders", json={"url": extra.url},
                                        headers=AUTH)).status
            centroids = router.state.policy.centroids.copy()
            await extra.close()
            return status, centroids, router.state.worker_names

    status, centroids, names = run(go())
    assert status == 201 and names == ("w-code", "w-other", "decode-0")
    np.testing.assert_array_equal(centroids[2], centroids[0])


def test_remove_while_waiting_answers_once_removed():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN, engine_kw={"tokens": 10}) as (
                router, client, _p, decoders):
            decoders[0].mode = "slow"
            stream = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": "x", "stream": True})
            first = await stream.content.readany()  # the request is running at w-code
            waiting = asyncio.ensure_future(client.delete("/admin/decoders/w-code?wait=true",
                                                          headers=AUTH))
            await asyncio.sleep(0.1)
            early = waiting.done()
            rest = await stream.read()
            r = await waiting
            return early, first + rest, await _json(r), router

    early, body, (status, doc), _router = run(go())
    assert not early  # it waited for the request in flight
    assert body.decode().rstrip().endswith("data: [DONE]")
    assert status == 200 and doc["removed"] == "w-code"
    assert [d["name"] for d in doc["decoders"]] == ["w-other"]


def test_a_new_decoder_that_is_down_gets_no_request_until_healthy():
    async def go():
        async with cluster(policy="round_robin", admin_token=TOKEN) as (router, client, _p,
                                                                         _decoders):
            extra = await FakeEngine("d2").start()
            extra.healthy = False
            status, doc = await _json(await client.post(
                "/admin/decoders", json={"url": extra.url, "name": "late"}, headers=AUTH))
            statuses = [(await client.post("/v1/completions", json={
                "model": "tiny", "prompt": f"p{i}"})).status for i in range(6)]
            before = len(extra.requests)
            extra.healthy = True
            await until(lambda: router.pool.decode[-1].healthy,
                        "a health round (every 0.05 s here) takes it in")
            for i in range(6):
                await client.post("/v1/completions", json={"model": "tiny", "prompt": f"q{i}"})
            after = len(extra.requests)
            await extra.close()
            return status, doc, statuses, before, after

    status, doc, statuses, before, after = run(go())
    assert status == 201 and doc["added"]["healthy"] is False
    assert statuses == [200] * 6 and before == 0 and after > 0


def test_admin_decoders_needs_the_token():
    async def go():
        async with cluster(admin_token=TOKEN) as (_r, client, _p, _d):
            missing = await _json(await client.get("/admin/decoders"))
            wrong = await _json(await client.post("/admin/decoders", json={"url": "http://h:1"},
                                                  headers={"Authorization": "Bearer nope-nope"}))
            delete = await _json(await client.delete("/admin/decoders/w-code"))
        async with cluster() as (router, client, _p, _d):  # no token configured
            disabled = await _json(await client.get("/admin/decoders", headers=AUTH))
            names = router.state.worker_names
        return missing, wrong, delete, disabled, names

    missing, wrong, delete, disabled, names = run(go())
    assert missing[0] == wrong[0] == delete[0] == 401
    assert "admin token" in missing[1]["error"]["message"]
    assert disabled[0] == 403 and "disabled" in disabled[1]["error"]["message"]
    assert names == ("w-code", "w-other")


@pytest.mark.parametrize("method, path, body, status, says", [
    ("POST", "/admin/decoders", b"{not json", 400, "not valid JSON"),
    ("POST", "/admin/decoders", b"[1]", 400, "must be a JSON object"),
    ("POST", "/admin/decoders", b"{}", 400, "'url' is required"),
    ("POST", "/admin/decoders", b'{"url": 5}', 400, "must be a string"),
    ("POST", "/admin/decoders", b'{"url": "ftp://h:1"}', 400, "http://HOST:PORT"),
    ("POST", "/admin/decoders", b'{"url": "http://h:1", "port": 1}', 400, "unknown field"),
    ("POST", "/admin/decoders", b'{"url": "http://h:1", "name": "a b"}', 400, "'name' must"),
    ("POST", "/admin/decoders", b'{"url": "http://h:1", "name": "w-code"}', 409,
     "already in the pool"),
    ("POST", "/admin/decoders", b'{"url": "DECODER0"}', 409, "already in the pool"),
    ("DELETE", "/admin/decoders/nobody", b"", 404, "no decoder named 'nobody'"),
    ("DELETE", "/admin/decoders/w-code?wait=soon", b"", 400, "'wait' must be"),
    ("PUT", "/admin/decoders", b"{}", 405, "Method Not Allowed"),
    ("GET", "/admin/decoders/w-code", b"", 405, "Method Not Allowed"),
])
def test_bad_admin_decoder_requests_get_a_clear_4xx(method, path, body, status, says):
    async def go():
        async with cluster(admin_token=TOKEN) as (router, client, _p, decoders):
            data = body.replace(b"DECODER0", decoders[0].url.encode())
            r = await client.request(method, path, data=data, headers=AUTH)
            return r.status, await r.read(), router.state.worker_names, len(router.pool.decode)

    got, raw, names, count = run(go())
    assert got == status, raw
    doc = json.loads(raw)
    assert says in (doc["detail"] if status == 405 else doc["error"]["message"])
    assert names == ("w-code", "w-other") and count == 2  # nothing changed


def test_the_last_decoder_taking_requests_cannot_be_removed():
    async def go():
        async with cluster(admin_token=TOKEN, engine_kw={"tokens": 10}) as (
                router, client, _p, decoders):
            decoders[0].mode = "slow"
            stream = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": "write code", "stream": True})
            await stream.content.readany()  # w-code is busy: its drain lasts a while
            first = await _json(await client.delete("/admin/decoders/w-code", headers=AUTH))
            again = await _json(await client.delete("/admin/decoders/w-code", headers=AUTH))
            last = await _json(await client.delete("/admin/decoders/w-other", headers=AUTH))
            await stream.read()
            await _gone(client, "w-code")
            only = await _json(await client.delete("/admin/decoders/w-other", headers=AUTH))
            return first, again, last, only, router.state.worker_names

    first, again, last, only, names = run(go())
    assert first[0] == again[0] == 202  # asking twice joins the drain already running
    assert last[0] == only[0] == 409 and "last decoder" in last[1]["error"]["message"]
    assert "last decoder" in only[1]["error"]["message"]
    assert names == ("w-other",)


def test_an_artifact_for_another_decoder_set_is_refused_with_409(monkeypatch):
    def mismatch(config):
        raise WorkerMismatch("decode worker ids ['a', 'b', 'c'] do not match the artifact's "
                             "['a', 'b']")

    async def go():
        async with cluster(admin_token=TOKEN) as (_router, client, _p, _d):
            monkeypatch.setattr(admin_mod, "build_state", mismatch)
            return await _json(await client.post("/admin/reload", headers=AUTH))

    status, doc = run(go())
    assert status == 409 and "do not match the artifact" in doc["error"]["message"]


def test_the_learner_hears_of_every_change():
    heard = []

    class Learner:
        async def start(self):
            pass

        async def stop(self):
            pass

        def on_pool_change(self, names):
            heard.append(names)

    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (router, client, _p, _d):
            router.attach_learner(Learner())
            extra = await FakeEngine("d2").start()
            await client.post("/admin/decoders", json={"url": extra.url}, headers=AUTH)
            await client.delete("/admin/decoders/w-code?wait=1", headers=AUTH)
            await extra.close()

    run(go())
    assert heard == [("w-code", "w-other", "decode-0"), ("w-other", "decode-0")]


@pytest.mark.parametrize("text, says", [
    ("", "lists no decoder"),
    ("# only a comment\n", "lists no decoder"),
    ("http://d:1\nnot a url\n", "line 2"),
    ("a=http://d:1\nhttp://d:2\n", "on every line"),
    ("http://d:1\nhttp://d:1/\n", "URL is listed twice"),
    ("a=http://d:1\na=http://d:2\n", "id is listed twice"),
    ("a b=http://d:1\n", "line 1"),
])
def test_a_bad_decoders_file_is_refused_with_its_line(tmp_path, text, says):
    path = tmp_path / "decoders"
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        read_decoders_file(str(path))


def test_sighup_syncs_the_pool_to_the_decoders_file(tmp_path):
    import dataclasses

    from eldr.proxy.serving import hangup as _hangup

    path = tmp_path / "decoders"
    reloads = []

    async def reload():
        reloads.append(router_ref[0].state.worker_names)

    router_ref = []

    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (router, client, _p, decoders):
            router_ref.append(router)
            extra = await FakeEngine("d2").start()
            router.swap(router.state, dataclasses.replace(router.config,
                                                          decoders_file=str(path)))
            router.reload = reload  # a spy: what SIGHUP reloads
            path.write_text(f"w-other={decoders[1].url}\nw-new={extra.url}\n")
            await _hangup(router)
            after_add = router.state.worker_names
            await _gone(client, "w-code")
            path.write_text("garbage\n")  # a bad file changes nothing, and is logged
            await _hangup(router)
            status = (await client.post("/v1/completions", json={"model": "tiny",
                                                                  "prompt": "x"})).status
            names = router.state.worker_names
            await extra.close()
            return after_add, names, status

    after_add, names, status = run(go())
    assert after_add == ("w-code", "w-other", "w-new")  # w-code drains, still listed
    assert names == ("w-other", "w-new") and status == 200
    assert len(reloads) == 2  # the artifact reload follows each time


def test_a_removal_that_fails_says_so_and_leaves_the_decoder_draining():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (router, client, _p, _d):
            def broken(worker):
                raise RuntimeError("a bug")

            router.state.policy.remove_worker = broken
            status, doc = await _json(await client.delete("/admin/decoders/w-code?wait=true",
                                                          headers=AUTH))
            served = (await client.post("/v1/completions", json={"model": "tiny",
                                                                 "prompt": "x"}))
            return status, doc, served.status, served.headers["X-Eldr-Decoder"], \
                router.pool.decode[0].draining

    status, doc, served, decoder, draining = run(go())
    assert status == 500 and "stays draining" in doc["error"]["message"]
    assert served == 200 and decoder == "w-other" and draining
