"""The workers' shared decoder slots and pool journal (eldr.proxy.workers.sharedpool)."""

import os

import numpy as np
import pytest

from eldr.proxy.workers.sharedpool import (
    PoolJournal,
    PoolRefused,
    SharedLoads,
    SharedLoadTracker,
    default_capacity,
)
from eldr.routing.loads import LoadTracker


def test_every_worker_sees_every_workers_in_flight_requests():
    table = SharedLoads(num_workers=2, capacity=3)
    a, b = SharedLoadTracker(table, 0, [0, 1, 2]), SharedLoadTracker(table, 1, [0, 1, 2])
    a.on_dispatch(0)
    a.on_dispatch(2)
    b.on_dispatch(2)
    assert a.loads.tolist() == b.loads.tolist() == [1.0, 0.0, 2.0]
    b.on_complete(2)
    b.on_complete(2)  # never below 0 in its own row
    assert a.loads.tolist() == [1.0, 0.0, 1.0]
    table.clear_row(0)  # a worker that died takes its requests with it
    assert b.loads.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="out of range"):
        a.on_dispatch(3)


def test_a_scraped_load_moves_with_dispatches_as_in_one_process():
    table = SharedLoads(num_workers=2, capacity=4)
    a, b = SharedLoadTracker(table, 0, [2, 3]), SharedLoadTracker(table, 1, [2, 3])
    one = LoadTracker(2)
    for t in (a, one):
        t.on_dispatch(1)
    a.report(1, 7.0)
    one.report(1, 7.0)
    b.on_dispatch(1)
    one.on_dispatch(1)
    assert a.loads.tolist() == b.loads.tolist() == one.loads.tolist() == [0.0, 8.0]
    with pytest.raises(ValueError, match="finite"):
        a.report(0, float("nan"))
    for t in (a, b, one):  # a burst the engine does not count yet: the load stays >= it
        t.on_dispatch(0)
    one.on_dispatch(0)
    a.report(0, 0.0)
    one.report(0, 0.0)
    b.on_dispatch(0)
    one.on_dispatch(0)
    assert a.loads.tolist() == one.loads.tolist() == [3.0, 8.0]


def test_a_scrape_reads_against_the_in_flight_sum_when_it_was_asked():
    """As LoadTracker: requests of any worker that end while the scrape travels leave the
    load when they end, in every worker, as in one process."""
    table = SharedLoads(num_workers=2, capacity=2)
    a, b = SharedLoadTracker(table, 0), SharedLoadTracker(table, 1)
    one = LoadTracker(2)
    for _ in range(4):
        a.on_dispatch(0)
        b.on_dispatch(0)
        one.on_dispatch(0)
        one.on_dispatch(0)
    then, one_then = a.in_flight_at(0), one.in_flight_at(0)
    assert then == one_then == 8.0
    for _ in range(2):  # 4 of the 8 end while the scrape travels: 2 of a's, 2 of b's
        a.on_complete(0)
        b.on_complete(0)
        one.on_complete(0)
        one.on_complete(0)
    a.report(0, 8.0, in_flight_then=then)
    one.report(0, 8.0, in_flight_then=one_then)
    assert a.loads.tolist() == b.loads.tolist() == one.loads.tolist() == [4.0, 0.0]
    for _ in range(2):
        a.on_complete(0)
        b.on_complete(0)
        one.on_complete(0)
        one.on_complete(0)
    assert a.loads.tolist() == one.loads.tolist() == [0.0, 0.0]


def test_the_table_is_shared_with_a_forked_worker():
    table = SharedLoads(num_workers=2, capacity=1)
    pid = os.fork()
    if pid == 0:  # the "worker": dispatch once in its own row, exit
        SharedLoadTracker(table, 1, [0]).on_dispatch(0)
        os._exit(0)
    os.waitpid(pid, 0)
    assert SharedLoadTracker(table, 0, [0]).loads.tolist() == [1.0]


def test_a_new_decoder_counts_in_its_slot_in_workers_before_and_after_the_change():
    """The transition: worker a applied the add, b not yet; a's requests to the new
    decoder land in its slot, never under one of b's indices; b sees them once it applies
    the add, at whatever index it gives the decoder."""
    table = SharedLoads(2, 8)
    a, b = SharedLoadTracker(table, 0, [0, 1]), SharedLoadTracker(table, 1, [0, 1])
    a.reserve(5)
    assert a.add_worker() == 2
    a.on_dispatch(2)
    a.on_dispatch(2)
    assert a.loads.tolist() == [0.0, 0.0, 2.0]
    assert b.loads.tolist() == [0.0, 0.0]  # b: the old set, unchanged
    b.on_dispatch(1)
    b.reserve(5)
    b.add_worker()
    assert a.loads.tolist() == b.loads.tolist() == [0.0, 1.0, 2.0]
    assert b.healthy.tolist() == [True, True, True]
    with pytest.raises(ValueError, match="no slot was reserved"):
        b.add_worker()
    with pytest.raises(ValueError, match="not a free slot"):
        b.reserve(5)  # its own decoder's


def test_a_removal_in_one_worker_shifts_only_its_own_indices():
    table = SharedLoads(2, 4)
    a, b = SharedLoadTracker(table, 0, [0, 1, 2]), SharedLoadTracker(table, 1, [0, 1, 2])
    b.on_dispatch(2)  # b's request at decoder 2 (slot 2)
    a.remove_worker(0)  # a removed drained decoder 0: its 2 is now index 1
    assert a.slots == [1, 2] and a.loads.tolist() == [0.0, 1.0]
    a.on_dispatch(1)
    assert b.loads.tolist() == [0.0, 0.0, 2.0]  # still counted at decoder 2 in b
    b.remove_worker(0)
    b.on_complete(1)
    assert a.loads.tolist() == b.loads.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="last decode worker"):
        one = SharedLoadTracker(table, 0, [3])
        one.remove_worker(0)


def test_a_freed_slot_is_zeroed_before_reuse():
    table = SharedLoads(2, 2)
    journal = PoolJournal(["a"], ["http://h:1"], 2, table=table)
    t = SharedLoadTracker(table, 1, [0])
    t.reserve(1)
    t.add_worker()  # what an "add" of slot 1 would do (no journal here)
    t.on_dispatch(1)
    t.report(1, 5.0)
    journal.add("http://h:2", "b", None)  # the journal gives slot 1 again: zeroed
    assert table.in_flight[:, 1].tolist() == [0, 0] and table.has_report[1] == 0.0


def test_default_capacity_leaves_room_to_grow():
    assert default_capacity(2) == 18 and default_capacity(40) == 80
    with pytest.raises(ValueError, match=">= 1 decoder slot"):
        SharedLoads(2, 0)


def _journal(capacity=4):
    return PoolJournal(["a", "b"], ["http://h:1", "http://h:2"], capacity)


def test_the_journal_numbers_checks_and_slots_every_change():
    j = _journal()
    e1 = j.add("http://h:3", None, like="b")
    assert e1 == {"seq": 1, "op": "add", "name": "decode-0", "url": "http://h:3", "slot": 2,
                  "like": "b"}
    assert j.add("http://h:4", "x", like="gone")["like"] is None  # unknown: no copy
    for url, name, code in (("http://h:1", "y", "decoder_exists"),
                            ("http://h:9", "a", "decoder_exists"),
                            ("http://h:9", "y", "pool_full")):
        with pytest.raises(PoolRefused) as err:
            j.add(url, name, None)
        assert err.value.status == 409 and err.value.code == code
    with pytest.raises(PoolRefused, match="--decoder-slots"):
        j.add("http://h:9", "y", None)
    assert [e["seq"] for e in j.entries] == [1, 2] and j.seq == 2


def test_a_drain_frees_its_slot_once_every_worker_removed_it():
    j = _journal(capacity=3)
    d = j.drain("a", rows=[0, 1])
    assert d["op"] == "drain" and d["slot"] == 0
    assert j.drain("a", rows=[0, 1]) == d["seq"]  # asked again: joins the running drain
    with pytest.raises(PoolRefused) as err:
        j.drain("b", rows=[0, 1])  # the last decoder taking requests
    assert err.value.code == "last_decoder"
    with pytest.raises(PoolRefused) as err:
        j.drain("zz", rows=[0, 1])
    assert err.value.status == 404
    j.add("http://h:3", "c", None)  # slot 2: a still holds slot 0
    with pytest.raises(PoolRefused, match="slots"):
        j.add("http://h:4", "d", None)
    with pytest.raises(PoolRefused, match="already in the pool"):
        j.add("http://h:1", "e", None)  # a draining decoder's URL stays taken
    assert j.removed("a", 0) is None  # worker 1 still has it
    assert j.removed("a", 1) == {"name": "a", "seq": d["seq"], "slot": 0}
    assert "a" not in j.decoders and j.removed("a", 1) is None
    assert j.add("http://h:1", "a2", None)["slot"] == 0  # free again


def test_a_worker_that_dies_no_longer_holds_a_drain():
    j = _journal()
    j.drain("a", rows=[0, 1, 2])
    assert j.removed("a", 0) is None
    assert j.forget_row(2) == []
    assert [f["name"] for f in j.forget_row(1)] == ["a"]


def test_a_confirmed_reload_becomes_the_base_a_restart_replays_from():
    j = _journal(capacity=6)
    j.add("http://h:3", "c", None)
    j.drain("a", rows=[0])
    r = j.reload("/art/2")
    j.add("http://h:4", "d", None)
    j.reloaded(r["seq"], "/art/2", ["b", "c"])  # a worker applied it (a drained there)
    assert j.base == {"seq": r["seq"], "artifact": "/art/2", "names": ["b", "c"],
                      "urls": ["http://h:2", "http://h:3"], "slots": [1, 2]}
    assert [e["op"] for e in j.entries] == ["add"]  # what came after
    j.reloaded(1, "/art/old", ["b"])  # an older report moves nothing
    assert j.base["artifact"] == "/art/2"
    np.testing.assert_array_equal(j.base["slots"], [1, 2])
