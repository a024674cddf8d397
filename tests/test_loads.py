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


def test_requests_ending_while_a_scrape_travels_do_not_stay_in_the_load():
    """A scrape asked while the router had 8 requests at a decoder; 6 end before its
    answer (which counts all 8) arrives. Read against the 8 in flight when it was asked,
    the report leaves 2, and 0 once the last two end: the decoder reads idle. Read against
    the 2 at arrival it left a stale 6 on an idle decoder until the next scrape."""
    t = LoadTracker(2)
    for _ in range(8):
        t.on_dispatch(0)
    then = t.in_flight_at(0)
    for _ in range(6):
        t.on_complete(0)
    t.report(0, 8.0, in_flight_then=then)
    assert t.loads[0] == 2.0
    t.on_complete(0)
    t.on_complete(0)
    assert t.loads[0] == 0.0

    stale = LoadTracker(1)  # the old reading: in flight at arrival only
    for _ in range(8):
        stale.on_dispatch(0)
    for _ in range(6):
        stale.on_complete(0)
    stale.report(0, 8.0)
    stale.on_complete(0)
    stale.on_complete(0)
    assert stale.loads[0] == 6.0


def test_requests_sent_while_a_scrape_travels_are_not_counted_twice():
    """Dispatched after the scrape was asked: in the router's count, maybe not in the
    engine's. The larger in-flight count (at arrival) is the reference, so they count
    once: the load is the router's 3, not 3 + 3."""
    t = LoadTracker(1)
    then = t.in_flight_at(0)
    for _ in range(3):
        t.on_dispatch(0)
    t.report(0, 3.0, in_flight_then=then)  # the engine already saw all three
    assert t.loads[0] == 3.0
    t.report(0, 0.0, in_flight_then=then)  # it saw none yet
    assert t.loads[0] == 3.0
