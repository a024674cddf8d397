"""The decode-selection API (eldr.proxy.selection) on a router in front of stand-in engines:
whole reservation lives (select, reserve, prefill complete, release; failure; abandonment
and expiry), its state the proxy's own (the proxy routes around reservations, selections
around the proxy's requests, /health and /metrics show both), the workers of
``--workers N`` sharing it, and every bad request answered with a clear 4xx."""

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from _prompt_data import two_domain_trace
from _proxy_fakes import FakeEngine, cluster, domain_counts, run, until
from eldr.capture.payload import encode_counts
from eldr.proxy.selection import SelectionTable
from eldr.proxy.selection import service as selection_service
from eldr.proxy.workers import SharedLoads, WorkerShare

TOKEN = "selection-token-1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _json(resp):
    return resp.status, await resp.json()


async def _post(client, path, body=None, **kw):
    return await _json(await client.post(path, json=body, headers=AUTH, **kw))


async def _get(client, path):
    return await _json(await client.get(path, headers=AUTH))


async def _loads(client) -> dict[str, float]:
    _, doc = await _json(await client.get("/health"))
    return {d["name"]: d["load"] for d in doc["decode"]}


async def _metrics(client, *series) -> dict[str, float]:
    """The value of each series (``name{label="v",...}`` as the page prints it); a series
    the page lacks is left out."""
    text = await (await client.get("/metrics")).text()
    out = {}
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key in series:
            out[key] = float(value)
    return {s: out[s] for s in series if s in out}


def _payload(prompt: str) -> dict:
    return {**encode_counts(domain_counts(prompt)), "tokens": 5}


def test_a_whole_reservation_life_is_load_for_the_proxy_until_released():
    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN) as (_r, client, _p, _d):
            seen = {"start": await _loads(client)}
            status, doc = await _post(client, "/v1/eldr/reserve",
                                      {"eldr": _payload("write code"), "prompt_tokens": 5,
                                       "request_id": "client-7"})
            rid = doc["reservation"]["id"]
            seen["reserved"] = await _loads(client)
            seen["workers"] = (await _get(client, "/v1/eldr/workers"))[1]["workers"]
            seen["metrics"] = await _metrics(
                client, 'eldr_decoder_in_flight{decoder="w-code"}',
                'eldr_selection_reservations_active{decoder="w-code"}',
                'eldr_selection_decisions_total{decoder="w-code",input="payload"}')
            seen["prefill"] = await _post(client, f"/v1/eldr/reservations/{rid}/"
                                                  f"prefill_complete", {"ttl": 30})
            seen["get"] = await _get(client, f"/v1/eldr/reservations/{rid}")
            seen["release"] = await _post(client, f"/v1/eldr/reservations/{rid}/release",
                                          {"outcome": "completed"})
            seen["after"] = await _loads(client)
            seen["events"] = await _metrics(
                client, *(f'eldr_selection_reservations_total{{event="{e}"}}'
                          for e in ("reserved", "prefill_complete", "completed", "expired")),
                'eldr_selection_reservations_active{decoder="w-code"}')
            seen["again"] = await _post(client, f"/v1/eldr/reservations/{rid}/release")
            return status, doc, seen

    status, doc, seen = run(go())
    assert status == 201
    assert doc["worker"] == "w-code" and doc["input"] == "payload" and doc["fallback"] is None
    assert doc["request_id"] == "client-7" and doc["load"] == 1.0
    assert doc["reservation"]["state"] == "active" and not doc["reservation"]["prefill_complete"]
    assert seen["start"] == {"w-code": 0.0, "w-other": 0.0}
    assert seen["reserved"] == {"w-code": 1.0, "w-other": 0.0}
    assert [(w["name"], w["load"], w["reservations"]) for w in seen["workers"]] == \
        [("w-code", 1.0, 1), ("w-other", 0.0, 0)]
    assert set(seen["metrics"].values()) == {1.0}
    assert seen["prefill"][0] == 200 and seen["prefill"][1]["reservation"]["prefill_complete"]
    assert seen["get"][1]["reservation"]["state"] == "active"
    assert seen["release"][0] == 200
    assert seen["release"][1]["reservation"]["outcome"] == "completed"
    assert seen["after"] == {"w-code": 0.0, "w-other": 0.0}
    assert list(seen["events"].values()) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert seen["again"][0] == 409 and "has ended (completed)" in \
        seen["again"][1]["error"]["message"]


def test_the_proxy_routes_around_reservations_and_selections_around_its_requests():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (_r, client, _p, decoders):
            for _ in range(2):
                await _post(client, "/v1/eldr/reserve", {"candidates": ["w-code"]})
            resp = await client.post("/v1/completions",
                                     json={"model": "tiny", "prompt": "hello there"})
            proxy_went = resp.headers["X-Eldr-Decoder"]
            await resp.read()
            # now a proxy request held at w-other: a selection counts it
            decoders[1].hold = asyncio.Event()
            pending = asyncio.ensure_future(client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hello again"}))
            while not decoders[1].requests[1:]:
                await asyncio.sleep(0.01)
            _, chosen = await _post(client, "/v1/eldr/select", {})
            decoders[1].hold.set()
            await (await pending).read()
            return proxy_went, chosen

    proxy_went, chosen = run(go())
    assert proxy_went == "w-other"  # w-code holds two reservations
    assert chosen["loads"] == {"w-code": 2.0, "w-other": 1.0}
    assert chosen["worker"] == "w-other" and "reservation" not in chosen  # 1 < 2: select only


def test_a_failed_request_is_released_to_the_policy_as_failed():
    async def go():
        async with cluster(policy="eldr_cost", admin_token=TOKEN) as (router, client, _p, _d):
            _, doc = await _post(client, "/v1/eldr/reserve",
                                 {"eldr": _payload("code"), "prompt_tokens": 5})
            rid = doc["reservation"]["id"]
            footprint = router.state.policy.footprint
            held = int(footprint.count.sum()) if footprint is not None else None
            released = await _post(client, f"/v1/eldr/reservations/{rid}/release",
                                   {"outcome": "failed"})
            after = int(footprint.count.sum()) if footprint is not None else None
            counted = await _metrics(client, 'eldr_selection_reservations_total{event="failed"}')
            return doc, held, released, after, counted, await _loads(client)

    doc, held, released, after, counted, loads = run(go())
    assert doc["input"] == "payload"
    if held is not None:  # eldr_cost keeps the reservation's experts until its release
        assert (held, after) == (1, 0)
    assert released[1]["reservation"]["outcome"] == "failed"
    assert list(counted.values()) == [1.0]
    assert set(loads.values()) == {0.0}


def test_an_abandoned_reservation_expires_and_is_counted():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (router, client, _p, _d):
            # the deadlines' clock is moved by hand: on a loaded machine 0.05 s can pass
            # between the second reserve and its prefill_complete, and it expired first
            sel = router.selection.selection
            now = [time.monotonic()]
            sel.clock = lambda: now[0]
            _, short = await _post(client, "/v1/eldr/reserve", {"ttl": 0.05})
            _, long = await _post(client, "/v1/eldr/reserve", {"ttl": 0.05})
            lid = long["reservation"]["id"]
            extended = await _post(client, f"/v1/eldr/reservations/{lid}/prefill_complete",
                                   {"ttl": 60})
            now[0] += 1.0  # past the short one's deadline, not the extended one's
            await until(lambda: len(sel._held) == 1, "a sweep expired the short one")
            sid = short["reservation"]["id"]
            state = await _get(client, f"/v1/eldr/reservations/{sid}")
            late = await _post(client, f"/v1/eldr/reservations/{sid}/release")
            late_prefill = await _post(client, f"/v1/eldr/reservations/{sid}/prefill_complete")
            still = await _get(client, f"/v1/eldr/reservations/{lid}")
            expired = await _metrics(client, 'eldr_selection_reservations_total{event="expired"}')
            return extended, state, late, late_prefill, still, expired, await _loads(client)

    extended, state, late, late_prefill, still, expired, loads = run(go())
    assert extended[0] == 200
    assert state[1]["reservation"]["state"] == "ended"
    assert state[1]["reservation"]["outcome"] == "expired"
    assert late[0] == late_prefill[0] == 410 and "expired" in late[1]["error"]["message"]
    assert still[1]["reservation"]["state"] == "active"  # prefill complete: 60 s more
    assert list(expired.values()) == [1.0]
    assert sorted(loads.values()) == [0.0, 1.0]  # only the extended one holds a decoder


def test_selection_on_the_signature_payload_follows_the_policy():
    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN) as (_r, client, _p, _d):
            code = await _post(client, "/v1/eldr/select",
                               {"kv_transfer_params": {"eldr": _payload("code"),
                                                       "remote_engine_id": "x"}})
            law = await _post(client, "/v1/eldr/select", {"eldr": _payload("law")})
            among = await _post(client, "/v1/eldr/select",
                                {"eldr": _payload("code"), "candidates": ["w-other"]})
            return code, law, among

    code, law, among = run(go())
    assert (code[1]["worker"], law[1]["worker"], among[1]["worker"]) == \
        ("w-code", "w-other", "w-other")
    assert code[1]["input"] == "payload" and code[1]["band_size"] is not None


def test_token_ids_use_the_prompt_predictor_and_fall_back_by_load_without_one(monkeypatch):
    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN) as (router, client, _p, _d):
            without = await _post(client, "/v1/eldr/select", {"token_ids": [1, 2, 3]})
            fallbacks = await _metrics(
                client, 'eldr_selection_fallbacks_total{reason="no_prompt_predictor"}')
            encoder = router.state.encoder

            def predict(ids):  # a stand-in predictor: odd first id -> code, even -> law
                if ids[0] >= 100:
                    raise ValueError(f"token id {int(ids[0])} is outside the vocabulary [0, 100)")
                counts = domain_counts("code" if ids[0] % 2 else "law")
                return encoder.transform_one(counts), None

            monkeypatch.setattr(selection_service, "_prompt_predict", lambda state: predict)
            odd = await _post(client, "/v1/eldr/select", {"token_ids": [1, 2, 3]})
            even = await _post(client, "/v1/eldr/reserve", {"token_ids": [2, 2, 3]})
            unknown = await _post(client, "/v1/eldr/select", {"token_ids": [100]})
            # a payload wins over a prediction (the real prefill signature)
            both = await _post(client, "/v1/eldr/select",
                               {"token_ids": [2], "eldr": _payload("code")})
            return without, fallbacks, odd, even, unknown, both

    without, fallbacks, odd, even, unknown, both = run(go())
    assert without[0] == 200 and without[1]["fallback"] == "no_prompt_predictor"
    assert list(fallbacks.values()) == [1.0]
    assert (odd[1]["worker"], odd[1]["input"], odd[1]["fallback"]) == \
        ("w-code", "token_ids", None)
    assert even[0] == 201 and even[1]["worker"] == "w-other"
    assert unknown[0] == 400 and "outside the vocabulary" in unknown[1]["error"]["message"]
    assert (both[1]["worker"], both[1]["input"]) == ("w-code", "payload")


def test_workers_of_several_processes_share_reservations_and_loads():
    """Two routers as two workers of --workers 2: one load table, one reservation table.
    A reservation made at worker 0 is load at worker 1; released at worker 1, it leaves the
    loads once worker 0 sweeps (its owner: the only writer of its row)."""
    loads_table = SharedLoads(num_workers=2, capacity=4)
    reservations = SelectionTable(2)

    async def go():
        share0 = WorkerShare(loads_table, 0, (0, 1))
        share1 = WorkerShare(loads_table, 1, (0, 1))
        async with cluster(policy="jsq", admin_token=TOKEN, share=share0) as (r0, c0, _p, _d), \
                cluster(policy="jsq", admin_token=TOKEN, share=share1) as (r1, c1, _q, _e):
            r0.selection.share(reservations, 0)
            r1.selection.share(reservations, 1)
            _, doc = await _post(c0, "/v1/eldr/reserve", {"candidates": ["w-other"]})
            rid = doc["reservation"]["id"]
            seen = {"at1": await _loads(c1), "get1": await _get(c1, f"/v1/eldr/reservations/{rid}"),
                    "workers1": (await _get(c1, "/v1/eldr/workers"))[1]["workers"]}
            resp = await c1.post("/v1/completions", json={"model": "tiny", "prompt": "hi you"})
            seen["proxy1"] = resp.headers["X-Eldr-Decoder"]
            await resp.read()
            seen["release1"] = await _post(c1, f"/v1/eldr/reservations/{rid}/release",
                                           {"outcome": "cancelled"})
            seen["again0"] = await _post(c0, f"/v1/eldr/reservations/{rid}/release")
            # worker 0's sweep applies worker 1's release (waited for, not a fixed time: a
            # loaded machine may not sweep within one)
            await until(lambda: not r0.selection.selection._held, "worker 0's sweep")
            seen["after0"], seen["after1"] = await _loads(c0), await _loads(c1)
            seen["cancelled0"] = await _metrics(
                c0, 'eldr_selection_reservations_total{event="cancelled"}')
            return seen

    seen = run(go())
    assert seen["at1"] == {"w-code": 0.0, "w-other": 1.0}
    assert seen["get1"][1]["reservation"]["worker"] == "w-other"
    assert [w["reservations"] for w in seen["workers1"]] == [0, 1]
    assert seen["proxy1"] == "w-code"  # worker 1's proxy sees worker 0's reservation
    assert seen["release1"][0] == 200
    assert seen["again0"][0] == 409
    assert seen["after0"] == seen["after1"] == {"w-code": 0.0, "w-other": 0.0}
    assert list(seen["cancelled0"].values()) == [1.0]  # counted by the owner


def test_registering_and_removing_a_worker_go_through_the_elastic_pool():
    async def go():
        extra = await FakeEngine("d-new").start()
        try:
            async with cluster(policy="jsq", admin_token=TOKEN) as (router, client, _p, _d):
                added = await _post(client, "/v1/eldr/workers",
                                    {"url": extra.url, "name": "w-new"})
                for _ in range(200):
                    if router.pool.decode[-1].healthy:
                        break
                    await asyncio.sleep(0.02)
                chosen = await _post(client, "/v1/eldr/reserve", {"candidates": ["w-new"]})
                removed = await _json(await client.delete("/v1/eldr/workers/w-new",
                                                          headers=AUTH))
                rid = chosen[1]["reservation"]["id"]
                await _post(client, f"/v1/eldr/reservations/{rid}/release")
                for _ in range(200):  # the drain waited for the reservation
                    if all(i.name != "w-new" for i in router.pool.decode):
                        break
                    await asyncio.sleep(0.02)
                names = [i.name for i in router.pool.decode]
                return added, chosen, removed, names
        finally:
            await extra.close()

    added, chosen, removed, names = run(go())
    assert added[0] == 201 and added[1]["added"]["name"] == "w-new"
    assert chosen[0] == 201 and chosen[1]["worker"] == "w-new"
    assert removed[0] == 202 and removed[1]["in_flight"] == 1  # its reservation
    assert names == ["w-code", "w-other"]


def test_a_full_reservation_table_is_a_429_not_a_5xx():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (router, client, _p, _d):
            router.selection.share(SelectionTable(1, 2), 0)
            return [await _post(client, "/v1/eldr/reserve", {}) for _ in range(3)]

    answers = run(go())
    assert [s for s, _ in answers] == [201, 201, 429]
    assert "release reservations" in answers[2][1]["error"]["message"]


@pytest.mark.parametrize("method, path, body, status, says", [
    ("POST", "/v1/eldr/select", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/eldr/select", b"", 400, "must be a JSON object"),
    ("POST", "/v1/eldr/select", b"[1]", 400, "must be a JSON object"),
    ("POST", "/v1/eldr/select", b'{"text": "hi"}', 400, "unknown field(s) ['text']"),
    ("POST", "/v1/eldr/select", b'{"prompt": ""}', 400, "'prompt' must be a non-empty"),
    ("POST", "/v1/eldr/select", b'{"prompt": "a", "token_ids": [1]}', 400,
     "'prompt' cannot be given with 'token_ids'"),
    ("POST", "/v1/eldr/select", b'{"messages": "hi"}', 400, "list of chat messages"),
    ("POST", "/v1/eldr/select", b'{"ttl": 5}', 400, "unknown field(s) ['ttl']"),
    ("POST", "/v1/eldr/select", b'{"token_ids": []}', 400, "non-empty list"),
    ("POST", "/v1/eldr/select", b'{"token_ids": "1 2"}', 400, "non-empty list"),
    ("POST", "/v1/eldr/select", b'{"token_ids": [1, -2]}', 400, "found -2"),
    ("POST", "/v1/eldr/select", b'{"token_ids": [1, 2.5]}', 400, "found 2.5"),
    ("POST", "/v1/eldr/select", b'{"token_ids": [true]}', 400, "found True"),
    ("POST", "/v1/eldr/select", b'{"eldr": [1, 2]}', 400, "'eldr' must be an object"),
    ("POST", "/v1/eldr/select", b'{"eldr": {"shape": "x"}}', 400, "not a valid eldr payload"),
    ("POST", "/v1/eldr/select", b'{"eldr": {"v": 1, "shape": [3, 8], "counts": ""}}', 400,
     "(layers, experts) = [3, 8]"),
    ("POST", "/v1/eldr/select", b'{"kv_transfer_params": 3}', 400, "must be an object"),
    ("POST", "/v1/eldr/select", b'{"eldr": {}, "kv_transfer_params": {"eldr": {}}}', 400,
     "given twice"),
    ("POST", "/v1/eldr/select", b'{"prompt_tokens": -1}', 400, "integer >= 0"),
    ("POST", "/v1/eldr/select", b'{"candidates": []}', 400, "non-empty list of worker names"),
    ("POST", "/v1/eldr/select", b'{"candidates": ["w-code", "nobody"]}', 400,
     "unknown worker(s) ['nobody']"),
    ("POST", "/v1/eldr/reserve", b'{"ttl": 0}', 400, "'ttl' must be a number of seconds > 0"),
    ("POST", "/v1/eldr/reserve", b'{"ttl": "5"}', 400, "'ttl' must be a number"),
    ("POST", "/v1/eldr/reserve", b'{"ttl": 1e9}', 400, "'ttl' must be <= 3600"),
    ("POST", "/v1/eldr/reserve", b'{"request_id": 5}', 400, "'request_id' must be a string"),
    ("GET", "/v1/eldr/reservations/nope", b"", 404, "no reservation 'nope'"),
    ("GET", "/v1/eldr/reservations/res-1-0-0-1", b"", 404, "no reservation"),
    ("POST", "/v1/eldr/reservations/nope/release", b"", 404, "no reservation 'nope'"),
    ("POST", "/v1/eldr/reservations/nope/prefill_complete", b"", 404, "no reservation"),
    ("POST", "/v1/eldr/reservations/nope/renew", b"", 404, "prefill_complete and release"),
    ("POST", "/v1/eldr/reservations/RID/release", b'{"outcome": "done"}', 400,
     "'outcome' must be completed, failed or cancelled"),
    ("POST", "/v1/eldr/reservations/RID/release", b'{"outcome": 1}', 400, "must be a string"),
    ("POST", "/v1/eldr/reservations/RID/release", b'{"why": "x"}', 400, "unknown field(s)"),
    ("POST", "/v1/eldr/reservations/RID/prefill_complete", b'{"ttl": -1}', 400, "'ttl'"),
    ("DELETE", "/v1/eldr/workers/nobody", b"", 404, "no decoder named 'nobody'"),
    ("POST", "/v1/eldr/workers", b'{"url": "ftp://h:1"}', 400, "http://HOST:PORT"),
    ("POST", "/v1/eldr/nothing", b"{}", 404, "the selection API has"),
    ("GET", "/v1/eldr/select", b"", 405, "Method Not Allowed"),
    ("PUT", "/v1/eldr/workers", b"{}", 405, "Method Not Allowed"),
    ("PUT", "/v1/eldr/reservations/RID", b"", 405, "Method Not Allowed"),
    ("DELETE", "/v1/eldr/reservations/RID?outcome=done", b"", 400, "'outcome' must be"),
    ("DELETE", "/v1/eldr/reservations/RID?why=x", b"", 400, "unknown query parameter(s)"),
])
def test_bad_selection_requests_get_a_clear_4xx(method, path, body, status, says):
    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN) as (_r, client, _p, _d):
            if "RID" in path:
                _, doc = await _post(client, "/v1/eldr/reserve", {})
                path_ = path.replace("RID", doc["reservation"]["id"])
            else:
                path_ = path
            resp = await client.request(method, path_, data=body,
                                        headers={**AUTH, "Content-Type": "application/json"})
            return resp.status, await resp.text()

    got, text = run(go())
    assert got == status, text
    assert says in text


def test_every_route_needs_the_admin_token():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (_r, client, _p, _d):
            missing = [(await client.request(m, p, json={})).status for m, p in (
                ("POST", "/v1/eldr/select"), ("POST", "/v1/eldr/reserve"),
                ("GET", "/v1/eldr/workers"), ("POST", "/v1/eldr/workers"),
                ("DELETE", "/v1/eldr/workers/w-code"),
                ("GET", "/v1/eldr/reservations/x"),
                ("POST", "/v1/eldr/reservations/x/release"))]
        async with cluster(policy="jsq") as (_r, client, _p, _d):  # no token configured
            disabled = await _json(await client.post("/v1/eldr/select", json={},
                                                     headers=AUTH))
        return missing, disabled

    missing, disabled = run(go())
    assert missing[:5] == [401] * 5  # then 429: too many wrong tokens from one address
    assert set(missing[5:]) == {429}
    assert disabled[0] == 403 and "disabled" in disabled[1]["error"]["message"]


def test_stopping_the_router_releases_what_it_held():
    async def go():
        async with cluster(policy="eldr_cost", admin_token=TOKEN) as (router, client, _p, _d):
            await _post(client, "/v1/eldr/reserve", {"eldr": _payload("code")})
            sel = router.selection.selection
        return sel.num_active(), router.pool.tracker.loads.tolist()

    active, loads = run(go())
    assert active == 0 and loads == [0.0, 0.0]


def test_a_real_prompt_predictor_selects_on_token_ids_and_on_text(tmp_path):
    art_mod = pytest.importorskip("eldr.fit.artifact")
    pytest.importorskip("tokenizers")
    from eldr.proxy.request.decision import build_state
    from eldr.proxy.request.prompts import PromptTokenizer, tokenizer_dir_for

    tiny = tokenizer_dir_for("tiny_moe")
    art = art_mod.fit_artifact(two_domain_trace(), worker_ids=("w-code", "w-other"),
                               tau=0.0, tokenizer=tiny, random_state=0)
    if getattr(art, "prompt_predictor", None) is None:
        pytest.skip("this eldr fits no prompt predictor")
    art_mod.save(art, tmp_path / "artifact")
    prompts = [list(range(i, i + 12)) for i in (0, 45, 20, 60)]
    text = "def add(a, b): return a + b"
    text_ids = PromptTokenizer(tiny).encode(text, add_special_tokens=True)

    def nearest(ids) -> str:
        sig, _ = art.route_inputs_from_prompt(np.asarray(ids))
        return ("w-code", "w-other")[int(np.argmax(np.asarray(art.centroids) @
                                                   np.asarray(sig).reshape(-1)))]

    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN) as (router, client, _p, _d):
            config = dataclasses.replace(router.config, artifact=str(tmp_path / "artifact"),
                                         tokenizer=tiny)
            router.swap(build_state(config), config)
            ids = [(await _post(client, "/v1/eldr/select", {"token_ids": p}))[1]
                   for p in prompts]
            by_text = await _post(client, "/v1/eldr/reserve", {"prompt": text})
            outside = await _post(client, "/v1/eldr/select", {"token_ids": [10 ** 9]})
            return ids, by_text, outside

    ids, by_text, outside = run(go())
    assert [d["worker"] for d in ids] == [nearest(p) for p in prompts]
    assert {d["worker"] for d in ids} == {"w-code", "w-other"}
    assert all(d["input"] == "token_ids" and d["fallback"] is None for d in ids)
    assert by_text[0] == 201 and by_text[1]["input"] == "prompt"
    assert by_text[1]["worker"] == nearest(text_ids)
    assert outside[0] == 400 and "cannot be routed" in outside[1]["error"]["message"]


def test_dynamo_style_names_select_and_reserve_and_delete_a_reservation():
    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN) as (_r, client, _p, _d):
            status, doc = await _post(client, "/v1/eldr/select_and_reserve", {})
            rid = doc["reservation"]["id"]
            held = await _loads(client)
            deleted = await _json(await client.delete(
                f"/v1/eldr/reservations/{rid}?outcome=failed", headers=AUTH))
            failed = await _metrics(client, 'eldr_selection_reservations_total{event="failed"}')
            return status, held, deleted, failed, await _loads(client)

    status, held, deleted, failed, after = run(go())
    assert status == 201 and sorted(held.values()) == [0.0, 1.0]
    assert deleted[0] == 200 and deleted[1]["reservation"]["outcome"] == "failed"
    assert list(failed.values()) == [1.0]
    assert set(after.values()) == {0.0}


def test_eldr_serve_workers_2_count_each_reservation_once_wherever_it_is_released(tmp_path):
    """Real ``eldr serve --workers 2`` processes (stand-in engines): each call on a new
    connection, so reservations are made at both workers and released at either; the load
    and reservation counts every worker answers are the same, and none is left."""
    import json as _json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    def call(base, method, path, body=None):
        req = urllib.request.Request(base + path, method=method, headers=AUTH,
                                     data=None if body is None else _json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, _json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json.loads(exc.read())

    def views(base, n=8):  # what n connections (either worker) answer
        return {tuple((w["load"], w["reservations"]) for w in call(
            base, "GET", "/v1/eldr/workers")[1]["workers"]) for _ in range(n)}

    async def go():
        engines = [await FakeEngine(n).start() for n in ("p", "d0", "d1")]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        log = open(tmp_path / "serve.log", "w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "eldr", "serve", "--port", str(port), "--workers", "2",
             "--policy", "jsq", "--prefill", engines[0].url, "--decode", engines[1].url,
             "--decode", engines[2].url, "--health-interval", "0.2"], stderr=log,
            env={**os.environ, "ELDR_ADMIN_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 60
            while open(log.name).read().count("listening on") < 2:
                assert time.monotonic() < deadline and proc.poll() is None, \
                    open(log.name).read()
                await asyncio.sleep(0.1)
            rids = []
            for _ in range(12):
                status, doc = await asyncio.to_thread(call, base, "POST", "/v1/eldr/reserve",
                                                     {})
                assert status == 201, doc
                rids.append(doc["reservation"]["id"])
            held = await asyncio.to_thread(views, base)
            for rid in rids:
                status, doc = await asyncio.to_thread(
                    call, base, "POST", f"/v1/eldr/reservations/{rid}/release")
                assert status == 200, doc
            # the owners' sweeps apply the releases: waited for (up to 20 s), not a fixed
            # time a loaded machine may not sweep within
            deadline = time.monotonic() + 20
            while (after := await asyncio.to_thread(views, base)) != {((0.0, 0), (0.0, 0))} \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return rids, held, after
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 15)
            log.close()
            for e in engines:
                await e.close()

    rids, held, after = run(go())
    assert {rid.split("-")[2] for rid in rids} == {"0", "1"}  # made at both workers
    assert held == {((6.0, 6), (6.0, 6))}  # jsq alternates; both workers see all 12
    assert after == {((0.0, 0), (0.0, 0))}
