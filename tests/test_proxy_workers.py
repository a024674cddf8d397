"""The shared decode-load table of ``eldr serve --workers N`` (eldr.proxy.workers)."""

import os

import numpy as np
import pytest

from eldr.proxy import workers
from eldr.proxy.workers import SharedLoads, SharedLoadTracker, make_tracker, reserve_port
from eldr.routing.loads import LoadTracker


def test_every_worker_sees_every_workers_in_flight_requests():
    table = SharedLoads(num_workers=2, num_decoders=3)
    a, b = SharedLoadTracker(table, 0), SharedLoadTracker(table, 1)
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
    table = SharedLoads(num_workers=2, num_decoders=2)
    a, b = SharedLoadTracker(table, 0), SharedLoadTracker(table, 1)
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


def test_the_table_is_shared_with_a_forked_worker():
    table = SharedLoads(num_workers=2, num_decoders=1)
    pid = os.fork()
    if pid == 0:  # the "worker": dispatch once in its own row, exit
        SharedLoadTracker(table, 1).on_dispatch(0)
        os._exit(0)
    os.waitpid(pid, 0)
    assert SharedLoadTracker(table, 0).loads.tolist() == [1.0]


def test_make_tracker_is_local_outside_workers(monkeypatch):
    assert type(make_tracker(2)) is LoadTracker
    table = SharedLoads(2, 2)
    monkeypatch.setattr(workers, "_current", (table, 1))
    t = make_tracker(2)
    assert isinstance(t, SharedLoadTracker)
    t.on_dispatch(0)
    assert np.array_equal(table.in_flight, [[0, 0], [1, 0]])


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

    def broken_router():
        raise ValueError("no artifact here")

    async def never(router, **kw):  # pragma: no cover - the router never gets built
        raise AssertionError("serve called")

    ports = []
    assert workers.run_workers(config, broken_router, never, ready=ports.append) == 1
    assert ports and ports[0] > 0


def test_the_shared_table_cannot_grow_or_shrink():
    from eldr.proxy.workers import SharedLoads, SharedLoadTracker

    tracker = SharedLoadTracker(SharedLoads(2, 3), 0)
    for change in (tracker.add_worker, lambda: tracker.remove_worker(0)):
        with pytest.raises(ValueError, match="--workers > 1"):
            change()
