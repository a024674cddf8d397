import numpy as np
import pytest

from eldr.routing import RouteRequest, make_policy
from eldr.routing.baselines import domain_groups

K = 4


def _req(domain=None):
    return RouteRequest("r", signature=None, domain=domain)


def _policy(name, seed=0):
    return make_policy(name, num_workers=K, domain_shares=np.array([0.5, 0.25, 0.25]),
                       random_state=seed)


def test_round_robin_cycles_and_skips_unhealthy():
    pol = _policy("round_robin")
    loads = np.zeros(K)
    assert [pol.choose(_req(), loads) for _ in range(5)] == [0, 1, 2, 3, 0]
    healthy = np.array([True, False, True, True])
    assert [pol.choose(_req(), loads, healthy) for _ in range(4)] == [2, 3, 0, 2]


def test_jsq_picks_least_loaded_lowest_index_on_ties():
    pol = _policy("jsq")
    assert pol.choose(_req(), np.array([2.0, 1.0, 1.0, 3.0])) == 1
    assert pol.choose(_req(), np.array([2.0, 1.0, 1.0, 3.0]),
                      np.array([True, False, True, True])) == 2


def test_p2c_never_picks_the_most_loaded_of_distinct_pairs():
    pol = _policy("p2c", seed=3)
    loads = np.array([0.0, 1.0, 2.0, 3.0])
    picks = [pol.choose(_req(), loads) for _ in range(400)]
    assert 3 not in picks  # the most loaded worker loses every pair it is drawn in
    assert set(picks) == {0, 1, 2}


def test_random_is_roughly_uniform():
    pol = _policy("random", seed=1)
    picks = np.array([pol.choose(_req(), np.zeros(K)) for _ in range(4000)])
    counts = np.bincount(picks, minlength=K)
    assert counts.min() > 900 and counts.max() < 1100


def test_domain_groups_sized_by_share():
    groups = domain_groups(np.array([0.5, 0.25, 0.25]), 8)
    assert [g.tolist() for g in groups] == [[0, 1, 2, 3], [4, 5], [6, 7]]
    groups = domain_groups(np.array([0.9, 0.05, 0.05]), 4)  # every domain gets >= 1
    assert [g.tolist() for g in groups] == [[0, 1], [2], [3]]
    groups = domain_groups(np.array([0.4, 0.3, 0.2, 0.1]), 2)  # K < D: packed by share
    assert [g.tolist() for g in groups] == [[0], [1], [1], [0]]
    with pytest.raises(ValueError, match="domain_shares"):
        domain_groups(np.array([0.0, 0.0]), 4)


def test_domain_policy_routes_inside_its_group():
    pol = _policy("domain")  # groups for K=4, shares .5/.25/.25: [0, 1], [2], [3]
    assert pol.choose(_req(domain=0), np.array([1.0, 0.0, 0.0, 0.0])) == 1
    assert pol.choose(_req(domain=1), np.array([0.0, 0.0, 9.0, 0.0])) == 2
    assert pol.num_fallbacks == 0
    assert pol.choose(_req(domain=None), np.array([1.0, 1.0, 0.0, 1.0])) == 2
    assert pol.choose(_req(domain=2), np.zeros(K), np.array([True, True, True, False])) == 0
    assert pol.num_fallbacks == 2
    with pytest.raises(ValueError, match="domain 7"):
        pol.choose(_req(domain=7), np.zeros(K))
    with pytest.raises(ValueError, match="domain_shares"):
        make_policy("domain", num_workers=K)
