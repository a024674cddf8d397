import numpy as np
import pytest

from eldr.proxy.request.affinity import PrefixAffinity

H = np.ones(3, dtype=bool)
Z = np.zeros(3)


def test_shared_prefix_goes_to_the_same_instance():
    aff = PrefixAffinity(3, block_chars=4)
    a = aff.hashes(b"system prompt: A")
    first = aff.pick(a, Z, H)
    aff.record(a, first)
    b = aff.hashes(b"system prompt: B and more")  # shares the first 3 blocks
    assert aff.lookup(b) == first
    assert aff.pick(b, Z, H) == first


def test_short_prompt_has_no_blocks_and_ties_rotate():
    aff = PrefixAffinity(3, block_chars=8)
    assert aff.hashes(b"short") == []
    assert [aff.pick([], Z, H) for _ in range(4)] == [0, 1, 2, 0]


def test_spill_when_owner_is_too_busy_or_unhealthy():
    aff = PrefixAffinity(3, block_chars=4, spill=2)
    h = aff.hashes(b"abcdefgh")
    aff.record(h, 1)
    assert aff.pick(h, np.array([0.0, 2.0, 0.0]), H) == 1  # within spill
    assert aff.pick(h, np.array([0.0, 3.0, 1.0]), H) == 0  # over spill: least loaded
    assert aff.pick(h, Z, np.array([True, False, True])) in (0, 2)


def test_no_healthy_instance_raises():
    with pytest.raises(LookupError):
        PrefixAffinity(2).pick([], np.zeros(2), np.zeros(2, dtype=bool))


def test_capacity_evicts_oldest_and_forget_drops_an_instance():
    aff = PrefixAffinity(2, block_chars=1, capacity=3)
    aff.record(aff.hashes(b"ab"), 0)
    aff.record(aff.hashes(b"xy"), 1)
    assert len(aff._owner) == 3
    assert aff.lookup(aff.hashes(b"a")) is None  # oldest entry evicted
    aff.forget(1)
    assert aff.lookup(aff.hashes(b"xy")) is None
    assert aff.lookup(aff.hashes(b"ab")) == 0


def test_only_the_first_blocks_count():
    aff = PrefixAffinity(2, block_chars=2, max_blocks=2)
    assert len(aff.hashes(b"abcdefgh")) == 2


@pytest.mark.parametrize("kw", [{"block_chars": 0}, {"max_blocks": 0}, {"capacity": 0},
                                {"spill": -1}])
def test_bad_settings(kw):
    with pytest.raises(ValueError):
        PrefixAffinity(2, **kw)
