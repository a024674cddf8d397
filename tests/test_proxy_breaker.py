import pytest

from eldr.proxy.engines.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _breaker(**kw):
    clock = Clock()
    return CircuitBreaker(clock=clock, **{"failures": 3, "backoff": 5.0, "max_backoff": 12.0,
                                          **kw}), clock


def test_transient_failures_never_open_it():
    b, _ = _breaker()
    for _ in range(10):  # fail, fail, succeed, ...: never 3 in a row
        b.on_failure()
        b.on_failure()
        b.on_success()
    assert b.state == "closed" and b.allows() and b.num_opened == 0


def test_consecutive_failures_open_it_then_one_probe_decides():
    b, clock = _breaker()
    for _ in range(3):
        assert b.allows()
        b.on_failure()
    assert b.state == "open" and not b.allows() and b.num_opened == 1
    clock.t = 5.0
    assert b.state == "half_open" and b.allows()
    b.on_dispatch()
    assert not b.allows()  # one probe at a time
    b.on_failure()  # the probe failed: open twice as long
    assert b.state == "open" and b.backoff == 10.0
    clock.t = 14.9
    assert not b.allows()
    clock.t = 15.0
    b.on_dispatch()
    b.on_failure()
    assert b.backoff == 12.0  # capped
    clock.t = 27.0
    b.on_dispatch()
    b.on_success()
    assert b.state == "closed" and b.backoff == 5.0 and b.allows()


def test_a_probe_without_a_verdict_frees_the_slot():
    b, clock = _breaker(failures=1)
    b.on_failure()
    clock.t = 5.0
    b.on_dispatch()
    assert not b.allows()
    b.on_abandon()
    assert b.allows() and b.state == "half_open"


@pytest.mark.parametrize("kw", [{"failures": 0}, {"backoff": 0}, {"backoff": 20.0}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        CircuitBreaker(**{"failures": 3, "backoff": 5.0, "max_backoff": 12.0, **kw})
