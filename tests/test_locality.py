"""eldr.fit.locality: lockstep batches never hold a request twice, the band keeps loads
level, the cut is measured on requests never fitted on; the prediction gate."""

import numpy as np
import pytest

from eldr.fit.locality import (
    Window,
    band_assign,
    batch_distinct,
    real_locality,
    round_robin_assign,
    step_masks,
)
from eldr.fit.prompt_decode import PredictionGate
from eldr.traces.importers import counts_of
from eldr.traces.trace import Trace, TraceMeta


def _two_domain_trace(R=96, D=20, L=2, E=16, k=2, seed=0):
    """Half the requests route to experts 0-7, half to 8-15 (prompts alike)."""
    rng = np.random.default_rng(seed)
    dom = np.arange(R) % 2
    rows = []
    for r in range(R):
        base = 8 * dom[r]
        rows.append(np.stack([np.stack([base + rng.choice(8, k, replace=False)
                                        for _ in range(L)]) for _ in range(D)]))
    topk = np.concatenate(rows).astype(np.int16)
    off = np.arange(R + 1) * D
    return Trace(meta=TraceMeta("toy", L, E, k, source="imported:test"), prefill_counts=None,
                 decode_counts=counts_of(topk, off, E), prompt_lens=np.full(R, 9),
                 output_lens=np.full(R, D + 1), domains=dom.astype(np.int32),
                 domain_names=("a", "b"), decode_topk=topk,
                 prompt_token_ids=rng.integers(0, 30, R * 9))


def test_a_request_is_never_batched_with_its_copy():
    N, W, L = 40, 3, 2
    masks = np.zeros((N, W, L, 1), dtype=np.uint64)
    for i in range(N):  # request i selects expert i only: distinct = distinct requests
        masks[i] = np.uint64(1) << np.uint64(i)
    rng = np.random.default_rng(3)
    for b in range(30):
        idx = rng.integers(0, N, N)  # a bootstrap resample: copies
        labels = round_robin_assign(N, 4, np.random.default_rng(b))
        mean, used, batches = batch_distinct(masks[idx], labels, 4, 4,
                                             np.random.default_rng(b), origin=idx)
        assert batches > 0 and used == batches * 4
        assert mean == 4.0  # every batch holds 4 different requests
    mean, used, batches = batch_distinct(masks, round_robin_assign(N, 4, rng), 4, 3, rng)
    assert (used, batches, mean) == (36, 12, 3.0)  # 10 per decoder: 3 batches of 3


def test_band_assign_keeps_loads_level_and_zero_signatures_balance():
    rng = np.random.default_rng(0)
    sig = rng.random((50, 6))
    cen = np.eye(3, 6)
    labels = band_assign(sig / np.linalg.norm(sig, axis=1, keepdims=True), cen, tau=0.0)
    assert np.bincount(labels, minlength=3).max() <= 17
    zero = band_assign(np.zeros((30, 6)), cen, tau=0.1)
    assert np.bincount(zero, minlength=3).tolist() == [10, 10, 10]


def test_real_locality_finds_domain_locality_and_skips_what_it_lacks():
    t = _two_domain_trace()
    rep = real_locality(t, num_decoders=2, batch_sizes=[4, 8], window=Window(4, 20),
                        resamples=40, draws=3, standin_tokens=4, inputs=["oracle", "standin",
                                                                         "domain", "prefill"])
    assert rep.num_fit + rep.num_routed == 96 and rep.num_routed == 48
    assert "prefill" in rep.skipped and "decode-only" in rep.skipped["prefill"]
    byname = {i.name: i for i in rep.inputs}
    for name in ("oracle", "standin", "domain"):
        for c in byname[name].cuts:
            # two disjoint expert halves: grouping by domain halves the union's pool
            assert c.cut > 0.1 and c.low <= c.cut <= c.high + 1e-9
            assert c.requests == 48 and c.round_robin > c.distinct
        assert byname[name].rho > 0.5
    doc = rep.as_dict()
    assert doc["requests"] == {"fit": 48, "routed": 48, "eligible": 96}
    with pytest.raises(ValueError, match="decode steps"):
        step_masks(t, Window(0, 30))


def test_the_gate_refuses_a_predictor_below_its_calibration_r2():
    class Pred:
        bits_ = 10
        cv_r2_ = 0.05

    prompts = [np.arange(i, i + 5) for i in range(12)]
    gate = PredictionGate.calibrate(Pred(), prompts)
    assert not gate.enabled and not gate.admit(prompts).any()
    good = PredictionGate.calibrate(type("P", (), {"bits_": 10, "cv_r2_": 0.5})(), prompts,
                                    statistic="familiarity")
    assert good.enabled and good.admit(prompts).all()  # the fit prompts themselves
    assert not good.admit([np.array([999, 998, 997])]).any()  # never-seen tokens


def test_an_artifact_does_not_ship_a_prompt_predictor_below_the_gate():
    from dataclasses import replace

    from _prompt_data import token_trace
    from eldr.fit.artifact import fit_artifact

    good = token_trace(60)
    art = fit_artifact(good, worker_ids=["a", "b"])
    assert art.prompt_predictor is not None and art.prompt_predictor.cv_r2_ >= 0.1
    # the same requests with prompts that say nothing about their experts
    noise = np.random.default_rng(5).integers(0, 48, good.prompt_token_ids.size)
    bad = replace(good, prompt_token_ids=noise.astype(np.int32), _cache={})
    art = fit_artifact(bad, worker_ids=["a", "b"])
    assert art.prompt_predictor is None
    assert "refused" in art.fit_stats["prompt_predictor"]
    forced = fit_artifact(bad, worker_ids=["a", "b"], prompt_predictor=True)
    assert forced.prompt_predictor is not None  # --prompt-predictor keeps it


def test_fit_decode_predictor_records_the_vocabulary_it_is_given():
    from eldr.fit.prompt_decode import fit_decode_predictor

    t = _two_domain_trace()
    small = {"bits": (10,), "ranks": (4,), "alphas": (0.1,)}
    seen = int(t.prompt_token_ids.max()) + 1
    default = fit_decode_predictor(t, **small)
    assert (default.vocab_size, default.vocab_source) == (seen, "calibration")
    # a held-out split's ids beyond the fit's: recorded, and a larger one still hashed
    wide = fit_decode_predictor(t, vocab_size=seen + 50, vocab_source="calibration", **small)
    assert (wide.vocab_size, wide.vocab_source) == (seen + 50, "calibration")
    beyond = np.array([1, seen + 70, 2])
    assert np.isfinite(wide.predict(beyond)).all()
    assert wide.predict(np.arange(5)).tobytes() == default.predict(np.arange(5)).tobytes()
    config = fit_decode_predictor(t, vocab_size=seen + 50, vocab_source="config", **small)
    with pytest.raises(ValueError):
        config.predict(beyond)  # a real vocabulary refuses ids outside it
