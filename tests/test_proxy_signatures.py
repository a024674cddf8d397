"""The router's payload decode path: versions 1 and 2, layer masks, and fuzzed payloads
through a real router in front of fake engines (a fallback is counted, never a 5xx)."""

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from _proxy_fakes import E, L, cluster, domain_counts, run
from eldr.capture.payload import encode_counts, encode_payload
from eldr.proxy.request.signatures import payload_request

CODE = {"model": "tiny", "prompt": "write code now"}


def _metric(page: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in page.splitlines():
        if (line.startswith((f"{name}{{", f"{name} "))
                and all(f'{k}="{v}"' in line for k, v in labels.items())):
            total += float(line.split()[-1])
    return total


def _route(payloads):
    """Send one request per payload through a router whose prefill answers with it;
    returns [(status, decoder)], the /metrics page."""
    async def go():
        async with cluster() as (_router, client, prefills, _decoders):
            engine = prefills[0]
            plain = engine._prefill_answer
            out = []
            for payload in payloads:
                def answer(prompt, n_prompt, body, payload=payload):
                    doc = plain(prompt, n_prompt, body)
                    doc["kv_transfer_params"]["eldr"] = payload
                    return doc
                engine._prefill_answer = answer
                r = await client.post("/v1/completions", json=CODE)
                await r.read()
                out.append((r.status, r.headers.get("X-Eldr-Decoder")))
            page = await (await client.get("/metrics")).text()
            return out, page
    return run(go())


def test_v1_and_v2_payloads_route_alike():
    counts = domain_counts(CODE["prompt"])
    v1 = {**encode_counts(counts), "tokens": 3}
    v2 = encode_payload(counts, tokens=3)
    masked = encode_payload(counts, tokens=3, layers=list(range(L)))
    results, page = _route([v1, v2, masked])
    assert results == [(200, "w-code")] * 3
    assert _metric(page, "eldr_routing_fallbacks_total") == 0
    assert _metric(page, "eldr_signatures_total", source="payload") == 3


def _good():
    return encode_payload(np.full((L, E), 3), tokens=3)  # dense, one digit a count


FUZZ = [
    {**_good(), "data": _good()["data"][:-1]},  # truncated
    {**_good(), "data": _good()["data"] * 1000},  # oversized for its shape
    {**_good(), "data": "#" * (8 * 1024 * 1024 + 1)},  # over the size cap
    {**_good(), "v": 99},  # wrong version
    {**_good(), "v": float("nan")},
    {**_good(), "tokens": float("nan")},  # NaN where an integer belongs
    {**_good(), "shape": [float("nan"), E]},
    {**_good(), "shape": [L]},  # wrong shapes
    {**_good(), "shape": [L, E, 1, 1]},
    {**_good(), "w": None},
    {**_good(), "enc": ["dense"]},
    {**_good(), "data": "\\" * (L * E)},
    {**_good(), "tokens": 1},  # counts over the tokens counted
    {**_good(), "layers": [L]},
    "not an object",
    [1, 2],
]


def test_fuzzed_payloads_fall_back_and_are_counted():
    results, page = _route(FUZZ)
    assert all(status == 200 for status, _ in results), results
    fallbacks = (_metric(page, "eldr_routing_fallbacks_total", reason="malformed")
                 + _metric(page, "eldr_routing_fallbacks_total", reason="mismatch"))
    assert fallbacks == len(FUZZ)
    assert _metric(page, "eldr_requests_total", endpoint="completions", status="200") \
        == len(FUZZ)


def test_other_model_and_foreign_mask_are_mismatches():
    other = encode_payload(np.ones((L + 1, E), int), tokens=9)  # another model's (L, E)
    not_ours = encode_payload(np.ones((L, E), int), tokens=9, layers=[0])  # mask: all L
    results, page = _route([other, not_ours])
    assert [s for s, _ in results] == [200, 200]
    assert _metric(page, "eldr_routing_fallbacks_total", reason="mismatch") == 2


def test_payload_request_asks_for_the_mask_only_without_a_profile():
    from types import SimpleNamespace

    enc = SimpleNamespace(layers_=np.array([1, 3]))
    sig = SimpleNamespace(encoder=enc, needs_signature=True, needs_profile=False)
    assert payload_request(sig) == {"eldr_layers": [1, 3]}
    both = SimpleNamespace(encoder=enc, needs_signature=True, needs_profile=True)
    assert payload_request(both) is None
    assert payload_request(SimpleNamespace(encoder=None, needs_signature=False,
                                           needs_profile=False)) is None
    # a profile policy pricing a subset asks for those layers; pricing all, for none
    subset = SimpleNamespace(priced_layers=np.array([0, 3]))
    cost = SimpleNamespace(encoder=enc, needs_signature=False, needs_profile=True,
                           policy=subset)
    assert payload_request(cost) == {"eldr_layers": [0, 3]}
    every = SimpleNamespace(encoder=enc, needs_signature=False, needs_profile=True,
                            policy=SimpleNamespace(priced_layers=None))
    assert payload_request(every) is None
