"""The poison list and the retry budget (eldr.proxy.request.containment), with injected clocks."""

from __future__ import annotations

import os

import pytest

from eldr.proxy.request.containment import (
    POISON_BODY_DEATHS,
    PoisonList,
    RetryBudget,
    body_digest,
    shared_buffer,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_body_digest_is_stable_nonzero_and_tells_bodies_apart():
    a, b = body_digest(b'{"prompt": "a"}'), body_digest(b'{"prompt": "b"}')
    assert a == body_digest(b'{"prompt": "a"}') and a != b
    assert 0 < a < 1 << 63 and 0 < b < 1 << 63


def test_a_body_added_is_refused_until_its_ttl_ends():
    clock = Clock()
    poison = PoisonList(capacity=64, ttl=300.0, clock=clock)
    digest = body_digest(b"x")
    assert poison.seconds_left(digest) is None
    poison.add(digest)
    assert poison.seconds_left(digest) == pytest.approx(300.0)
    assert len(poison) == 1
    clock.now += 299.0
    assert poison.seconds_left(digest) == pytest.approx(1.0)
    clock.now += 2.0
    assert poison.seconds_left(digest) is None
    assert len(poison) == 0


def test_deaths_of_one_event_count_once_and_a_body_is_refused_at_its_third():
    clock = Clock()
    poison = PoisonList(capacity=64, ttl=300.0, clock=clock)
    digest = body_digest(b"hi")
    # eight identical requests in flight at one engine that died: one death
    assert [poison.record_death(digest, event=7) for _ in range(8)] == [1] * 8
    assert poison.seconds_left(digest) is None
    assert poison.record_death(digest, event=8) == 2  # an unrelated second death
    assert poison.seconds_left(digest) is None  # two deaths over requests: not yet
    assert poison.record_death(digest, event=9) == POISON_BODY_DEATHS
    assert poison.seconds_left(digest) == pytest.approx(300.0)


def test_deaths_further_apart_than_the_ttl_start_again():
    clock = Clock()
    poison = PoisonList(capacity=64, ttl=10.0, clock=clock)
    digest = body_digest(b"hi")
    assert poison.record_death(digest, event=1) == 1
    clock.now += 11.0
    assert poison.record_death(digest, event=2) == 1


def test_the_table_is_bounded_a_newer_body_takes_the_slot():
    clock = Clock()
    poison = PoisonList(capacity=1, ttl=300.0, clock=clock)
    first, second = body_digest(b"one"), body_digest(b"two")
    poison.add(first)
    poison.add(second)
    assert poison.seconds_left(second) is not None
    assert poison.seconds_left(first) is None  # forgotten, never confused with the other
    assert poison.nbytes(1000) == 32_000  # bytes, whatever clients send


def test_the_poison_list_is_shared_with_a_forked_process():
    buf = shared_buffer(PoisonList.nbytes(16))
    poison = PoisonList(capacity=16, buffer=buf)
    digest = body_digest(b"shared")
    pid = os.fork()
    if pid == 0:  # the child adds; the parent must see it
        try:
            PoisonList(capacity=16, buffer=buf).add(digest)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert poison.seconds_left(digest) is not None


@pytest.mark.parametrize("kw, match", [
    ({"capacity": 0}, "capacity"), ({"ttl": 0}, "ttl"),
])
def test_poison_list_settings_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        PoisonList(**kw)


def test_the_retry_budget_has_a_floor_and_a_share_of_the_traffic():
    clock = Clock()
    budget = RetryBudget(ratio=0.5, min_per_second=0.2, window=10, clock=clock)
    # floor: 0.2/s over 10 s = 2 retries with no traffic at all
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]
    for _ in range(4):  # 4 requests: 2 more retries
        budget.on_request()
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]
    assert budget.allowed() == pytest.approx(4.0)


def test_the_retry_budget_window_slides():
    clock = Clock()
    budget = RetryBudget(ratio=0.0, min_per_second=0.1, window=10, clock=clock)
    assert budget.try_retry() and not budget.try_retry()
    clock.now += 5
    assert not budget.try_retry()  # still inside the window
    clock.now += 6
    assert budget.try_retry()  # the first retry's second has left the window


def test_the_retry_budget_is_shared_by_worker_rows():
    clock = Clock()
    buf = shared_buffer(RetryBudget.nbytes(2, 10))
    one = RetryBudget(ratio=1.0, min_per_second=0.0, window=10, rows=2, row=0, buffer=buf,
                      clock=clock)
    two = RetryBudget(ratio=1.0, min_per_second=0.0, window=10, rows=2, row=1, buffer=buf,
                      clock=clock)
    one.on_request()
    one.on_request()
    # worker two saw no request of its own, but the budget is both workers'
    assert two.try_retry() and one.try_retry()
    assert not two.try_retry() and not one.try_retry()


@pytest.mark.parametrize("kw, match", [
    ({"ratio": -1}, "ratio"), ({"ratio": float("nan")}, "ratio"),
    ({"min_per_second": -1}, "floor"), ({"window": 0}, "window"),
    ({"rows": 2, "row": 2}, "row"),
])
def test_retry_budget_settings_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        RetryBudget(**kw)
