"""The event loop: conservation, exact event order, queueing, determinism, warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_trace
from eldr.routing import PolicyBase, RouteRequest, make_policy
from eldr.sim import SimConfig, StepModel, simulate
from eldr.traces.trace import Trace, TraceMeta

L, E, K_TOP = 48, 128, 8


def hand_trace(prompt_lens, output_lens, decode_experts=None) -> Trace:
    """Qwen3-30B-shaped trace: prompt tokens pick experts 0..7, decode tokens of request r
    pick ``decode_experts[r]`` (8 ids) at every layer."""
    R = len(prompt_lens)
    pre = np.zeros((R, L, E), np.int32)
    dec = np.zeros((R, L, E), np.int32)
    for r in range(R):
        pre[r, :, :8] = prompt_lens[r]
        ids = list(range(8, 16)) if decode_experts is None else decode_experts[r]
        dec[r][:, ids] = output_lens[r] - 1
    return Trace(meta=TraceMeta("qwen3-30b-a3b", L, E, K_TOP, block_size=4),
                 prefill_counts=pre, decode_counts=dec,
                 prompt_lens=np.asarray(prompt_lens), output_lens=np.asarray(output_lens))


# round numbers: decode step = 1 ms exactly, KV transfer = 0.5 ms, prefill = 1 ms + c·tokens
EXACT = dict(t_fixed_s=1e-3, moe_a_s=0.0, moe_b_s=0.0, hbm_bandwidth=1e30,
             link_bandwidth=1e30, link_latency_s=5e-4, warmup_s=0.0, duration_s=1.0)


def test_exact_event_order_1p2d():
    tr = hand_trace([4, 4], [3, 2])
    cfg = SimConfig(num_prefill=1, num_decode=2, **EXACT)
    c = StepModel(cfg).prefill_s_per_token
    p = 1e-3 + 4 * c  # one prefill step of one 4-token request
    res = simulate(tr, cfg, make_policy("round_robin", num_workers=2),
                   arrivals=(np.array([0.0, 2e-4]), np.array([0, 1])), record_events=True)
    expected = [
        (0.0, "arrival", 0, 0),
        (2e-4, "arrival", 1, 0),
        (p, "prefill_done", 0, 0),  # → decoder 0 (round robin), KV until p + 0.5 ms
        (p + 5e-4, "kv_done", 0, 0),
        (p + 5e-4, "admit", 0, 0),
        (2 * p, "prefill_done", 1, 0),  # → decoder 1
        (p + 1.5e-3, "step_done", 1, 0),  # request 0's first token
        (2 * p + 5e-4, "kv_done", 1, 1),
        (2 * p + 5e-4, "admit", 1, 1),
        (p + 2.5e-3, "step_done", 1, 0),
        (2 * p + 1.5e-3, "step_done", 1, 1),
        (p + 3.5e-3, "finish", 0, 0),  # third token
        (p + 3.5e-3, "step_done", 1, 0),
        (2 * p + 2.5e-3, "finish", 1, 1),
        (2 * p + 2.5e-3, "step_done", 1, 1),
    ]
    assert [e[1:] for e in res.events] == [e[1:] for e in expected]
    np.testing.assert_allclose([e[0] for e in res.events], [e[0] for e in expected],
                               rtol=0, atol=1e-12)
    r = res.requests
    np.testing.assert_allclose(r["t_first"], [p + 1.5e-3, 2 * p + 1.5e-3], atol=1e-12)
    np.testing.assert_allclose(res.tpot(), [1e-3, 1e-3], atol=1e-12)
    np.testing.assert_array_equal(r["decoder"], [0, 1])


def test_engine_step_time_matches_formula():
    # decode experts {8..15} and {12..19}: together D = 12 per layer, alone D = 8
    tr = hand_trace([4, 4], [3, 3], decode_experts=[list(range(8, 16)), list(range(12, 20))])
    cfg = SimConfig(num_prefill=2, num_decode=1, warmup_s=0.0, duration_s=1.0, spill_tokens=0)
    sm = StepModel(cfg)
    res = simulate(tr, cfg, make_policy("jsq", num_workers=1),
                   arrivals=(np.array([0.0, 0.0]), np.array([0, 1])))
    r = res.requests
    assert r["t_kv_done"][0] == r["t_kv_done"][1]  # parallel prefills (spill_tokens=0)
    # request 0 runs step 0 alone; request 1 joins at step 1; request 0 leaves after step 2.
    # context = Σ (prompt + tokens emitted so far) over the batch
    step1 = sm.decode_step_time(48 * 12, (4 + 1) + (4 + 0))
    step2 = sm.decode_step_time(48 * 12, (4 + 2) + (4 + 1))
    step3 = sm.decode_step_time(48 * 8, 4 + 2)
    np.testing.assert_allclose(r["t_last"] - r["t_first"], [step1 + step2, step2 + step3],
                               rtol=1e-12)
    assert step3 < step2


class AlwaysFirst(PolicyBase):
    name = "always_first"
    num_workers = 3

    def __init__(self):
        self.events = []  # (event, request id, worker or outcome)

    def choose(self, request: RouteRequest, loads, healthy=None) -> int:
        return 0

    def on_dispatch(self, request, worker):
        self.events.append(("dispatch", request.request_id, worker))

    def on_release(self, request_id, outcome):
        self.events.append(("release", request_id, outcome))


def test_policies_hear_every_dispatch_and_release_once():
    tr = hand_trace([4] * 5, [3] * 5)
    pol = AlwaysFirst()
    simulate(tr, SimConfig(num_prefill=2, num_decode=3, **EXACT), pol,
             arrivals=(np.arange(5) * 1e-3, np.arange(5)))
    dispatched = [e[1] for e in pol.events if e[0] == "dispatch"]
    released = [e[1] for e in pol.events if e[0] == "release"]
    assert sorted(dispatched) == sorted(released) == [str(i) for i in range(5)]
    assert all(e[2] == "completed" for e in pol.events if e[0] == "release")
    for rid in dispatched:  # released after dispatched
        assert pol.events.index(("dispatch", rid, 0)) < \
            next(i for i, e in enumerate(pol.events) if e[:2] == ("release", rid))


def test_cost_policy_state_returns_to_zero_after_a_simulation():
    from eldr.routing import CostPolicy, prefill_profile

    tr = hand_trace([4] * 6, [3] * 6)
    m = tr.meta
    pol = CostPolicy(3, num_layers=m.num_layers, num_experts=m.num_experts)
    res = simulate(tr, SimConfig(num_prefill=2, num_decode=3, **EXACT), pol,
                   arrivals=(np.arange(6) * 1e-4, np.arange(6)),
                   profiles=lambda r: prefill_profile(tr.prefill_counts[r],
                                                      int(tr.prompt_lens[r])))
    assert (res.requests["finishes"] == 1).all() and pol.num_fallbacks == 0
    fp = pol.footprint
    assert len(fp) == 0 and not fp.log_miss.any() and not fp.distinct.any()


def test_policy_picking_one_worker_queues_there():
    tr = hand_trace([4] * 4, [3] * 4)
    cfg = SimConfig(num_prefill=4, num_decode=3, max_batch=1, **EXACT)
    res = simulate(tr, cfg, AlwaysFirst(), arrivals=(np.zeros(4), np.arange(4)))
    r = res.requests
    np.testing.assert_array_equal(r["decoder"], [0, 0, 0, 0])
    order = np.argsort(r["t_admit"])
    # max_batch = 1: each request waits for the previous one's last token (3 steps of 1 ms)
    np.testing.assert_allclose(np.diff(r["t_admit"][order]), [3e-3] * 3, atol=1e-12)
    np.testing.assert_allclose(r["t_last"][order] - r["t_admit"][order], [3e-3] * 4,
                               atol=1e-12)
    assert res.decoder_steps[1] == res.decoder_steps[2] == 0


@pytest.mark.parametrize("with_topk", [True, False])
@pytest.mark.parametrize("policy", ["random", "round_robin", "jsq", "p2c", "domain", "eldr"])
def test_conservation_every_request_finishes_once(policy, with_topk):
    tr = make_trace(60, L, E, K_TOP, seed=3, with_topk=with_topk)
    cfg = SimConfig(num_prefill=2, num_decode=4, qps=400.0, warmup_s=0.02, duration_s=0.2,
                    max_batch=3, prefix_caching=with_topk)
    rng = np.random.default_rng(0)
    cents = rng.random((4, 40)).astype(np.float32)
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    sigs = rng.random((60, 40)).astype(np.float32)
    sigs /= np.linalg.norm(sigs, axis=1, keepdims=True)
    pol = make_policy(policy, num_workers=4, centroids=cents, domain_shares=np.ones(3),
                      random_state=0)
    res = simulate(tr, cfg, pol, signatures=sigs)
    r = res.requests
    assert r["t_arrival"].size > 40
    np.testing.assert_array_equal(r["finishes"], 1)
    np.testing.assert_array_equal(r["tokens_out"], r["n_out"])
    assert np.isfinite(r["t_last"]).all() and (r["t_last"] >= r["t_first"]).all()
    assert (r["t_first"] > r["t_admit"]).all() and (r["t_admit"] >= r["t_kv_done"]).all()
    assert (r["t_kv_done"] > r["t_prefill_end"]).all()
    assert (r["t_prefill_start"] >= r["t_arrival"]).all()
    assert ((r["decoder"] >= 0) & (r["decoder"] < 4)).all()


def test_determinism_per_seed():
    tr = make_trace(50, L, E, K_TOP, seed=4, with_topk=False)
    cfg = SimConfig(num_prefill=2, num_decode=3, qps=300.0, warmup_s=0.0, duration_s=0.2)

    def run(c):
        return simulate(tr, c, make_policy("p2c", num_workers=3, random_state=c.seed)).requests

    a, b = run(cfg), run(cfg)
    assert list(a) == list(b)  # every field of every request record
    c = run(SimConfig(**{**cfg.to_json(), "seed": 1}))
    assert not np.array_equal(a["t_arrival"][:10], c["t_arrival"][:10])


def test_warmup_requests_are_excluded():
    tr = hand_trace([4] * 3, [2, 11, 2])
    cfg = SimConfig(num_prefill=1, num_decode=1, **{**EXACT, "warmup_s": 0.5,
                                                    "duration_s": 1.0})
    # request 1 (long, slowed by nobody) arrives before warm-up; 0 and 2 after
    res = simulate(tr, cfg, make_policy("jsq", num_workers=1),
                   arrivals=(np.array([0.0, 0.6, 2.0]), np.array([1, 0, 2])))
    s = res.summary()
    np.testing.assert_array_equal(res.measured, [False, True, False])
    assert s["requests"] == 3 and s["requests_measured"] == 1
    assert s["tpot_median_ms"] == pytest.approx(1.0)
    assert s["ttft_median_ms"] == pytest.approx(res.ttft()[1] * 1e3)


def test_bad_inputs_are_refused():
    tr = make_trace(10, 4, 16, 2)
    with pytest.raises(ValueError, match=r"\(L, E\)"):
        simulate(tr, SimConfig(), make_policy("jsq", num_workers=16))
    tr = hand_trace([4], [2])
    with pytest.raises(ValueError, match="routes to 2 workers"):
        simulate(tr, SimConfig(num_decode=3), make_policy("jsq", num_workers=2))
    with pytest.raises(ValueError, match="num_decode"):
        SimConfig(num_decode=0)
    with pytest.raises(ValueError, match="ep=3"):
        SimConfig(ep=3)
