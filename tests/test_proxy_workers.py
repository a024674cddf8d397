"""``eldr serve --workers N`` (eldr.proxy.workers): the port, the shared tracker, and the
elastic pool across worker processes (real ``eldr serve`` processes, stand-in engines)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from _proxy_fakes import FakeEngine
from eldr.proxy.workers import supervisor as workers
from eldr.proxy.workers.sharedpool import SharedLoads, SharedLoadTracker, WorkerShare
from eldr.proxy.workers.supervisor import reserve_port


def test_guards_are_private_outside_workers_and_shared_inside():
    from eldr.proxy.config import ServeConfig
    from eldr.proxy.request.containment import GuardBuffers, body_digest, make_guards

    config = ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",),
                         policy="jsq", retry_budget_ratio=1.0, retry_budget_min=0.0)
    one, _ = make_guards(config)
    two, _ = make_guards(config)
    one.add(body_digest(b"x"))
    assert two.seconds_left(body_digest(b"x")) is None  # one process: its own list
    buffers = GuardBuffers.allocate(config, 2)  # made before fork in run_workers
    (poison0, budget0), (poison1, budget1) = (make_guards(config, buffers, row)
                                              for row in (0, 1))
    poison0.add(body_digest(b"y"))
    assert poison1.seconds_left(body_digest(b"y")) is not None
    budget0.on_request()  # one request in worker 0 allows one retry, taken by worker 1
    assert budget1.try_retry() and not budget0.try_retry()


def test_a_workers_tracker_writes_its_row_at_its_slots():
    table = SharedLoads(2, 4)
    share = WorkerShare(table, 1, (2, 0))
    t = share.tracker(2)
    assert isinstance(t, SharedLoadTracker)
    t.on_dispatch(0)
    assert np.array_equal(table.in_flight, [[0, 0, 0, 0], [0, 0, 1, 0]])
    with pytest.raises(ValueError, match="does not match"):
        share.tracker(3)


def test_reserve_port_lets_workers_bind_the_same_port():
    holder, port = reserve_port("127.0.0.1", 0)
    try:
        second, same = reserve_port("127.0.0.1", port)
        second.close()
        assert same == port > 0
    finally:
        holder.close()


def test_workers_that_cannot_start_stop_the_parent_with_status_1():
    from eldr.proxy.config import ServeConfig

    config = ServeConfig(prefill_urls=("http://127.0.0.1:9",), decode_urls=(
        "http://127.0.0.1:9",), policy="jsq", port=0, workers=2)

    def broken_router(cfg, share):
        raise ValueError("no artifact here")

    async def never(router, **kw):  # pragma: no cover - the router never gets built
        raise AssertionError("serve called")

    ports = []
    assert workers.run_workers(config, broken_router, never, ready=ports.append) == 1
    assert ports and ports[0] > 0


# -- the elastic pool across worker processes ----------------------------------------------
TOKEN = "workers-pool-token"


class _Serve:
    """``eldr serve --workers 2`` as a process; every call opens a new connection, so the
    kernel spreads the calls over both workers."""

    def __init__(self, tmp_path, *argv: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.err = open(tmp_path / "serve.log", "w+")  # read at the end
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eldr", "serve", "--port", str(self.port), "--workers",
             "2", "--health-interval", "0.2", *argv], stderr=self.err,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "ELDR_ADMIN_TOKEN": TOKEN})

    def call(self, method: str, path: str, body=None, timeout: float = 10):
        req = urllib.request.Request(self.base + path, method=method, headers={
            "Authorization": f"Bearer {TOKEN}"},
            data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    async def up(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            try:
                await asyncio.to_thread(self.call, "GET", "/health", None, 1)
                break
            except OSError:
                continue
        else:
            pytest.fail("eldr serve --workers 2 did not come up")
        while time.monotonic() < deadline:  # both workers listen (each says so)
            if (tmp := open(self.err.name).read()).count("listening on") >= 2:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the second worker did not come up: {tmp}")

    async def names_everywhere(self, calls: int = 16) -> set:
        """The decoder lists the workers answer, over ``calls`` connections."""
        got = set()
        for _ in range(calls):
            _, doc = await asyncio.to_thread(self.call, "GET", "/admin/decoders")
            got.add(tuple(d["name"] for d in doc["decoders"]))
        return got

    async def until(self, names: tuple, timeout: float = 10.0) -> set:
        deadline = time.monotonic() + timeout
        while True:
            seen = await self.names_everywhere(8)
            if seen == {names} or time.monotonic() > deadline:
                return seen
            await asyncio.sleep(0.1)

    async def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while self.proc.poll() is None and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
        self.err.seek(0)
        return self.proc.returncode, self.err.read()


class _Load:
    """``width`` clients streaming back to back, each request on a new connection."""

    def __init__(self, base: str, width: int = 8) -> None:
        self.base, self.width = base, width
        self.results: list[tuple[int, str, str | None]] = []
        self._stop = asyncio.Event()

    async def _loop(self, session, w: int) -> None:
        i = w
        while not self._stop.is_set():
            try:
                async with session.post(self.base + "/v1/completions", json={
                        "prompt": f"p{i}", "stream": True}) as r:
                    self.results.append((r.status, (await r.read()).decode(),
                                         r.headers.get("X-Eldr-Decoder")))
            except Exception as exc:  # counted as a failure
                self.results.append((0, repr(exc), None))
            i += self.width

    async def __aenter__(self):
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self._tasks = [asyncio.ensure_future(self._loop(self._session, w))
                       for w in range(self.width)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._session.close()


async def _hold(srv: _Serve, engines, timeout: float = 6) -> list:
    """Send one decode per engine (all in ``hang`` mode), each only once the one before
    is held there: with a fixed sleep a loaded CI machine counted before the last had
    arrived, or sent it while every health check had timed out, so it was refused. A
    refused one is sent again. Returns the held calls (they end by timing out)."""
    held: list = []
    for i in range(len(engines)):
        deadline = time.monotonic() + 20
        while sum(len(e.requests) for e in engines) < i + 1:
            if len(held) == i or held[-1].done():
                if len(held) > i:
                    held.pop()
                held.append(asyncio.ensure_future(asyncio.to_thread(
                    srv.call, "POST", "/v1/completions", {"prompt": f"h{i}"}, timeout)))
            assert time.monotonic() < deadline, f"held decode {i} never reached an engine"
            await asyncio.sleep(0.05)
    return held


def _processes(engine) -> set[str]:
    """The router processes that sent ``engine`` requests (each tags its upstream ids)."""
    return {rid.rsplit("-", 1)[0] for rid in engine.request_ids}


def test_pool_changes_on_one_worker_reach_every_worker_and_a_removal_fails_nothing(tmp_path):
    """Two workers, decoders a and b, three slots: c added on one worker is listed, routed
    to and counted by both; a fourth is refused (no slot); a is removed under load by
    DELETE ?wait=true (zero failures, nothing sent there once removed everywhere); then the
    decoders file + SIGHUP to the parent takes d0's URL back as e, in a's freed slot."""
    decoders = tmp_path / "decoders"

    async def go():
        pre = await FakeEngine("p").start()
        d0, d1, d2 = [await FakeEngine(n, tokens=6).start() for n in ("d0", "d1", "d2")]
        decoders.write_text(f"a={d0.url}\nb={d1.url}\n")
        srv = _Serve(tmp_path, "--prefill", pre.url, "--decoders-file", str(decoders),
                     "--policy", "jsq", "--decoder-slots", "3")
        out = {}
        try:
            await srv.up()
            out["add"] = await asyncio.to_thread(srv.call, "POST", "/admin/decoders",
                                                 {"url": d2.url, "name": "c"})
            out["after_add"] = await srv.until(("a", "b", "c"))
            out["full"] = await asyncio.to_thread(srv.call, "POST", "/admin/decoders",
                                                  {"url": "http://127.0.0.1:9", "name": "x"})
            # counted in every worker: three decodes held in flight, one at a time, over
            # new connections; jsq on the shared loads puts one at each decoder
            for e in (d0, d1, d2):
                e.mode = "hang"
            held = await _hold(srv, (d0, d1, d2))
            out["held_at"] = [len(e.requests) for e in (d0, d1, d2)]
            out["loads"] = set()
            for _ in range(16):
                _, doc = await asyncio.to_thread(srv.call, "GET", "/health")
                out["loads"].add(tuple(d["load"] for d in doc["decode"]))
            await asyncio.gather(*held, return_exceptions=True)  # they time out: cancelled
            for e in (d0, d1, d2):
                e.mode = "slow"  # 6 tokens, 50 ms apart: requests overlap
            async with _Load(srv.base) as load:
                await asyncio.sleep(1.5)
                out["a_before"] = (len(d0.requests), _processes(d0))
                out["c_processes"] = _processes(d2)
                out["remove"] = await asyncio.to_thread(srv.call, "DELETE",
                                                        "/admin/decoders/a?wait=true",
                                                        None, 30)
                out["a_at_removal"] = len(d0.requests)
                await asyncio.sleep(1.0)
            out["results"] = load.results
            out["a_after"] = len(d0.requests)
            out["aborted_a"], out["finished_a"] = d0.aborted, d0.finished_streams
            out["after_remove"] = await srv.names_everywhere()
            decoders.write_text(f"b={d1.url}\nc={d2.url}\ne={d0.url}\n")
            srv.proc.send_signal(signal.SIGHUP)
            out["after_file"] = await srv.until(("b", "c", "e"))
            for e in (d0, d1, d2):
                e.mode = "ok"
            out["served"] = [(await asyncio.to_thread(srv.call, "POST", "/v1/completions",
                                                      {"prompt": f"q{i}"}))[0]
                             for i in range(6)]
            return out, *(await srv.stop())
        finally:
            if srv.proc.poll() is None:
                srv.proc.kill()
            for e in (pre, d0, d1, d2):
                await e.close()

    out, rc, err = asyncio.run(go())
    assert out["add"][0] == 201 and out["add"][1]["added"]["name"] == "c", out["add"]
    assert out["after_add"] == {("a", "b", "c")}, err  # every worker has c
    assert out["full"][0] == 409 and "all 3 decoder slots" in out["full"][1]["error"]["message"]
    assert "--decoder-slots" in out["full"][1]["error"]["message"]
    assert out["held_at"] == [1, 1, 1], err  # the 3rd went to c: both saw a and b busy
    assert out["loads"] == {(1.0, 1.0, 1.0)}  # every worker counts every held decode
    assert len(out["c_processes"]) == 2  # both workers routed to the added decoder
    n_before, procs = out["a_before"]
    assert n_before > 0 and len(procs) == 2  # a was busy, from both workers
    assert out["remove"][0] == 200 and out["remove"][1]["removed"] == "a", out["remove"]
    results = out["results"]
    failed = [r for r in results if r[0] != 200 or not r[1].rstrip().endswith("[DONE]")
              or "tok5" not in r[1]]
    print(f"\n--workers 2, one decoder removed under load: {len(results)} streams, "
          f"{len(failed)} failed; {n_before} decodes at a before its removal")
    assert len(results) > 40 and failed == [], failed[:3]
    # every stream sent to a ran to its end there (the one held above aside)
    assert out["aborted_a"] == 0 and out["finished_a"] == out["a_after"] - 1
    assert out["a_after"] == out["a_at_removal"]  # nothing went to a once removed
    assert out["after_remove"] == {("b", "c")}
    assert out["after_file"] == {("b", "c", "e")}, err
    assert out["served"] == [200] * 6
    assert "removed by every worker: slot 0 is free" in err
    assert rc == 0, err


def _worker_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
    return sorted(int(p) for p in out.stdout.split())


def test_a_restarted_worker_replays_the_pool_journal(tmp_path):
    """After c is added, a removed, a reload (the journal's new base) and d added, a worker
    killed and restarted builds the same pool (b, c, d) from the base and the entry after
    it, with d in the same load slot as the other worker's."""

    async def go():
        pre = await FakeEngine("p").start()
        engines = [await FakeEngine(n).start() for n in ("d0", "d1", "d2", "d3")]
        srv = _Serve(tmp_path, "--prefill", pre.url, "--decode", f"a={engines[0].url}",
                     "--decode", f"b={engines[1].url}", "--policy", "jsq")
        out = {}
        try:
            await srv.up()
            t0 = time.monotonic()
            out["c"] = await asyncio.to_thread(srv.call, "POST", "/admin/decoders",
                                               {"url": engines[2].url, "name": "c"})
            out["a"] = await asyncio.to_thread(srv.call, "DELETE",
                                               "/admin/decoders/a?wait=true")
            out["reload"] = await asyncio.to_thread(srv.call, "POST", "/admin/reload", {})
            out["d"] = await asyncio.to_thread(srv.call, "POST", "/admin/decoders",
                                               {"url": engines[3].url, "name": "d"})
            before = _worker_pids(srv.proc.pid)
            await asyncio.sleep(max(0.0, 6.0 - (time.monotonic() - t0)))  # past start-up
            os.kill(before[0], signal.SIGKILL)
            for _ in range(100):
                await asyncio.sleep(0.1)
                after = _worker_pids(srv.proc.pid)
                if len(after) == 2 and after != before:
                    break
            for _ in range(300):  # the new worker imports, replays and listens
                if open(srv.err.name).read().count("listening on") >= 3:
                    break
                await asyncio.sleep(0.1)
            out["pids"] = before, after
            out["names"] = await srv.names_everywhere()
            for e in engines[1:]:
                e.mode = "hang"
            held = await _hold(srv, engines[1:])  # one at each of b, c, d
            out["held_at"] = [len(e.requests) for e in engines[1:]]
            out["loads"] = set()
            for _ in range(16):
                _, doc = await asyncio.to_thread(srv.call, "GET", "/health")
                out["loads"].add(tuple(d["load"] for d in doc["decode"]))
            await asyncio.gather(*held, return_exceptions=True)
            return out, *(await srv.stop())
        finally:
            if srv.proc.poll() is None:
                srv.proc.kill()
            for e in (pre, *engines):
                await e.close()

    out, rc, err = asyncio.run(go())
    assert out["c"][0] == 201 and out["a"][0] == 200 and out["d"][0] == 201, out
    assert out["reload"][0] == 200 and out["reload"][1]["decoders"] == ["b", "c"]
    before, after = out["pids"]
    assert before[0] not in after and len(after) == 2, out["pids"]
    assert "starting it again" in err and "replayed 1 pool journal entries" in err, err
    assert out["names"] == {("b", "c", "d")}, err
    assert out["held_at"] == [1, 1, 1], err
    assert out["loads"] == {(1.0, 1.0, 1.0)}, err
    assert rc == 0, err
