import numpy as np
import pytest

from eldr.routing import (
    POLICIES,
    NoHealthyWorkerError,
    Policy,
    RouteRequest,
    decode_patterns,
    make_policy,
    register_policy,
)

K = 4
# Four orthogonal unit centroids in d=4: worker k owns axis k.
CENTROIDS = np.eye(K, dtype=np.float32)


def _unit(v):
    v = np.asarray(v, dtype=np.float32)
    return v / np.linalg.norm(v)


PROFILE_SHAPE = (2, 4)  # (L, E) of the cost policy's profiles in these tests


def _req(sig=None, domain=None, pattern=None, rid="r"):
    return RouteRequest(rid, signature=None if sig is None else _unit(sig), domain=domain,
                        decode_pattern=None if pattern is None else _unit(pattern),
                        profile=np.full(PROFILE_SHAPE, 0.25, dtype=np.float32))


def _policy(name, seed=0):
    return make_policy(name, num_workers=K, centroids=CENTROIDS, decode_centroids=CENTROIDS,
                       tau=0.1, domain_shares=np.array([0.5, 0.25, 0.25]), random_state=seed,
                       num_layers=PROFILE_SHAPE[0], num_experts=PROFILE_SHAPE[1])


def _random_request(rng, rid="x"):
    return RouteRequest(
        rid, signature=_unit(rng.random(K) + 0.01), domain=int(rng.integers(3)),
        decode_pattern=_unit(rng.random(K) + 0.01),
        profile=rng.random(PROFILE_SHAPE).astype(np.float32) / 2,
    )


# -- the band, hand-checked -----------------------------------------------------------------
def test_tau_zero_is_nearest_centroid_regardless_of_load():
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=0.0)
    loads = np.array([0.0, 0.0, 100.0, 0.0])
    assert pol.choose(_req([0.1, 0.2, 0.9, 0.3]), loads) == 2
    top1 = make_policy("eldr_top1", num_workers=K, centroids=CENTROIDS, tau=0.5)
    assert top1.choose(_req([0.1, 0.2, 0.9, 0.3]), loads) == 2


def test_tau_one_is_pure_jsq_for_nonnegative_signatures():
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=1.0)
    loads = np.array([3.0, 1.0, 2.0, 5.0])
    assert pol.choose(_req([0.0, 0.0, 1.0, 0.0]), loads) == 1  # sim 0 is still in band


def test_band_holds_workers_within_tau_of_best():
    # CENTROIDS = I, so sims = sig ≈ [0.600, 0.550, 0.580, 0]; tau 0.04 -> band {0, 2}
    sig = _unit([0.6, 0.55, 0.58, 0.0])
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=0.04)
    band = sig >= sig.max() - 0.04
    assert band.tolist() == [True, False, True, False]
    loads = np.array([5.0, 0.0, 4.0, 0.0])
    assert pol.choose(RouteRequest("r", sig), loads) == 2  # least loaded in band
    loads = np.array([3.0, 0.0, 4.0, 0.0])
    assert pol.choose(RouteRequest("r", sig), loads) == 0


def test_ties_lowest_load_then_highest_sim_then_lowest_index():
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=1.0)
    sig = _unit([0.5, 0.7, 0.5, 0.1])
    # equal loads everywhere -> highest sim (worker 1)
    assert pol.choose(RouteRequest("r", sig), np.zeros(K)) == 1
    # workers 0 and 2 tie on load and on sim -> lowest index
    assert pol.choose(RouteRequest("r", sig), np.array([1.0, 2.0, 1.0, 3.0])) == 0
    # tie on sim at the top: tau=0 band = {0, 2}; equal loads -> lowest index
    tied = make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=0.0)
    sig = _unit([0.7, 0.1, 0.7, 0.1])
    assert tied.choose(RouteRequest("r", sig), np.zeros(K)) == 0
    assert tied.choose(RouteRequest("r", sig), np.array([1.0, 0.0, 0.0, 0.0])) == 2


def test_unhealthy_best_centroid_is_excluded_from_the_band():
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=0.0)
    healthy = np.array([True, True, False, True])
    assert pol.choose(_req([0.1, 0.5, 0.9, 0.3]), np.zeros(K), healthy) == 1


def test_missing_signature_falls_back_to_jsq_and_is_counted():
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS)
    assert pol.choose(RouteRequest("r", None), np.array([2.0, 1.0, 0.0, 3.0])) == 2
    assert pol.num_fallbacks == 1
    oracle = make_policy("oracle_signature", num_workers=K, decode_centroids=CENTROIDS)
    assert oracle.choose(_req([1, 0, 0, 0]), np.array([2.0, 1.0, 0.0, 3.0])) == 2
    assert oracle.num_fallbacks == 1
    assert oracle.choose(_req(None, pattern=[0, 0, 0, 1]), np.zeros(K)) == 3
    assert oracle.num_fallbacks == 1


def test_zero_signature_is_jsq_not_a_fallback():
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=0.1)
    zero = RouteRequest("r", np.zeros(K, dtype=np.float32))
    assert pol.choose(zero, np.array([2.0, 1.0, 0.0, 3.0])) == 2
    assert pol.num_fallbacks == 0


def test_signature_of_wrong_size_is_refused():
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS)
    with pytest.raises(ValueError, match="shape"):
        pol.choose(RouteRequest("r", np.ones(5, dtype=np.float32)), np.zeros(K))


def test_eldr_validates_its_options():
    with pytest.raises(ValueError, match="centroids is required"):
        make_policy("eldr", num_workers=K)
    with pytest.raises(ValueError, match="shape"):
        make_policy("eldr", num_workers=3, centroids=CENTROIDS)
    with pytest.raises(ValueError, match="tau"):
        make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=-0.1)
    with pytest.raises(ValueError, match="NaN"):
        make_policy("eldr", num_workers=K, centroids=np.full((K, K), np.nan))


# -- every policy: invariants -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_returns_a_healthy_worker(name):
    rng = np.random.default_rng(7)
    pol = _policy(name)
    assert isinstance(pol, Policy) and pol.name == name
    for _ in range(200):
        healthy = rng.random(K) < 0.6
        if not healthy.any():
            healthy[int(rng.integers(K))] = True
        loads = rng.integers(0, 4, size=K).astype(np.float64)
        k = pol.choose(_random_request(rng), loads, healthy)
        assert isinstance(k, int) and 0 <= k < K and healthy[k]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_takes_the_event_contract(name):
    # dispatch then release every request, in any order and with every outcome; a repeated
    # or unknown release is a no-op; every decision stays a valid worker throughout
    rng = np.random.default_rng(3)
    pol = _policy(name)
    held = []
    for i in range(60):
        req = _random_request(rng, rid=f"r{i}")
        k = pol.decide(req, rng.integers(0, 4, K).astype(float)).worker
        assert 0 <= k < K
        pol.on_dispatch(req, k)
        held.append(req.request_id)
        if rng.random() < 0.4:
            pol.on_release(held.pop(int(rng.integers(len(held)))),
                           ("completed", "failed", "cancelled")[i % 3])
    for rid in held:
        pol.on_release(rid, "completed")
        pol.on_release(rid, "completed")
    pol.on_release("never-dispatched", "failed")
    if name == "eldr_cost":
        fp = pol.footprint
        assert len(fp) == 0 and not fp.count.any() and not fp.log_miss.any()
        assert not fp.distinct.any() and not fp.context.any()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_honours_the_seed(name):
    def run(seed):
        rng = np.random.default_rng(11)
        pol = _policy(name, seed=seed)
        return [pol.choose(_random_request(rng), rng.integers(0, 3, K).astype(float))
                for _ in range(100)]

    assert run(5) == run(5)
    if name in ("random", "p2c"):
        assert run(5) != run(6)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_refuses_when_no_worker_is_healthy(name):
    pol = _policy(name)
    with pytest.raises(NoHealthyWorkerError):
        pol.choose(_random_request(np.random.default_rng(0)), np.zeros(K), np.zeros(K, bool))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_checks_load_shape(name):
    with pytest.raises(ValueError, match="loads has shape"):
        _policy(name).choose(_req([1, 0, 0, 0]), np.zeros(K + 1))


# -- registry and tracker ---------------------------------------------------------------------
def test_registry_lists_builtins_and_refuses_duplicates():
    assert {"random", "round_robin", "jsq", "p2c", "domain", "eldr", "eldr_top1",
            "oracle_signature"} <= set(POLICIES)
    with pytest.raises(ValueError, match="already registered"):
        register_policy("jsq", lambda **_: None)
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope", num_workers=2)
    with pytest.raises(ValueError, match="unknown resources"):
        make_policy("jsq", num_workers=2, centriods=CENTROIDS)  # a typo is an error
    with pytest.raises(ValueError, match="unknown resources"):
        register_policy("new", lambda K: None, needs={"nope"})
    with pytest.raises(TypeError):
        POLICIES["x"] = None  # read-only view


def test_registry_says_what_each_policy_is_for_and_needs_fitted():
    from eldr.routing import policies_with_role

    assert policies_with_role("balancer") == ("random", "round_robin", "jsq", "p2c")
    assert set(policies_with_role("locality")) == {"eldr", "eldr_top1", "eldr_cost"}
    assert set(policies_with_role("oracle")) == {"domain", "oracle_signature"}
    assert [n for n, s in POLICIES.items() if s.evaluation_only] == \
        list(policies_with_role("oracle"))
    assert POLICIES["eldr"].fitted == {"centroids"} and POLICIES["eldr_cost"].fitted == set()
    assert POLICIES["eldr_cost"].needs_only_shape and not POLICIES["jsq"].needs_only_shape
    assert POLICIES["eldr"].stand_in == "eldr_cost" and POLICIES["jsq"].stand_in is None
    with pytest.raises(ValueError, match="role"):
        register_policy("new-role", lambda K: None, role="other")
    with pytest.raises(ValueError, match="stand-in"):  # a stand-in needs nothing fitted
        register_policy("new-stand-in", lambda K: None, stand_in="eldr")
    with pytest.raises(ValueError, match="role"):
        policies_with_role("other")


def test_the_registry_names_each_policys_variants():
    assert POLICIES["eldr"].variant(tau=0.1) == "eldr[tau=0.1,balanced]"
    assert POLICIES["oracle_signature"].variant(tau=0.05, kind="vanilla") == \
        "oracle_signature[tau=0.05,vanilla]"
    assert POLICIES["eldr_top1"].variant(tau=0.0) == "eldr_top1[tau=0,balanced]"
    assert POLICIES["eldr_cost"].variant(tau=0.1) == "eldr_cost"
    assert POLICIES["eldr_cost"].variant(tau=0.1, kind="online") == "eldr_cost[online]"
    assert POLICIES["jsq"].variant(tau=0.1, kind="online") == "jsq"


def test_an_unbound_policy_balances_load_until_it_learns_the_shape():
    from eldr.routing import LazyShapePolicy, make_unbound_policy

    policy = make_unbound_policy("eldr_cost", num_workers=3, load_slack=0.5)
    assert isinstance(policy, LazyShapePolicy) and isinstance(policy, Policy)
    assert policy.name == "eldr_cost" and policy.inputs == {"profile"}
    assert policy.shape is None and policy.footprint is None
    assert policy.engine_footprint_shape is None
    req = _req()
    decided = policy.decide(req, np.array([2.0, 0.0, 1.0]))
    assert (decided.worker, decided.fallback) == (1, True)  # JSQ, counted
    policy.on_dispatch(req, 1)  # dropped: nothing to release later
    policy.bind(*PROFILE_SHAPE)
    assert policy.shape == PROFILE_SHAPE and policy.footprint is not None
    assert policy.engine_footprint_shape == PROFILE_SHAPE
    policy.bind(9, 9)  # later calls change nothing
    assert policy.shape == PROFILE_SHAPE
    assert not policy.decide(req, np.zeros(3)).fallback
    assert policy.num_fallbacks == 1
    assert policy.add_worker() == 3 and policy.inner.num_workers == 4
    with pytest.raises(ValueError, match="nothing fitted"):
        make_unbound_policy("eldr", num_workers=2)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_unbound_policy("nope", num_workers=2)


def test_every_policy_declares_the_whole_contract():
    for name in POLICIES:
        policy = _policy(name)
        assert isinstance(policy, Policy), name
        policy.bind(*PROFILE_SHAPE)  # a no-op for a policy built with its shape
        expected = PROFILE_SHAPE if name == "eldr_cost" else None
        assert policy.shape == expected and policy.engine_footprint_shape == expected, name
        assert (policy.footprint is not None) == (name == "eldr_cost"), name


def test_decode_patterns_are_unit_rows():
    counts = np.array([[[2, 0], [0, 2]], [[0, 0], [0, 0]]])
    p = decode_patterns(counts)
    assert p.dtype == np.float32 and p.shape == (2, 4)
    np.testing.assert_allclose(p[0], [2**-0.5, 0, 0, 2**-0.5], rtol=1e-6)
    assert (p[1] == 0).all()


# -- the elastic pool: add_worker / remove_worker ------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_grows_and_shrinks(name):
    rng = np.random.default_rng(11)
    pol = _policy(name)
    assert pol.add_worker(like=1) == K and pol.num_workers == K + 1
    loads = np.array([5.0] * K + [0.0])  # the new decoder is the idle one
    chosen = [pol.choose(_random_request(rng, rid=f"a{i}"), loads) for i in range(80)]
    assert all(0 <= k <= K for k in chosen) and K in chosen  # it takes requests at once
    # requests everywhere, then decoder 2 drains (its requests released) and goes
    held = {}
    for i in range(40):
        req = _random_request(rng, rid=f"h{i}")
        k = i % (K + 1)
        pol.on_dispatch(req, k)
        held[req.request_id] = k
    for rid in [r for r, k in held.items() if k == 2]:
        pol.on_release(rid, "completed")
        del held[rid]
    pol.remove_worker(2)
    assert pol.num_workers == K
    for i in range(50):
        k = pol.choose(_random_request(rng, rid=f"b{i}"), rng.integers(0, 4, K).astype(float))
        assert 0 <= k < K
    for rid in held:
        pol.on_release(rid, "completed")
    if name == "eldr_cost":
        fp = pol.footprint
        assert len(fp) == 0 and fp.count.shape == (K,) and not fp.count.any()
        assert not fp.log_miss.any() and fp.miss.shape == (K, PROFILE_SHAPE[0] *
                                                          PROFILE_SHAPE[1])
    while pol.num_workers > 1:
        pol.remove_worker(0)
    with pytest.raises(ValueError, match="last decode worker"):
        pol.remove_worker(0)
    with pytest.raises(ValueError, match="out of range"):
        pol.add_worker(like=5)
    assert pol.choose(_random_request(rng), np.zeros(1)) == 0


def test_band_new_decoder_splits_the_cluster_it_copies():
    pol = make_policy("eldr", num_workers=K, centroids=CENTROIDS, tau=0.1)
    pol.add_worker(like=1)
    np.testing.assert_array_equal(pol.centroids[K], CENTROIDS[1])
    req = _req([0, 1, 0, 0])
    loads = np.array([0.0, 3.0, 0.0, 0.0, 1.0])
    d = pol.decide(req, loads)  # both twins are in the band; the less loaded one wins
    assert d.worker == K and d.band_size == 2
    pol.remove_worker(0)  # centroid rows follow their decoders down one index
    np.testing.assert_array_equal(pol.centroids, np.vstack([CENTROIDS[1:], CENTROIDS[1]]))
    assert pol.centroids.flags.c_contiguous
    assert pol.choose(_req([0, 0, 0, 1]), np.zeros(K)) == 2  # old worker 3


def test_round_robin_keeps_its_turn_across_a_removal():
    pol = make_policy("round_robin", num_workers=4)
    assert [pol.choose(_req(), np.zeros(4)) for _ in range(2)] == [0, 1]
    pol.remove_worker(0)  # old 2 (due next) is now index 1
    assert pol.choose(_req(), np.zeros(3)) == 1
    pol.remove_worker(2)  # the one due next (old 3) is gone: wrap to the first
    assert pol.choose(_req(), np.zeros(2)) == 0


def test_cost_policy_footprint_follows_a_removal():
    pol = make_policy("eldr_cost", num_workers=3, num_layers=2, num_experts=4)
    p = np.full(PROFILE_SHAPE, 0.5, dtype=np.float32)
    pol.on_dispatch(RouteRequest("a", profile=p), 0)
    pol.on_dispatch(RouteRequest("b", profile=p), 2)
    before = pol.footprint.distinct[2]
    pol.remove_worker(1)
    fp = pol.footprint
    assert fp.count.tolist() == [1, 1] and fp.distinct[1] == before
    pol.on_release("b", "completed")  # released under its new index
    assert fp.count.tolist() == [1, 0] and not fp.log_miss[1].any()
    assert pol.add_worker() == 2
    # the new, empty, idle decoder is the cheapest place: J = 0 + (0 + 1) * sum(p)
    d = pol.decide(RouteRequest("c", profile=p), np.array([1.0, 1.0, 0.0]))
    assert d.worker == 2 and d.cost == pytest.approx(float(p.sum()))


def test_a_policy_overriding_neither_decide_nor_choose_is_refused_at_definition():
    from eldr.routing.protocol import Decision, PolicyBase

    with pytest.raises(TypeError, match=r"Idle must override decide.*or choose"):
        class Idle(PolicyBase):
            name = "idle"

    class First(PolicyBase):  # one of the two is enough; the other follows from it
        name, num_workers = "first", 2

        def choose(self, request, loads, healthy=None):
            return 0

    class Second(PolicyBase):
        name, num_workers = "second", 2

        def decide(self, request, loads, healthy=None):
            return Decision(1)

    loads = np.zeros(2)
    assert First().decide(None, loads).worker == 0
    assert Second().choose(None, loads) == 1
