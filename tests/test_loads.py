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


def test_load_tracker_refuses_bad_sizes():
    with pytest.raises(ValueError, match="positive integer"):
        LoadTracker(0)
