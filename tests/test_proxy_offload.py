"""Prompt work off the event loop (eldr.proxy.request.offload): a slow tokenization or
prediction holds up no other request, a full queue or a late job routes by load (counted,
never refused), and text is tokenized in a worker process as in the router."""

import asyncio
import dataclasses
import functools
import threading
import time

import numpy as np
import pytest

from _proxy_fakes import cluster, domain_counts, fake_encoder, run, until
from eldr.proxy.config import ServeConfig
from eldr.proxy.request.prompts import PromptRouting, PromptTokenizer, tokenizer_dir_for

CODE_IDS = [11, 12, 13]  # the fake predictor's "code" prompt
LAW_IDS = [21, 22, 23]
HOLD_LIMIT = 20.0  # the longest a Held job waits for its release (then the test fails)


class Held:
    """A slow tokenization or prediction: a blocking call that holds its thread until the
    test releases it, so that the test knows the job is still running when it checks
    another request, however slow the machine (a job that takes a fixed time, 0.8 s as
    these tests had, may end first on a loaded one)."""

    def __init__(self) -> None:
        self.started, self.released = threading.Event(), threading.Event()
        self.done = threading.Event()  # the job went on (released, or HOLD_LIMIT passed)

    def __call__(self) -> None:
        self.started.set()
        self.released.wait(HOLD_LIMIT)
        self.done.set()


def _predict(ids, slow=None):
    """The fake model's inputs (prompts holding 11 look like code); a prompt holding 99 is
    slow to predict when ``slow`` is given (a blocking call, as a prediction on the loop
    would be)."""
    ids = np.asarray(ids).tolist()
    if 99 in ids and slow is not None:
        slow()
    counts = domain_counts("code" if 11 in ids else "law")
    signature = fake_encoder().transform(counts).reshape(-1).astype(np.float32)
    profile = (counts / counts.sum(axis=1, keepdims=True) * 4).astype(np.float32)
    return signature, profile


class SlowTokenizer:
    """Encodes any text as the code prompt, blocking in ``slow``."""

    def __init__(self, slow) -> None:
        self.slow = slow

    def encode(self, text, *, add_special_tokens=True):
        self.slow()
        return list(CODE_IDS)


def _with_prompt(router, tokenizer=None, predict=_predict) -> None:
    router.swap(dataclasses.replace(router.state, prompt=PromptRouting(
        predict=predict, tokenizer=tokenizer, fingerprint="")))


def _held(router, held: Held, tokenizer: bool = False) -> None:
    """Prompt routing whose slow work (a text's tokenization, a prediction of ids holding
    99) is ``held``."""
    _with_prompt(router, SlowTokenizer(held) if tokenizer else None,
                 functools.partial(_predict, slow=held))


def _m(router, name, **labels):
    return getattr(router.metrics, name).get(**labels)


async def _timed(client, body):
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json={"model": "tiny", **body})
    await r.read()
    return r.status, r.headers["X-Eldr-Decoder"], time.perf_counter() - t0


@pytest.mark.parametrize("slow_body", [{"prompt": "some text"}, {"prompt": [99, 11]}],
                         ids=["tokenization", "prediction"])
def test_a_slow_prompt_does_not_hold_up_another_requests_relay(slow_body):
    """The slow request's job blocks a prompt thread until the test releases it; a
    request sent once it has started, routed on its own (quick) prediction, is relayed
    meanwhile. (Held, not for a fixed time: on a loaded machine the quick request could
    take longer than that and be called "behind" the slow one.)"""
    held = Held()

    async def go():
        async with cluster(engine_kw={"payload": "none"}, prompt_processes=0,
                           prompt_timeout=HOLD_LIMIT + 10) as (router, client, _, _d):
            _held(router, held, tokenizer=True)
            slow = asyncio.ensure_future(_timed(client, slow_body))
            await until(held.started.is_set, "the slow job started")
            try:
                quick = await _timed(client, {"prompt": LAW_IDS})
                # answered while the slow job was still held: not behind it
                meanwhile = (not held.done.is_set(), not slow.done())
            finally:
                held.released.set()
            return router, await slow, quick, meanwhile

    router, slow, quick, meanwhile = run(go())
    assert slow[:2] == (200, "w-code")  # routed on its prediction, made once released
    assert quick[:2] == (200, "w-other")
    assert meanwhile == (True, True)  # not behind the slow one
    assert _m(router, "predictions", result="ok") == 2
    assert router.metrics.prompt_work.count() == 2


def test_a_full_queue_routes_by_load_and_never_refuses():
    held = Held()  # the slow job, holding the queue's one place until released

    async def go():
        async with cluster(engine_kw={"payload": "none"}, prompt_threads=1, prompt_queue=1,
                           prompt_timeout=HOLD_LIMIT + 10) as (router, client, _, _d):
            _held(router, held)
            slow = asyncio.ensure_future(_timed(client, {"prompt": [99, 11]}))
            await until(held.started.is_set, "the slow job started")
            try:
                busy = await _timed(client, {"prompt": CODE_IDS})
                meanwhile = not held.done.is_set()  # answered with the queue still full
            finally:
                held.released.set()
            return router, await slow, busy, meanwhile

    router, slow, busy, meanwhile = run(go())
    assert slow[0] == busy[0] == 200
    assert meanwhile  # not behind the slow job
    assert _m(router, "predictions", result="busy") == 1
    assert _m(router, "predictions", result="ok") == 1
    assert _m(router, "fallbacks", reason="missing") == 1  # routed by load, counted
    assert _m(router, "route_inputs", source="none") == 1


def test_a_late_prediction_routes_by_load_and_its_retry_does_not_wait_again():
    # The late job is held until released (it outlasts any timeout); the timeout is the
    # time the other job has for its prediction: 1 s, room for a loaded machine.
    held = Held()

    async def go():
        async with cluster(engine_kw={"payload": "none"}, prompt_timeout=1.0) as (
                router, client, _, _d):
            _held(router, held)
            try:
                late = await _timed(client, {"prompt": [99, 11]})
                meanwhile = not held.done.is_set()  # routed by load, its job still held
                ok = await _timed(client, {"prompt": CODE_IDS})
            finally:
                held.released.set()  # the late job ends: its place in the queue is free
            await until(lambda: router.flow.prompts.in_flight == 0, "the late job ended")
            return router, late, ok, meanwhile

    router, late, ok, meanwhile = run(go())
    assert late[0] == 200 and meanwhile
    assert ok[:2] == (200, "w-code")
    assert _m(router, "predictions", result="timeout") == 1
    assert _m(router, "predictions", result="ok") == 1
    assert router.metrics.prompt_queue.count() == 2  # both jobs started on a thread


def test_text_is_tokenized_in_a_worker_process_as_in_the_router():
    pytest.importorskip("tokenizers")
    tok = PromptTokenizer(tokenizer_dir_for("tiny_moe"))
    seen = []

    def predict(ids):
        seen.append(np.asarray(ids).tolist())
        return _predict(CODE_IDS)

    async def go():
        async with cluster(engine_kw={"payload": "none"}, prompt_processes=1) as (
                router, client, _, _d):
            router.swap(dataclasses.replace(router.state, prompt=PromptRouting(
                predict=predict, tokenizer=tok, fingerprint="")))
            await asyncio.gather(*map(asyncio.wrap_future, router.flow.prompts.prepare(tok)))
            r = await _timed(client, {"prompt": "hello there, router"})
            return router, r

    router, r = run(go())
    assert r[:2] == (200, "w-code")
    # the swap's warm-up runs the predictor once on a one-token prompt (numba compiles
    # for the predictor's own arrays then, not on a request); then the request's ids
    assert seen == [[0], tok.encode("hello there, router")]
    assert _m(router, "predictions", result="ok") == 1


@pytest.mark.parametrize("field,value", [
    ("prompt_threads", 0), ("prompt_threads", True), ("prompt_processes", -1),
    ("prompt_queue", 0), ("prompt_timeout", 0), ("prompt_timeout", float("nan")),
    ("prompt_timeout", 61)])
def test_prompt_work_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",),
                    **{field: value})


def test_a_routing_state_that_predicts_loads_the_compiled_kernel_beforehand(monkeypatch):
    from eldr.fit import prompt as prompt_mod

    monkeypatch.setattr(prompt_mod, "_compiled", [])  # as in a fresh process

    async def go():
        async with cluster(engine_kw={"payload": "none"}) as (router, _c, _p, _d):
            _with_prompt(router)
            await asyncio.gather(*map(asyncio.wrap_future, router.flow.prompts.prepare(None)))
            return list(prompt_mod._compiled)

    loaded = run(go())
    assert len(loaded) == 1  # tried once (the module, or None without numba)


def test_health_says_warming_until_the_prompt_machinery_is_loaded(monkeypatch):
    """A routing state that predicts from prompts: /health reports ``prompt_routing``
    "warming" while its kernel loads (requests then would be routed by load), "ready"
    after; never "warming" past WARM_UP_LIMIT_S, whatever hangs."""
    import concurrent.futures

    from eldr.proxy.request import offload

    async def go():
        async with cluster(engine_kw={"payload": "none"}) as (router, client, _p, _d):
            before = (await (await client.get("/health")).json()).get("prompt_routing")
            _with_prompt(router)
            held = concurrent.futures.Future()  # a load that has not finished
            prompts = router.flow.prompts
            prompts._warming, prompts._warm_until = [held], time.monotonic() + 60
            warming = (await (await client.get("/health")).json())["prompt_routing"]
            held.set_result(None)
            ready = (await (await client.get("/health")).json())["prompt_routing"]
            prompts._warming = [concurrent.futures.Future()]  # hangs, but past the limit
            prompts._warm_until = time.monotonic() - 1
            late = (await (await client.get("/health")).json())["prompt_routing"]
            return before, warming, ready, late

    assert run(go()) == (None, "warming", "ready", "ready")
    assert offload.WARM_UP_LIMIT_S > 0


def _offload(**config_kw):
    from types import SimpleNamespace

    from eldr.proxy.metrics import RouterMetrics
    from eldr.proxy.request.offload import PromptOffload

    config = ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",),
                         **config_kw)
    return PromptOffload(config, RouterMetrics(SimpleNamespace(prefill=[], decode=[])))


def test_aclose_waits_for_the_tokenizer_processes_and_their_manager_thread():
    """A pool shut down without waiting leaves its manager thread running, which on
    CPython 3.11 can print an EBADF traceback at interpreter exit: after ``aclose`` the
    workers and that thread are gone, and no new processes start."""
    pytest.importorskip("tokenizers")
    tok = PromptTokenizer(tokenizer_dir_for("tiny_moe"))

    async def go():
        prompts = _offload(prompt_processes=2)
        await asyncio.gather(*map(asyncio.wrap_future, prompts.prepare(tok)))
        pool = prompts._processes.pool
        workers = list(pool._processes.values())
        manager = pool._executor_manager_thread
        await prompts.aclose()
        return workers, manager, prompts

    workers, manager, prompts = run(go())
    assert len(workers) == 2
    assert [w.is_alive() for w in workers] == [False, False]
    assert not manager.is_alive()
    assert prompts._tokenizer_processes(tok) is None and prompts._processes is None


class _StuckPool:
    """A process pool whose shutdown blocks until the test releases it (a tokenization
    that never ends)."""

    def __init__(self) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        self.process = _FakeProcess()
        self._processes = {1: self.process}

    def shutdown(self, wait=True, *, cancel_futures=False):
        self.entered.set()
        if wait:
            self.released.wait(HOLD_LIMIT)


class _FakeProcess:
    def __init__(self) -> None:
        self.terminated = False

    def is_alive(self) -> bool:
        return not self.terminated

    def terminate(self) -> None:
        self.terminated = True


def test_a_stuck_tokenizer_shutdown_times_out_with_one_warning(caplog):
    """aclose gives up after its timeout: one warning, the workers killed, and the
    router's shutdown goes on (not held until the shutdown ends)."""
    from eldr.proxy.request import offload

    pool = _StuckPool()

    async def go():
        prompts = _offload(prompt_processes=1)
        procs = object.__new__(offload._TokenizerProcesses)
        procs.tokenizer, procs.pool = None, pool
        prompts._processes = procs
        try:
            await prompts.aclose(timeout=0.2)
            return pool.entered.is_set(), not pool.released.is_set()
        finally:
            pool.released.set()

    with caplog.at_level("WARNING", logger="eldr.serve"):
        entered, still_stuck = run(go())
    assert entered and still_stuck  # returned while the shutdown was still blocked
    assert pool.process.terminated
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "did not stop" in warnings[0].getMessage()


def test_the_routers_stop_waits_for_the_tokenizer_processes():
    """RequestFlow.stop (the app's cleanup) shuts the tokenizer processes down with
    aclose: once the router has stopped, none is left running."""
    pytest.importorskip("tokenizers")
    tok = PromptTokenizer(tokenizer_dir_for("tiny_moe"))

    async def go():
        async with cluster(engine_kw={"payload": "none"}, prompt_processes=1) as (
                router, _c, _p, _d):
            _with_prompt(router, tok)
            await asyncio.gather(*map(asyncio.wrap_future, router.flow.prompts.prepare(tok)))
            pool = router.flow.prompts._processes.pool
            workers, manager = list(pool._processes.values()), pool._executor_manager_thread
        return workers, manager

    workers, manager = run(go())
    assert workers and not any(w.is_alive() for w in workers)
    assert not manager.is_alive()
