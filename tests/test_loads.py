from __future__ import annotations

import pytest

from eldr.routing import RouteRequest, make_policy
from eldr.routing.loads import LoadTracker


def _req() -> RouteRequest:
    return RouteRequest("r", signature=None)


def test_load_tracker_dispatch_complete_report_health():
    t = LoadTracker(3)
    t.on_dispatch(1)
    t.on_dispatch(1)
    t.on_complete(1)
    assert t.loads.tolist() == [0.0, 1.0, 0.0]
    t.report(2, 5)
    t.on_dispatch(2)
    assert t.loads.tolist() == [0.0, 1.0, 6.0]
    t.on_complete(0)  # never below zero
    assert t.loads[0] == 0.0
    t.set_healthy(1, False)
    assert make_policy("jsq", num_workers=3).choose(_req(), t.loads, t.healthy) == 0
    with pytest.raises(ValueError, match="out of range"):
        t.on_dispatch(3)
    with pytest.raises(ValueError, match="finite"):
        t.report(0, -1)


def test_a_report_never_takes_the_load_below_the_routers_own_requests():
    """An engine that does not count requests still in transit (a burst just dispatched)
    reports fewer than the router has in flight there: the load stays at least that."""
    t = LoadTracker(2)
    for _ in range(3):
        t.on_dispatch(0)
    t.report(0, 1.0)  # the engine sees one of the three
    assert t.loads.tolist() == [3.0, 0.0]
    assert make_policy("jsq", num_workers=2).choose(_req(), t.loads, t.healthy) == 1
    t.report(1, 4.0)  # another router's requests: above this router's own, they count
    t.on_dispatch(1)
    assert t.loads.tolist() == [3.0, 5.0]
    t.on_complete(1)
    t.on_complete(0)
    assert t.loads.tolist() == [2.0, 4.0]
    t.add_worker()
    t.on_dispatch(2)
    t.remove_worker(0)
    assert t.loads.tolist() == [4.0, 1.0] and t.own.tolist() == [0.0, 1.0]
    t.report(0, 0.0)
    assert t.loads.tolist() == [0.0, 1.0]


def test_load_tracker_refuses_bad_sizes():
    with pytest.raises(ValueError, match="positive integer"):
        LoadTracker(0)


def test_load_tracker_grows_and_shrinks_with_the_pool():
    t = LoadTracker(2)
    t.on_dispatch(1)
    assert t.add_worker() == 2
    t.on_dispatch(2)
    t.set_healthy(0, False)
    assert t.loads.tolist() == [0.0, 1.0, 1.0] and t.healthy.tolist() == [False, True, True]
    t.remove_worker(0)  # the others move down one index, loads and health with them
    assert t.num_workers == 2
    assert t.loads.tolist() == [1.0, 1.0] and t.healthy.tolist() == [True, True]
    t.remove_worker(1)
    with pytest.raises(ValueError, match="last decode worker"):
        t.remove_worker(0)
    with pytest.raises(ValueError, match="out of range"):
        t.remove_worker(3)
