"""ELDR's decode router for Ray's own PD builder (eldr.integrations.ray.router).

No Ray cluster and no engine: the router is constructed as Serve constructs it, and fed
stand-in replicas and Serve's own ``PendingRequest`` objects; the shared table is a
:class:`DecodeTable` called in process. The artifact is fitted on the two-domain toy trace
(token ids < 40: decoder ``w-code``, the others ``w-other``) with the tiny MoE's
tokenizer, policy ``eldr`` at τ = 0: the decoder a prompt should reach is the one whose
centroid is nearest its predicted signature, computed here from the artifact alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

pytest.importorskip("ray.serve.request_router")

from _prompt_data import two_domain_trace
from eldr.integrations.ray.router import (
    DecodeRouterConfig,
    EldrDecodeRouter,
    prompt_body,
)
from eldr.integrations.ray.table import DecodeTable, TableConfig

NAMES = ("w-code", "w-other")


@pytest.fixture(scope="module")
def tiny():
    from eldr.proxy.request.prompts import tokenizer_dir_for

    folder = tokenizer_dir_for("tiny_moe")
    if folder is None:
        pytest.skip("the tiny MoE's tokenizer is not shipped here")
    return folder


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny):
    """(artifact with a prompt predictor, the same without one)."""
    from eldr.fit import artifact as art_mod

    art = art_mod.fit_artifact(two_domain_trace(), worker_ids=NAMES, tau=0.0, tokenizer=tiny,
                               random_state=0)
    assert art.prompt_predictor is not None
    root = tmp_path_factory.mktemp("ray-router")
    art_mod.save(art, root / "predicting")
    art_mod.save(dataclasses.replace(art, prompt_predictor=None), root / "plain")
    return art, str(root / "predicting"), str(root / "plain")


class Replica:
    """A stand-in for Serve's ``RunningReplica``: what a router reads of one."""

    def __init__(self, unique_id: str) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id, DeploymentID(name="Decode:tiny", app_name="a"))
        self.max_ongoing_requests = 100

    @property
    def name(self) -> str:
        return self.replica_id.to_full_id_str()


class LocalTable:
    """The table's coroutines over an in-process DecodeTable (what the actor runs)."""

    def __init__(self, table: DecodeTable) -> None:
        self.table = table
        self.calls: list[str] = []

    async def reserve(self, request_id, **kw):
        self.calls.append("reserve")
        return self.table.reserve(request_id, **kw)

    async def release(self, request_id, outcome="completed"):
        self.calls.append(f"release:{outcome}")
        return self.table.release(request_id, outcome)

    async def move(self, request_id, replica):
        self.calls.append("move")
        return self.table.move(request_id, replica)


class ContextTable(LocalTable):
    """Records the Ray task a release was made in (``ray._raylet.async_task_id``: Ray
    cancels the actor calls made in a cancelled actor task's context with it)."""

    def __init__(self, table: DecodeTable) -> None:
        super().__init__(table)
        self.release_tasks: list = []

    async def release(self, request_id, outcome="completed"):
        import ray._raylet

        self.release_tasks.append(ray._raylet.async_task_id.get())
        return await super().release(request_id, outcome)


class BrokenTable(LocalTable):
    async def reserve(self, request_id, **kw):
        raise ConnectionError("the table actor died")


class SlowTable(LocalTable):
    """A table actor still starting: its reservation lands after the decision gave up."""

    async def reserve(self, request_id, **kw):
        await asyncio.sleep(0.3)
        return await super().reserve(request_id, **kw)


def _router(artifact: str, table=None, routing_state=None, **kw) -> EldrDecodeRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = EldrDecodeRouter(deployment_id=DeploymentID(name="Decode:tiny", app_name="a"),
                              handle_source=DeploymentHandleSource.UNKNOWN)
    kw.setdefault("prompt_processes", 0)  # the prediction thread tokenizes: no process
    router.initialize_state(table=table, routing_state=routing_state, artifact=artifact,
                            policy="eldr", **kw)
    return router


def _table(artifact: str) -> LocalTable:
    return LocalTable(DecodeTable(TableConfig(num_decode=2, artifact=artifact, policy="eldr")))


def _pending(body: dict, method: str = "completions", rid: str | None = None):
    """Serve's own PendingRequest of a handle call ``method(body, raw_request_info)``
    (made on the running loop: its future belongs to it)."""
    import uuid

    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    rid = rid or uuid.uuid4().hex
    return PendingRequest(args=[body, None], kwargs={},
                          metadata=RequestMetadata(request_id=rid, internal_request_id=rid,
                                                   call_method=method))


async def _settle():
    """Let the router's spawned table calls run."""
    for _ in range(5):
        await asyncio.sleep(0)


def _nearest(art, ids) -> str:
    sig, _ = art.route_inputs_from_prompt(np.asarray(ids))
    return NAMES[int(np.argmax(np.asarray(art.centroids) @ np.asarray(sig).reshape(-1)))]


def _loads(table: LocalTable) -> list[float]:
    return [d["load"] for d in table.table.snapshot()["decoders"]]


def test_the_choice_follows_the_prompts_prediction_and_every_reservation_ends(artifacts, tiny):
    art, predicting, _ = artifacts
    table = _table(predicting)
    router = _router(predicting, table, tokenizer=tiny)
    router.ready(30)
    replicas = [Replica("r0"), Replica("r1")]
    prompts = [list(range(i, i + 12)) for i in (0, 45, 20, 60)]
    text = "def add(a, b): return a + b"
    from eldr.proxy.request.prompts import PromptTokenizer

    want = [_nearest(art, ids) for ids in prompts]
    want.append(_nearest(art, PromptTokenizer(tiny).encode(text, add_special_tokens=True)))
    assert set(want[:4]) == set(NAMES)  # both decoders are meant to be used

    async def go():
        bodies = [{"model": "tiny", "prompt": ids} for ids in prompts]
        bodies.append({"model": "tiny", "prompt": text})
        pending, got = [], []
        for body in bodies:
            pr = _pending(body)
            ranks = await router.choose_replicas(replicas, pr)
            assert len(ranks) == 2 and len(ranks[0]) == 1  # the choice, then the others
            assert {r.name for r in ranks[0] + ranks[1]} == {r.name for r in replicas}
            pr.future.set_result(ranks[0][0])  # Serve assigns the first rank
            pending.append((pr, ranks[0][0]))
        await _settle()
        slots = {d["replica"]: d["name"] for d in table.table.snapshot()["decoders"]}
        got = [slots[r.name] for _, r in pending]
        held = sum(_loads(table))
        for pr, r in pending:
            router.on_request_completed(r.replica_id, pr.metadata.internal_request_id)
        await _settle()
        return got, held

    got, held = asyncio.run(go())
    assert got == want and held == len(want)
    assert _loads(table) == [0.0, 0.0]
    snap = table.table.snapshot()
    assert snap["held"] == 0 and snap["counters"]["reservations:completed"] == len(want)
    assert sum(n for k, n in snap["decisions"].items() if k.endswith("|prompt")) == len(want)
    stats = router.stats()
    assert stats["counters"]["predictions:ok"] == len(want) and stats["held"] == 0
    assert stats["tickets"] == 0
    router.close()


def test_without_a_predictor_the_choice_is_by_load_and_counted(artifacts):
    _, _, plain = artifacts
    table = _table(plain)
    router = _router(plain, table)
    router.ready(30)
    replicas = [Replica("r0"), Replica("r1")]

    async def go():
        chosen = []
        for _ in range(4):  # none completes: each choice sees the ones before it
            pr = _pending({"model": "tiny", "prompt": [1, 2, 3]})
            ranks = await router.choose_replicas(replicas, pr)
            pr.future.set_result(ranks[0][0])
            chosen.append((pr, ranks[0][0]))
        await _settle()
        loads = _loads(table)
        for pr, r in chosen:
            router.on_request_completed(r.replica_id, pr.metadata.internal_request_id)
        await _settle()
        return loads

    loads = asyncio.run(go())
    assert loads == [2.0, 2.0]  # by load: two each
    snap = table.table.snapshot()
    assert snap["counters"]["fallbacks:prompt_no_predictor"] == 4
    assert router.stats()["counters"]["predictions:no_predictor"] == 4
    assert _loads(table) == [0.0, 0.0] and snap["held"] == 0
    router.close()


def test_a_late_or_refused_prediction_routes_by_load_and_is_counted(artifacts):
    """The predictor stalls: a decision waits ``prompt_timeout`` and goes by load; with
    the one queue place taken, the next request does not wait at all (``busy``). The
    router's loop keeps running meanwhile (the job is on a thread)."""
    _, predicting, _ = artifacts
    from eldr.proxy.request.decision import build_state
    from eldr.proxy.request.prompts import PromptRouting

    config = DecodeRouterConfig(artifact=predicting, policy="eldr", prompt_processes=0)
    state = build_state(config.serve_config())

    def slow(ids):
        time.sleep(1.0)
        return state.prompt.predict(ids)

    stalled = dataclasses.replace(state, prompt=PromptRouting(predict=slow, tokenizer=None,
                                                              fingerprint=""))
    table = _table(predicting)
    router = _router(predicting, table, routing_state=stalled, prompt_queue=1,
                     prompt_timeout=0.05)
    replicas = [Replica("r0"), Replica("r1")]

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        beat = asyncio.ensure_future(ticker())
        first = _pending({"model": "tiny", "prompt": list(range(12))})
        second = _pending({"model": "tiny", "prompt": list(range(45, 57))})
        a = await router.choose_replicas(replicas, first)
        b = await router.choose_replicas(replicas, second)
        beat.cancel()
        for pr, ranks in ((first, a), (second, b)):
            pr.future.set_result(ranks[0][0])
        await _settle()
        held = table.table.snapshot()["held"]
        for pr, ranks in ((first, a), (second, b)):
            router.on_request_completed(ranks[0][0].replica_id, pr.metadata.internal_request_id)
        await _settle()
        return held, ticks

    held, ticks = asyncio.run(go())
    assert held == 2 and ticks > 0
    counters = router.stats()["counters"]
    assert counters["predictions:timeout"] == 1 and counters["predictions:busy"] == 1
    snap = table.table.snapshot()
    assert snap["counters"]["fallbacks:prompt_timeout"] == 1
    assert snap["counters"]["fallbacks:prompt_busy"] == 1
    assert snap["held"] == 0 and _loads(table) == [0.0, 0.0]
    router.close()


def test_cancelled_routing_another_replica_and_a_second_choice_keep_the_loads_right(
        artifacts):
    _, predicting, _ = artifacts
    table = _table(predicting)
    router = _router(predicting, table)
    router.ready(30)
    replicas = [Replica("r0"), Replica("r1")]

    async def go():
        # the caller left before a replica was assigned: released as cancelled
        left = _pending({"model": "tiny", "prompt": list(range(12))})
        await router.choose_replicas(replicas, left)
        left.future.cancel()
        await _settle()
        after_cancel = table.table.snapshot()["held"]
        # Serve passed over the chosen (full) replica: the load moves to the one used
        moved = _pending({"model": "tiny", "prompt": list(range(12))})
        ranks = await router.choose_replicas(replicas, moved)
        other = ranks[1][0]
        moved.future.set_result(other)
        await _settle()
        slot_of = {d["replica"]: d["load"] for d in table.table.snapshot()["decoders"]}
        loads_moved = (slot_of[ranks[0][0].name], slot_of[other.name])
        router.on_request_completed(other.replica_id, moved.metadata.internal_request_id)
        # Serve backed off and asked again for the same request: one reservation only
        again = _pending({"model": "tiny", "prompt": list(range(45, 57))})
        await router.choose_replicas(replicas, again)
        ranks = await router.choose_replicas(replicas, again)
        await _settle()
        held_twice = table.table.snapshot()["held"]
        again.future.set_result(ranks[0][0])
        router.on_request_completed(ranks[0][0].replica_id, again.metadata.internal_request_id)
        await _settle()
        return after_cancel, loads_moved, held_twice

    after_cancel, loads_moved, held_twice = asyncio.run(go())
    assert after_cancel == 0 and loads_moved == (0.0, 1.0) and held_twice == 1
    snap = table.table.snapshot()
    assert snap["held"] == 0 and _loads(table) == [0.0, 0.0]
    assert snap["counters"]["reservations:moved"] == 1
    assert snap["counters"]["reservations:cancelled"] == 2  # the one left, the first choice
    assert router.stats()["counters"]["moved"] == 1
    router.close()


def test_the_release_of_a_cancelled_request_is_not_made_in_its_task(artifacts):
    """A caller that left: its release runs in a context of its own, not in the Ray task
    of the request (which Ray cancels, and with it the actor calls made in its context:
    the decoder would stay held until its reservation expired)."""
    import ray._raylet

    _, predicting, _ = artifacts
    table = ContextTable(DecodeTable(TableConfig(num_decode=2, artifact=predicting,
                                                 policy="eldr")))
    router = _router(predicting, table)
    router.ready(30)
    replicas = [Replica("r0"), Replica("r1")]

    async def go():
        async def request():  # Ray runs each actor task with its id in this variable
            ray._raylet.async_task_id.set(b"the request's task")
            left = _pending({"model": "tiny", "prompt": list(range(12))})
            await router.choose_replicas(replicas, left)
            left.future.cancel()

        await asyncio.create_task(request())
        await _settle()

    asyncio.run(go())
    assert table.calls == ["reserve", "release:cancelled"]
    assert table.release_tasks == [None]
    assert table.table.snapshot()["held"] == 0
    router.close()


def test_other_methods_and_a_dead_or_slow_table_go_by_load_without_holding(artifacts):
    _, predicting, _ = artifacts
    table = _table(predicting)
    router = _router(predicting, table)
    router.ready(30)
    replicas = [Replica("r0"), Replica("r1")]
    broken = _router(predicting, BrokenTable(table.table))
    slow_table = SlowTable(table.table)
    slow = _router(predicting, slow_table, table_timeout=0.05)
    for r in (broken, slow):
        r.ready(30)

    async def go():
        other = await router.choose_replicas(replicas, _pending({}, method="llm_config"))
        none = await router.choose_replicas([], _pending({"prompt": [1]}))
        dead = await broken.choose_replicas(replicas, _pending({"prompt": list(range(12))}))
        late = await slow.choose_replicas(replicas, _pending({"prompt": list(range(12))}))
        await asyncio.sleep(0.5)  # the slow reservation lands, and is given back
        await _settle()
        return other, none, dead, late

    other, none, dead, late = asyncio.run(go())
    assert [len(r) for r in other] == [2] and none == []
    for ranks in (dead, late):  # every replica: Serve's load check decides
        assert [len(r) for r in ranks] == [2]
    assert table.calls == []  # the llm_config call held nothing
    assert slow_table.calls == ["reserve", "release:cancelled"]
    assert table.table.snapshot()["held"] == 0 and _loads(table) == [0.0, 0.0]
    assert broken.stats()["counters"]["fallbacks:table"] == 1
    assert slow.stats()["counters"]["fallbacks:table"] == 1
    assert slow.stats()["counters"]["released:late"] == 1
    for r in (router, broken, slow):
        r.close()


def test_request_router_kwargs_are_validated(artifacts, tmp_path):
    _, predicting, _ = artifacts
    with pytest.raises(ValueError, match=r"unknown request_router_kwargs.*'polcy'"):
        DecodeRouterConfig.from_kwargs({"artifact": predicting, "polcy": "eldr"})
    with pytest.raises(ValueError, match="num_decode"):
        DecodeRouterConfig(policy="eldr_cost")
    with pytest.raises(ValueError, match="table_timeout"):
        DecodeRouterConfig(artifact=predicting, table_timeout=0)
    with pytest.raises(ValueError, match="prompt_timeout"):
        DecodeRouterConfig(artifact=predicting, prompt_timeout=-1)
    with pytest.raises(ValueError, match="2 decode workers"):
        DecodeRouterConfig(artifact=predicting, policy="eldr", num_decode=3)
    config = DecodeRouterConfig(artifact=predicting, policy="eldr")
    assert config.decoders == 2 and config.table_config().num_decode == 2
    assert DecodeRouterConfig(num_decode=4, policy="jsq").table_config().num_decode == 4


def test_prompt_body_reads_request_models_and_dicts():
    pydantic = pytest.importorskip("pydantic")

    class Chat(pydantic.BaseModel):
        model: str
        messages: list
        add_generation_prompt: bool = True
        temperature: float = 1.0

    assert prompt_body(Chat(model="m", messages=[{"role": "user", "content": "hi"}])) == {
        "messages": [{"role": "user", "content": "hi"}]}  # only what was set
    assert prompt_body({"prompt": "x", "max_tokens": 3}) == {"prompt": "x"}
    assert prompt_body(None) is None


def test_the_router_class_survives_serves_pickling_by_value():
    """Serve pickles the router's module by value (``RequestRouterConfig``): the class
    must pickle and come back whole (a lock at module or class level would not)."""
    from ray.serve.config import RequestRouterConfig

    config = RequestRouterConfig(
        request_router_class="eldr.integrations.ray.router:EldrDecodeRouter",
        request_router_kwargs={"num_decode": 2, "policy": "jsq"})
    cls = config.get_request_router_class()
    assert cls.__name__ == "EldrDecodeRouter" and hasattr(cls, "choose_replicas")
