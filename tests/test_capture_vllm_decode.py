"""The decode half of the vLLM plugin, on stand-ins for vLLM's objects (no vLLM needed)."""

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from eldr.capture import vllm_decode as vd
from eldr.capture import vllm_plugin as plugin
from eldr.capture.decode import decode_decode_payload


def _runner(rows, req_ids, prompt_lens, *, pd=True):
    torch = pytest.importorskip("torch")
    buf = torch.tensor(np.asarray(rows), dtype=torch.int32)
    cap = plugin._Capture(buf, 4)
    cap.pd = pd
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids), _eldr_capture=cap,
        requests={r: SimpleNamespace(num_prompt_tokens=p)
                  for r, p in zip(req_ids, prompt_lens, strict=True)})


def _sched_out(num_tokens, cached):
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(num_tokens.values()), num_scheduled_tokens=num_tokens,
        scheduled_new_reqs=[], finished_req_ids=(),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached],
                                              resumed_req_ids=set()))


def test_worker_ships_decode_rows_only_on_pd_engines():
    # L=1, k=2, E=4: "a" decodes (position 5 of a 5-token prompt), "b" is in its prompt.
    rows = [[[0, 1]], [[2, 3]], [[1, 2]]]
    runner = _runner(rows, ["a", "b"], [5, 9])
    plugin._collect(runner, _sched_out({"a": 1, "b": 2}, [("a", 5), ("b", 0)]))
    (step,) = runner._eldr_capture.decode_steps
    assert step.req_ids == ("a",) and step.ids.tolist() == [[[0, 1]]]
    assert step.distinct.tolist() == [2]
    plain = _runner(rows, ["a", "b"], [5, 9], pd=False)
    plugin._collect(plain, _sched_out({"a": 1, "b": 2}, [("a", 5), ("b", 0)]))
    assert plain._eldr_capture.decode_steps == []


def _engine_core(params):
    return SimpleNamespace(
        requests={r: SimpleNamespace(kv_transfer_params=p) for r, p in params.items()},
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(get_num_experts=lambda: 4)))


def test_engine_core_tallies_decode_legs_and_attaches_on_finish(tmp_path, monkeypatch):
    from eldr.capture.decode import decode_step

    monkeypatch.setenv("ELDR_FOOTPRINT_FILE", str(tmp_path / "fp.json"))
    sched = _engine_core({"d": {"eldr_report": True}, "p": None})
    rows = np.array([[[0, 1]], [[1, 2]]])  # "d" and "p" decode in the same batch
    for _ in range(3):
        vd.absorb_decode(sched, [decode_step(rows, [("d", 0, 1), ("p", 1, 1)], 4)])
    outs = [SimpleNamespace(request_id="d", finish_reason="length", kv_transfer_params=None),
            SimpleNamespace(request_id="p", finish_reason="stop", kv_transfer_params=None)]
    vd.attach_decode(sched, {0: SimpleNamespace(outputs=outs)})
    assert outs[1].kv_transfer_params is None  # not a decode leg: nothing added
    payload = outs[0].kv_transfer_params["eldr_decode"]
    rep = decode_decode_payload(payload)
    assert rep.tokens == 3 and rep.steps == 3 and payload["own"] == 1
    assert rep.counts.tolist() == [[3, 3, 0, 0]]
    assert rep.distinct.tolist() == [3.0]  # the batch used experts {0, 1, 2} each step
    snap = json.loads((tmp_path / "fp.json").read_text())
    assert snap["experts"] == [3] and snap["steps"] >= 1


def test_stream_wrapper_adds_one_event_before_done():
    class Serving:
        async def completion_stream_generator(self, request, engine_inputs,
                                              result_generator, request_id):
            async for _ in result_generator:
                yield 'data: {"choices": []}\n\n'
            yield "data: [DONE]\n\n"

    async def results(final_params):
        yield 0, SimpleNamespace(kv_transfer_params=None)
        yield 0, SimpleNamespace(kv_transfer_params=final_params)

    vd._wrap_stream(Serving, "completion_stream_generator")

    async def collect(params):
        gen = Serving().completion_stream_generator(None, [], results(params), "id")
        return [chunk async for chunk in gen]

    with_payload = asyncio.run(collect({"eldr_decode": {"v": 2}}))
    assert with_payload[-2] == 'data: {"eldr_decode":{"v":2}}\n\n'
    assert with_payload[-1] == "data: [DONE]\n\n"
    assert asyncio.run(collect(None)) == ['data: {"choices": []}\n\n'] * 2 + \
        ["data: [DONE]\n\n"]


def test_footprint_collector_reads_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ELDR_FOOTPRINT_FILE", str(tmp_path / "fp.json"))
    assert list(vd._FootprintCollector().collect()) == []  # no file yet: nothing
    (tmp_path / "fp.json").write_text(json.dumps(
        {"steps": 5, "experts": [7, 9], "step_distinct_mean": 4.5}))
    fams = {f.name: f for f in vd._FootprintCollector().collect()}
    assert [s.value for s in fams["eldr_engine_footprint_experts"].samples] == [7, 9]
    assert fams["eldr_engine_step_distinct_experts"].samples[0].value == 4.5


def test_the_footprint_file_carries_the_compact_cells(tmp_path, monkeypatch):
    from eldr.capture.decode import decode_engine_footprint, decode_step

    monkeypatch.setenv("ELDR_FOOTPRINT_FILE", str(tmp_path / "fp.json"))
    assert vd.read_footprint() is None  # no decode step yet
    sched = _engine_core({"d": {"eldr_report": True}})
    vd.absorb_decode(sched, [decode_step(np.array([[[0, 1]]]), [("d", 0, 1)], 4)])
    cells = vd.read_footprint()
    read = decode_engine_footprint(cells, 1, 4, now=cells["time"])
    assert read.steps == 1 and read.freq.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    (tmp_path / "fp.json").write_text("[1, 2]")
    assert vd.read_footprint() is None  # a foreign file is no footprint


def _endpoint_client(tmp_path, monkeypatch):
    """A test client of an app with the plugin's routes, its files under ``tmp_path``."""
    fastapi = pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    monkeypatch.setenv("ELDR_FOOTPRINT_FILE", str(tmp_path / "fp.json"))
    app = fastapi.FastAPI()
    vd.FootprintEndpoint().attach_router(app)
    return TestClient(app)


def test_the_footprint_route_serves_the_cells_with_their_age(tmp_path, monkeypatch):
    client = _endpoint_client(tmp_path, monkeypatch)
    assert client.get(vd.FOOTPRINT_ROUTE).status_code == 404  # no decode step yet
    cells = {"v": 1, "shape": [1, 4], "steps": 1, "time": 1.0, "w": 1, "data": "$$##"}
    (tmp_path / "fp.json").write_text(json.dumps({"steps": 1, "cells": cells}))
    resp = client.get(vd.FOOTPRINT_ROUTE)
    assert resp.status_code == 200 and resp.headers["cache-control"] == "no-store"
    doc = resp.json()
    assert doc["data"] == "$$##" and doc["age"] > 1e6  # epoch 1.0 is long ago


def test_the_route_joins_vllms_endpoint_plugins_for_generating_servers(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("vllm.plugins")
    theirs = SimpleNamespace(name="theirs")
    fake.load_endpoint_plugins = lambda supported_tasks=None: [theirs]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.plugins", fake)
    sys.modules["vllm"].plugins = fake
    vd._add_endpoint()
    vd._add_endpoint()  # idempotent: wrapped once
    got = fake.load_endpoint_plugins(("generate",))
    assert got[0] is theirs and [p.name for p in got] == ["theirs", "eldr_footprint"]
    assert fake.load_endpoint_plugins(supported_tasks=("render",)) == [theirs]


def test_worker_times_execute_model_plus_sample_tokens(monkeypatch):
    pytest.importorskip("vllm.v1.outputs")
    clock = iter([10.0, 10.25, 20.0, 20.5])  # execute 0.25 s, sample 0.5 s
    monkeypatch.setattr(plugin.time, "perf_counter", lambda: next(clock))
    runner = _runner([[[0, 1]], [[2, 3]], [[1, 2]]], ["a", "b"], [5, 9])
    execute = plugin._wrap_execute_model(lambda self, out: None)  # sampling follows
    sample = plugin._wrap_sample_tokens(lambda self: None)
    assert execute(runner, _sched_out({"a": 1, "b": 2}, [("a", 5), ("b", 0)])) is None
    (step,) = runner._eldr_capture.decode_steps
    assert step.wall_s is None and runner._eldr_capture.exec_s == 0.25
    sample(runner)
    (step,) = runner._eldr_capture.decode_steps
    assert step.wall_s == 0.75 and step.num_tokens == 3 and step.is_mixed
    assert runner._eldr_capture.exec_s is None


def test_engine_core_rings_timed_steps_and_serves_them(tmp_path, monkeypatch):
    from eldr.capture.decode import decode_step, decode_step_ring

    monkeypatch.setenv("ELDR_FOOTPRINT_FILE", str(tmp_path / "fp.json"))
    assert vd.steps_path() == str(tmp_path / "fp.steps.json")
    sched = _engine_core({"d": {"eldr_report": True}})
    rows = np.array([[[0, 1]], [[1, 2]]])
    for i in range(5):
        step = decode_step(rows, [("d", 0, 1)], 4)._replace(wall_s=0.001 * (i + 1))
        vd.absorb_decode(sched, [step, decode_step(rows, [("d", 0, 1)], 4)])  # 2nd untimed
    vd.flush_steps(sched)  # as when the engine runs out of requests
    cols = decode_step_ring(vd.read_steps())
    assert cols.wall_s.tolist() == pytest.approx([0.001, 0.002, 0.003, 0.004, 0.005])
    assert cols.tokens.tolist() == [2] * 5 and cols.mixed.all()  # "p"'s row was no decode
    assert cols.distinct_sum.tolist() == [3] * 5 and (cols.num_layers, cols.num_experts) == \
        (1, 4)
    fams = {f.name: f for f in vd._step_metrics()}
    hist = {s.labels.get("le"): s.value for s in fams["eldr_engine_step_seconds"].samples
            if s.name.endswith("_bucket")}
    assert (hist["0.001"], hist["0.002"], hist["0.005"], hist["+Inf"]) == (1, 2, 5, 5)
    assert fams["eldr_engine_step_tokens"].samples[0].value == 10
    assert fams["eldr_engine_step_distinct_experts_sum"].samples[0].value == 15
    assert fams["eldr_engine_step_mixed"].samples[0].value == 5


def test_the_steps_route_serves_the_ring_or_says_the_plugin_has_none(tmp_path, monkeypatch):
    client = _endpoint_client(tmp_path, monkeypatch)
    none = client.get(vd.STEPS_ROUTE)
    assert none.status_code == 404 and none.json()["eldr_steps"] == 0
    (tmp_path / "fp.steps.json").write_text('{"v":1}')
    resp = client.get(vd.STEPS_ROUTE)
    assert resp.status_code == 200 and resp.json() == {"v": 1}
    assert resp.headers["cache-control"] == "no-store"
