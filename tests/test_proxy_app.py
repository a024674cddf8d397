import asyncio
import dataclasses
import json

import pytest

from _proxy_fakes import cluster, fake_centroids, run
from eldr.proxy.bodies import parse_body
from eldr.proxy.control import admin as admin_mod
from eldr.proxy.errors import ProxyError
from eldr.routing import make_policy

CODE = {"model": "tiny", "prompt": "write code now"}
TOKEN = "s3cret-token"
DEEP_974 = b'{"prompt":"x","x":' + b"[" * 974 + b"]" * 974 + b"}"
DEEP_50K = b'{"prompt":"x","x":' + b"[" * 50_000 + b"]" * 50_000 + b"}"


@pytest.mark.parametrize("raw, kind, status, match", [  # vLLM's messages (test_proxy_bodies)
    (b"{not json", "completions", 400, "json_invalid"),
    (b"\xff\xfe", "completions", 400, "json_invalid"),
    (b'{"prompt": "\xff"}', "completions", 400, "error parsing the body"),
    (DEEP_974, "completions", 400, "nested too deeply"),
    (b"[1, 2]", "completions", 400, "valid dictionary"),
    (b'{"model": "m"}', "completions", 400, "Either prompt or prompt_embeds"),
    (b'{"prompt": "x", "stream": "maybe"}', "completions", 400, "body.stream"),
    (b'{"messages": "hi"}', "chat", 400, "valid list"),
    (b'{"prompt": "x", "max_tokens": 0}', "completions", 400, "max_tokens must be"),
    (b'{"messages": [], "max_completion_tokens": 1.5}', "chat", 400, "max_completion_tokens"),
])
def test_parse_body_errors(raw, kind, status, match):
    with pytest.raises(ProxyError, match=match) as info:
        parse_body(raw, kind)
    assert info.value.status == status


async def _post(client, path, **kw):
    r = await client.post(path, **kw)
    return r.status, await r.json()


def test_client_errors_are_openai_shaped_4xx():
    async def go():
        async with cluster(max_body_bytes=1000) as (router, client, prefills, _):
            out = [await _post(client, "/v1/completions", data=b"{oops"),
                   await _post(client, "/v1/completions", json={"model": "gpt-9",
                                                                "prompt": "x"}),
                   await _post(client, "/v1/completions", json={"model": "tiny",
                                                                "prompt": "x" * 2000}),
                   await _post(client, "/v1/chat/completions", json={"model": "tiny"}),
                   await _post(client, "/v1/nothing", json={})]
            r = await client.get("/v1/completions")
            out.append((r.status, await r.json()))
            return router, out, prefills

    router, out, prefills = run(go())
    assert [s for s, _ in out] == [400, 404, 413, 400, 404, 405]
    assert out[1][1]["error"]["code"] == 404  # vLLM's shape: the status
    assert out[1][1]["error"]["message"].endswith("` does not exist.")  # vLLM's words
    assert all(set(doc["error"]) == {"message", "type", "param", "code"} for _, doc in out[:4])
    # a route nobody has, a wrong method: vLLM's own (FastAPI) answers
    assert [doc for _, doc in out[4:]] == [{"detail": "Not Found"},
                                           {"detail": "Method Not Allowed"}]
    assert prefills[0].requests == []  # nothing reached an engine
    assert router.metrics.requests.get(endpoint="completions", status="400") == 1
    assert router.metrics.requests.get(endpoint="other", status="404") == 1


def test_malformed_requests_do_not_disturb_concurrent_good_ones():
    async def go():
        async with cluster() as (_, client, _p, decoders):
            decoders[0].mode = decoders[1].mode = "slow"
            good = [client.post("/v1/completions", json={**CODE, "stream": True})
                    for _ in range(4)]
            bad = [client.post("/v1/completions", data=b"{") for _ in range(4)]
            rs = await asyncio.gather(*good, *bad)
            return [(r.status, await r.text()) for r in rs]

    out = run(go())
    assert [s for s, _ in out] == [200] * 4 + [400] * 4
    assert all("[DONE]" in text for _, text in out[:4])


async def _until(predicate, timeout: float = 10.0) -> None:
    """Wait for background health checks (every 0.05 s) to reach a state."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate() and loop.time() < deadline:
        await asyncio.sleep(0.02)


def test_models_health_and_metrics_pages():
    async def go():
        async with cluster() as (router, client, _p, decoders):
            models = await (await client.get("/v1/models")).json()
            h1 = await client.get("/health")
            decoders[0].healthy = False
            await _until(lambda: not router.pool.decode[0].healthy)
            h2 = await client.get("/health")
            decoders[1].healthy = False
            await _until(lambda: not router.pool.decode[1].healthy)
            h3 = await client.get("/health")
            r = await client.post("/v1/completions", json=CODE)
            decoders[0].healthy = decoders[1].healthy = True
            await _until(lambda: all(d.healthy for d in router.pool.decode))
            h4 = await client.get("/health")
            m = await client.get("/metrics")
            return (models, [(h.status, (await h.json())["status"]) for h in (h1, h2, h3, h4)],
                    (r.status, (await r.json())["error"]["code"]), m.content_type,
                    await m.text())

    models, healths, refused, ctype, page = run(go())
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert healths == [(200, "ok"), (200, "degraded"), (503, "unavailable"), (200, "ok")]
    assert refused == (503, 503)
    assert ctype == "text/plain"
    assert 'eldr_upstream_healthy{instance="w-code",role="decode"} 1.0' in page


def _swapped_state(router):
    policy = make_policy("eldr", num_workers=2, centroids=fake_centroids()[::-1], tau=0.0)
    return dataclasses.replace(router.state, policy=policy)


def test_admin_reload_needs_the_token(monkeypatch):
    async def go():
        async with cluster(admin_token=TOKEN) as (router, client, _, _d):
            monkeypatch.setattr(admin_mod, "build_state", lambda config: _swapped_state(router))
            before = await client.post("/v1/completions", json=CODE)
            no = await client.post("/admin/reload")
            wrong = await client.post("/admin/reload",
                                      headers={"Authorization": "Bearer nope-nope"})
            ok = await client.post("/admin/reload",
                                   headers={"Authorization": f"Bearer {TOKEN}"})
            after = await client.post("/v1/completions", json=CODE)
            return (router, before.headers["X-Eldr-Decoder"], no.status, wrong.status,
                    ok.status, await ok.json(), after.headers["X-Eldr-Decoder"])

    router, before, no, wrong, ok, doc, after = run(go())
    assert (no, wrong, ok) == (401, 401, 200)
    assert doc["decoders"] == ["w-code", "w-other"]
    assert (before, after) == ("w-code", "w-other")  # the new centroids are in use
    assert router.metrics.reloads.get(result="ok") == 1


def test_admin_disabled_without_a_token():
    async def go():
        async with cluster() as (_, client, _p, _d):
            r = await client.post("/admin/reload", headers={"Authorization": "Bearer whatever"})
            return r.status, await r.json()

    status, doc = run(go())
    assert status == 403 and doc["error"]["code"] == 403


def test_failed_reload_keeps_the_running_artifact(monkeypatch):
    def broken(config):
        raise ValueError("artifact: centroids are not unit norm")

    async def go():
        async with cluster(admin_token=TOKEN) as (router, client, _, _d):
            old = router.state
            monkeypatch.setattr(admin_mod, "build_state", broken)
            r = await client.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
            return router, old, r.status, await r.json()

    router, old, status, doc = run(go())
    assert status == 500 and "unit norm" in doc["error"]["message"]
    assert router.state is old
    assert router.metrics.reloads.get(result="error") == 1


def test_reload_does_not_drop_requests_in_flight(monkeypatch):
    async def go():
        async with cluster(admin_token=TOKEN, engine_kw={"tokens": 20}) as (router, client, _,
                                                                                decoders):
            monkeypatch.setattr(admin_mod, "build_state", lambda config: _swapped_state(router))
            decoders[0].mode = "slow"
            r = await client.post("/v1/completions", json={**CODE, "stream": True})
            first = await r.content.readany()
            ok = await client.post("/admin/reload",
                                   headers={"Authorization": f"Bearer {TOKEN}"})
            rest = await r.read()
            return first + rest, ok.status

    text, status = run(go())
    assert status == 200
    events = [e for e in text.decode().split("\n\n") if e]
    assert len(events) == 21 and events[-1] == "data: [DONE]"
    assert json.loads(events[19][6:])["choices"][0]["text"] == "tok19"


# -- issue 12: no 5xx and no traceback on any input -----------------------------------------
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-32-le"])
def test_utf16_and_utf32_bodies_are_accepted_as_vllm_does(encoding):
    async def go():
        async with cluster() as (_, client, prefills, _d):
            data = json.dumps({**CODE, "prompt": "héllo wörld"}).encode(encoding)
            r = await client.post("/v1/completions", data=data)
            return r.status, await r.json(), prefills

    status, doc, prefills = run(go())  # json.loads (so vLLM) detects JSON's encodings
    assert status == 200 and doc["choices"]
    assert len(prefills[0].requests) == 1


@pytest.mark.parametrize("raw", [DEEP_974, DEEP_50K])
def test_deeply_nested_bodies_are_a_400_before_any_prefill(raw):
    async def go():
        async with cluster() as (router, client, prefills, _):
            r = await client.post("/v1/completions", data=raw)
            return router, r.status, r.content_type, await r.json(), prefills

    _router, status, ctype, doc, prefills = run(go())
    assert (status, ctype) == (400, "application/json")
    assert doc["error"]["code"] == 400
    assert prefills[0].requests == []


def test_an_unexpected_error_is_a_json_500_naming_no_internals(monkeypatch, caplog):
    async def go():
        async with cluster() as (router, client, _p, _d):
            async def boom(*args, **kwargs):
                raise RuntimeError("/secret/path internals")

            monkeypatch.setattr(router.flow, "run", boom)
            r = await client.post("/v1/completions", json=CODE)
            return router, r.status, r.content_type, await r.text()

    router, status, ctype, text = run(go())
    assert (status, ctype) == (500, "application/json")
    doc = json.loads(text)
    assert doc["error"]["code"] == 500 and "secret" not in text
    assert "RuntimeError" not in text and "Traceback" not in text
    assert router.metrics.requests.get(endpoint="completions", status="500") == 1
    assert any("secret" in r.getMessage() or r.exc_info for r in caplog.records
               if r.levelname == "ERROR")


def _other_model_state(router, **fingerprint):
    return dataclasses.replace(router.state, **fingerprint)


@pytest.mark.parametrize("fingerprint, traffic, match", [
    ({"num_layers": 6}, True, "L=6 E=8 k=4.*engines' prefill payloads have L=2 E=8"),
    ({"num_experts": 16}, False, "L=2 E=16 k=4.*running artifact is for L=2 E=8 k=4"),
    ({"top_k": 2}, True, "L=2 E=8 k=2.*running artifact is for L=2 E=8 k=4"),
])
def test_reload_refuses_an_artifact_for_another_model(monkeypatch, fingerprint, traffic,
                                                      match):
    async def go():
        async with cluster(admin_token=TOKEN) as (router, client, _, _d):
            if traffic:  # the engines' payloads tell the model's (L, E)
                assert (await client.post("/v1/completions", json=CODE)).status == 200
            old = router.state
            monkeypatch.setattr(admin_mod, "build_state",
                                lambda config: _other_model_state(router, **fingerprint))
            r = await client.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
            after = await client.post("/v1/completions", json=CODE)
            return router, old, r.status, await r.json(), after.status

    router, old, status, doc, after = run(go())
    assert status == 409 and doc["error"]["code"] == 409
    assert re_search(match, doc["error"]["message"])
    assert router.state is old and after == 200
    assert router.metrics.reloads.get(result="error") == 1


def re_search(pattern, text):
    import re

    return re.search(pattern, text) is not None


@pytest.mark.parametrize("exc", [RecursionError("deep"), TypeError("rho_curve")])
def test_a_reload_failing_in_any_way_is_a_json_error_and_counted(monkeypatch, exc):
    def broken(config):
        raise exc

    async def go():
        async with cluster(admin_token=TOKEN) as (router, client, _, _d):
            monkeypatch.setattr(admin_mod, "build_state", broken)
            r = await client.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
            return router, r.status, r.content_type, await r.json()

    router, status, ctype, doc = run(go())
    assert (status, ctype) == (500, "application/json")
    assert doc["error"]["code"] == 500
    assert router.metrics.reloads.get(result="error") == 1


# -- issue 12: engines' API keys, admin token guessing, /health internals --------------------
@pytest.mark.parametrize("with_key", [True, False])
def test_engines_that_require_an_api_key(with_key):
    async def go():
        kw = {"upstream_api_key": "engine-key"} if with_key else {}
        async with cluster(**kw) as (router, client, prefills, decoders):
            for e in (*prefills, *decoders):
                e.api_key = "engine-key"
            for inst in (*router.pool.prefill, *router.pool.decode):
                inst.models = ()  # learned again, now with the key required
            await router.pool.check_all()
            models = await client.get("/v1/models")
            r = await client.post("/v1/completions", json={"prompt": "write code now"},
                                  headers={"Authorization": "Bearer client-key"})
            return models.status, r.status

    assert run(go()) == ((200, 200) if with_key else (503, 401))


def test_wrong_admin_tokens_are_rate_limited_per_address(monkeypatch):
    async def go():
        async with cluster(admin_token=TOKEN) as (router, client, _, _d):
            monkeypatch.setattr(admin_mod, "build_state", lambda config: router.state)
            wrong = {"Authorization": "Bearer wrong-guess"}
            statuses = [(await client.post("/admin/reload", headers=wrong)).status
                        for _ in range(6)]
            right = await client.post("/admin/reload",
                                      headers={"Authorization": f"Bearer {TOKEN}"})
            router.token.failed.window = 0.0  # the minute has passed
            again = await client.post("/admin/reload",
                                      headers={"Authorization": f"Bearer {TOKEN}"})
            return statuses, right.status, (await right.json())["error"]["code"], again.status

    statuses, right, code, again = run(go())
    assert statuses == [401] * 5 + [429]
    assert (right, code) == (429, 429)  # even the right token waits
    assert again == 200


def test_health_shows_internals_only_to_the_admin_token():
    async def go():
        async with cluster(admin_token=TOKEN) as (_, client, _p, _d):
            public = await (await client.get("/health")).json()
            wrong = await (await client.get(
                "/health", headers={"Authorization": "Bearer nope-nope"})).json()
            admin = await (await client.get(
                "/health", headers={"Authorization": f"Bearer {TOKEN}"})).json()
            return public, wrong, admin

    public, wrong, admin = run(go())
    for doc in (public, wrong):
        assert "artifact" not in doc and "tau" not in doc
        assert set(doc["decode"][0]) == {"name", "healthy", "in_flight", "engine_load",
                                         "breaker", "draining", "load"}
        assert "url" not in doc["prefill"][0] and "last_error" not in doc["prefill"][0]
    assert public["status"] == "ok" and public["decode"][0]["name"] == "w-code"
    assert "artifact" in admin and admin["decode"][0]["url"].startswith("http://")
    assert "last_error" in admin["prefill"][0]


# -- issue 12: a property-based fuzz of request bodies ---------------------------------------
FUZZ_TALLY: dict[int, int] = {}  # status → count, over every example of the fuzz test


@pytest.fixture(scope="module")
def live_cluster():
    """One router + fake engines on an event loop in a thread, for many examples."""
    import logging
    import threading

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    async def main():
        async with cluster(health_interval=60) as (router, client, _p, _d):
            box.update(router=router, client=client, stop=asyncio.Event())
            ready.set()
            await box["stop"].wait()

    th = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    th.start()
    assert ready.wait(30)

    class Errors(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    errors = Errors()
    logging.getLogger("eldr.serve").addHandler(errors)
    yield loop, box["client"], errors
    logging.getLogger("eldr.serve").removeHandler(errors)
    loop.call_soon_threadsafe(box["stop"].set)
    th.join(30)


def _json_values():
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
               | st.text(max_size=20))
    return st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                        | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


def _bodies():
    from hypothesis import strategies as st

    field = st.sampled_from(["prompt", "messages", "model", "stream", "max_tokens",
                             "max_completion_tokens", "stream_options", "kv_transfer_params",
                             "n", "min_tokens"])
    shaped = st.dictionaries(field, _json_values() | st.sampled_from(
        ["tiny", "write code", True, 1, 5, [{"role": "user", "content": "hi"}]]), max_size=6)
    as_json = (shaped | _json_values()).map(lambda v: json.dumps(v).encode())
    encodings = st.tuples(shaped, st.sampled_from(["utf-16", "utf-32", "utf-8-sig"])).map(
        lambda t: json.dumps(t[0], ensure_ascii=False).encode(t[1]))
    nested = st.integers(1, 3000).map(lambda n: b'{"prompt":"x","a":' + b"[" * n + b"]" * n
                                      + b"}")
    return as_json | st.binary(max_size=64) | encodings | nested


def test_fuzzed_bodies_get_a_4xx_json_or_an_answer_never_a_500(live_cluster):
    from hypothesis import HealthCheck, given, settings

    loop, client, errors = live_cluster

    async def post(path, raw):
        r = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        return r.status, r.content_type, await r.read()

    @settings(max_examples=400, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(raw=_bodies(), chat=__import__("hypothesis").strategies.booleans())
    def check(raw, chat):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, ctype, body = asyncio.run_coroutine_threadsafe(post(path, raw), loop).result(30)
        FUZZ_TALLY[status] = FUZZ_TALLY.get(status, 0) + 1
        assert status != 500, body  # 500 is only ever the router's own failure
        if status >= 400 and ctype != "text/event-stream":
            doc = json.loads(body)
            assert set(doc["error"]) >= {"message", "type"}, doc
        assert b"Traceback" not in body

    check()
    assert not [r for r in errors.records if r.exc_info], errors.records[0].getMessage()
    assert FUZZ_TALLY.get(200, 0) > 0 and FUZZ_TALLY.get(400, 0) > 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "write code", "max_tokens": 129}, "max_tokens"),  # max_model_len 128
    ({"prompt": list(range(129))}, "input_tokens"),
])
def test_what_the_decoder_would_refuse_is_refused_before_the_prefill(body, param):
    async def go():
        async with cluster() as (_, client, prefills, _d):
            r = await client.post("/v1/completions", json={"model": "tiny", **body})
            # prompt + max_tokens over the context: vLLM clamps max_tokens, so it is accepted
            ok = await client.post("/v1/completions",
                                   json={"prompt": list(range(100)), "max_tokens": 128})
            return r.status, await r.json(), ok.status, prefills

    status, doc, ok, prefills = run(go())
    assert (status, doc["error"]["param"], doc["error"]["code"]) == \
        (400, param, 400)
    assert ok == 200 and len(prefills[0].requests) == 1  # only the valid one was prefilled


# -- the API surface beyond the PD flow (issue 14) -------------------------------------------
def test_models_relays_every_field_the_engines_report():
    from _proxy_fakes import MODEL_CARD

    async def go():
        async with cluster() as (_router, client, prefills, decoders):
            r1 = await client.get("/v1/models")
            doc1 = await r1.json()
            for e in (*prefills, *decoders):  # no engine answers the call itself now
                e.api_key = "k"
            r2 = await client.get("/v1/models")
            return doc1, r2.status, await r2.json()

    relayed, status, fallback = run(go())
    assert relayed == {"object": "list", "data": [MODEL_CARD]}  # root, permission, ... kept
    card = fallback["data"][0]  # learned by the health checks: still vLLM's card shape
    assert status == 200 and card["id"] == "tiny" and card["root"] == "tiny"
    assert card["max_model_len"] == 128 and card["permission"] == []


def test_auxiliary_routes_are_forwarded_to_a_healthy_prefill_instance():
    async def go():
        async with cluster(num_prefill=2, max_body_bytes=1000) as (router, client, prefills,
                                                                   decoders):
            out = {}
            r = await client.post("/tokenize", json={"model": "tiny", "prompt": "ab cde"},
                                  headers={"X-Request-Id": "mine"})
            out["tokenize"] = (r.status, await r.json(), r.headers["X-Request-Id"])
            r = await client.post("/detokenize", json={"model": "tiny", "tokens": [1, 2]})
            out["detokenize"] = (r.status, await r.json())
            r = await client.get("/version?x=1")
            out["version"] = (r.status, await r.json())
            out["ping"] = (await client.get("/ping")).status
            r = await client.get("/v1/no-such-route")
            out["unknown"] = (r.status, await r.json())
            r = await client.post("/tokenize", data=b"x" * 2000)
            out["too_big"] = r.status
            prefills[0].healthy = False  # the other prefill instance answers
            await _until(lambda: not router.pool.prefill[0].healthy)
            out["after"] = (await client.get("/version")).status
            prefills[1].healthy = False
            await _until(lambda: not router.pool.prefill[1].healthy)
            out["none"] = (await client.get("/version")).status
            return router, out, prefills, decoders

    router, out, prefills, decoders = run(go())
    assert out["tokenize"] == (200, {"count": 2, "max_model_len": 128, "tokens": [2, 3],
                                     "token_strs": None}, "mine")
    assert out["detokenize"] == (200, {"prompt": "t1 t2"})
    assert out["version"][0] == 200 and out["version"][1]["version"] == "0.0-fake"
    assert out["ping"] == 200
    assert out["unknown"] == (404, {"detail": "Not Found"})  # the engine's own 404
    assert out["too_big"] == 413
    assert (out["after"], out["none"]) == (200, 503)
    calls = [c for p in prefills for c in p.aux]
    assert ("GET", "/version?x=1", b"") in calls
    assert all(not d.aux and not d.requests for d in decoders)  # decoders are never asked
    assert router.metrics.requests.get(endpoint="/tokenize", status="200") == 1
    assert router.metrics.requests.get(endpoint="other", status="404") == 1


@pytest.mark.parametrize("method, path, status, what", [
    ("POST", "/sleep", 403, "Forbidden"),
    ("POST", "/v1/load_lora_adapter", 403, "Forbidden"),
    ("POST", "/admin/anything", 403, "Forbidden"),
    ("GET", "/admin/reload", 405, "Method Not Allowed"),
    ("POST", "/v1/responses", 501, "NotImplementedError"),
    ("POST", "/v1/audio/transcriptions", 501, "NotImplementedError"),
    ("PUT", "/tokenize", 405, "Method Not Allowed"),
    ("GET", "/v1/chat/completions", 405, "Method Not Allowed"),
    ("POST", "/metrics", 405, "Method Not Allowed"),
])
def test_control_generation_and_own_routes_are_never_forwarded(method, path, status, what):
    async def go():
        async with cluster() as (_router, client, prefills, decoders):
            r = await client.request(method, path, json={})
            return r.status, await r.json(), prefills + decoders

    got, doc, engines = run(go())
    assert got == status
    assert (doc.get("detail") or doc["error"]["type"]) == what
    assert all(not e.aux and not e.requests for e in engines)


def test_own_routes_keep_priority_over_forwarding():
    async def go():
        async with cluster() as (_, client, prefills, _d):
            health = await client.get("/health")
            metrics = await client.get("/metrics")
            return (health.status, (await health.json())["status"], metrics.status,
                    prefills[0].aux)

    assert run(go()) == (200, "ok", 200, [])


def test_a_forwarded_answer_over_its_cap_is_a_502(monkeypatch):
    from eldr.proxy.request import forward

    monkeypatch.setattr(forward, "FORWARD_ANSWER_LIMIT", 10)

    async def go():
        async with cluster() as (_, client, _p, _d):
            r = await client.post("/tokenize", json={"prompt": "a b c d e f g h"})
            return r.status, (await r.json())["error"]["type"]

    assert run(go()) == (502, "Bad Gateway")
