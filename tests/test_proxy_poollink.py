"""A worker's link to the pool journal (eldr.proxy.workers.poollink), in one process: the router
of a stand-in cluster talks to a parent (workers._Parent) over a real socketpair."""

import asyncio
import json
import socket

import numpy as np

from _proxy_fakes import FakeEngine, cluster, run
from eldr.proxy.workers import supervisor as workers
from eldr.proxy.workers.poollink import PoolLink
from eldr.proxy.workers.sharedpool import (
    PoolJournal,
    SharedLoads,
    SharedLoadTracker,
    WorkerShare,
)

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class _FakeParent:
    """The parent's message handling (workers._Parent) for one worker, row 0, pumped by a
    task of the test's loop instead of the parent's select loop."""

    def __init__(self, router, table: SharedLoads) -> None:
        mine, theirs = socket.socketpair()
        names = list(router.state.worker_names)
        self.journal = PoolJournal(names, [i.url for i in router.pool.decode], 4, table=table)
        self.child = workers._Child(0, mine)
        self.parent = workers._Parent(self.journal, {0: self.child})
        self.link = PoolLink(theirs, 0, elastic=router.elastic, reloader=router.reloader)
        router.attach_link(self.link)
        self._mine = mine

    async def start(self) -> None:
        await self.link.start()
        self._mine.setblocking(False)
        self._task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.005)
            try:
                data = self._mine.recv(1 << 16)
            except BlockingIOError:
                data = None
            if data:
                self.child.inbox += data
                while b"\n" in self.child.inbox:
                    line, _, rest = bytes(self.child.inbox).partition(b"\n")
                    self.child.inbox = bytearray(rest)
                    self.parent.handle(0, json.loads(line))
            if self.child.outbox:
                await loop.sock_sendall(self._mine, bytes(self.child.outbox))
                self.child.outbox.clear()

    async def stop(self) -> None:
        self._task.cancel()
        await self.link.stop()


def _shared(slots=(0, 1)) -> WorkerShare:
    """Row 0 of a two-worker load table with four slots."""
    return WorkerShare(SharedLoads(2, 4), 0, tuple(slots))


def test_changes_apply_through_the_journal_with_their_slots():
    share = _shared()

    async def go():
        async with cluster(policy="eldr", admin_token=TOKEN, share=share) as (
                router, client, _p, _d):
            assert isinstance(router.pool.tracker, SharedLoadTracker)
            fake = _FakeParent(router, share.loads)
            await fake.start()
            extra = await FakeEngine("d2").start()
            try:
                for _ in range(2):  # 'code' prompts: w-code is the busiest cluster
                    await client.post("/v1/completions", json={"model": "tiny",
                                                               "prompt": "write code"})
                r = await client.post("/admin/decoders", json={"url": extra.url,
                                                               "name": "w-new"}, headers=AUTH)
                added = r.status, (await r.json())["added"]
                dup = (await client.post("/admin/decoders", json={"url": extra.url},
                                         headers=AUTH)).status
                slots = list(router.pool.tracker.slots)
                centroids = router.state.policy.centroids.copy()
                r = await client.post("/v1/completions", json={"model": "tiny",
                                                               "prompt": "write code x"})
                table_after = share.loads.in_flight.copy()
                gone = await client.delete("/admin/decoders/w-code?wait=true", headers=AUTH)
                slots_gone = list(router.pool.tracker.slots)
                unknown = (await client.delete("/admin/decoders/zz", headers=AUTH)).status
                last = await client.delete("/admin/decoders/w-other", headers=AUTH)
                return (added, dup, slots, centroids, table_after, gone.status,
                        await gone.json(), unknown, last.status, slots_gone, fake.journal)
            finally:
                await fake.stop()
                await extra.close()

    (added, dup, slots, centroids, table_after, gone, gone_doc, unknown, last, slots_gone,
     journal) = run(go())
    assert added[0] == 201 and added[1]["name"] == "w-new"
    assert dup == 409  # the journal's check: the URL is in the pool
    assert slots == [0, 1, 2]
    np.testing.assert_array_equal(centroids[2], centroids[0])  # like = the busiest, by name
    assert table_after.sum() == 0  # every request released its slot
    assert gone == 200 and [d["name"] for d in gone_doc["decoders"]] == ["w-other", "w-new"]
    assert slots_gone == [1, 2]  # w-code's slot left with it
    assert "w-code" not in journal.decoders
    assert unknown == 404
    assert last == 202  # w-new still takes requests: w-other may drain


def test_a_reload_waits_for_earlier_drains_here():
    share = _shared()

    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN, engine_kw={"tokens": 10},
                           share=share) as (
                router, client, _p, decoders):
            fake = _FakeParent(router, share.loads)
            await fake.start()
            try:
                decoders[0].mode = "slow"  # 10 tokens 50 ms apart at w-code
                stream = await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": "x", "stream": True})
                await stream.content.readany()
                assert (await client.delete("/admin/decoders/w-code",
                                            headers=AUTH)).status == 202
                reload = asyncio.ensure_future(client.post("/admin/reload", headers=AUTH))
                await asyncio.sleep(0.1)
                early = reload.done()
                await stream.read()
                r = await reload
                await asyncio.sleep(0.1)  # its "reloaded" report reaches the parent
                return early, r.status, await r.json(), fake.journal
            finally:
                await fake.stop()

    early, status, doc, journal = run(go())
    assert not early  # it waited for the drain of the entry before it
    assert status == 200 and doc["decoders"] == ["w-other"]
    assert journal.base["names"] == ["w-other"] and journal.base["slots"] == [1]
    assert journal.entries == []  # the confirmed reload is the new base


def test_replay_rebuilds_the_pool_of_a_restarted_worker():
    share = _shared()

    async def go():
        async with cluster(policy="round_robin", admin_token=TOKEN, share=share) as (
                router, _client, _p, _d):
            link = PoolLink(socket.socketpair()[1], 0, elastic=router.elastic,
                            reloader=router.reloader)
            link.replay([
                {"seq": 1, "op": "add", "name": "x", "url": "http://127.0.0.1:9", "slot": 3,
                 "like": None},
                {"seq": 2, "op": "drain", "name": "w-code", "slot": 0},
                {"seq": 3, "op": "reload", "artifact": None},
                {"seq": 4, "op": "add", "name": "x", "url": "http://127.0.0.1:9", "slot": 2,
                 "like": None},  # refused here (x exists): logged, the rest goes on
            ])
            return (router.state.worker_names, router.pool.tracker.slots,
                    router.config.decode_ids, router.state.policy.num_workers)

    names, slots, ids, k = run(go())
    assert names == ids == ("w-other", "x") and slots == [1, 3] and k == 2


def test_a_removal_that_fails_in_a_worker_answers_500_and_keeps_the_slot():
    share = _shared()

    async def go():
        async with cluster(policy="jsq", admin_token=TOKEN, share=share) as (
                router, client, _p, _d):
            fake = _FakeParent(router, share.loads)
            await fake.start()
            try:
                def broken(worker):
                    raise RuntimeError("a bug")

                router.state.policy.remove_worker = broken
                r = await client.delete("/admin/decoders/w-code?wait=true", headers=AUTH)
                return r.status, await r.json(), fake.journal, router.pool.decode[0].draining
            finally:
                await fake.stop()

    status, doc, journal, draining = run(go())
    assert status == 500 and "stays draining" in doc["error"]["message"]
    assert draining and journal.decoders["w-code"]["draining"]  # its slot is still held
