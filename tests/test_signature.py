from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from conftest import make_trace
from eldr.fit.signature import SignatureEncoder, pairwise_cosine_distance, rho
from eldr.traces.trace import Trace, TraceMeta


def _trace_from_counts(pre: np.ndarray, dec: np.ndarray, k: int) -> Trace:
    _R, L, E = pre.shape
    return Trace(
        meta=TraceMeta("hand", L, E, k),
        prefill_counts=pre, decode_counts=dec,
        prompt_lens=pre[:, 0].sum(axis=1) // k, output_lens=dec[:, 0].sum(axis=1) // k + 1,
    )


def test_rho_hand_computed():
    # distances: signatures (1, .293, .293), decode (.293, 1, .293) -> ranks (3,1.5,1.5) and
    # (1.5,3,1.5) -> Pearson of centred ranks = -0.75 / 1.5
    s = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    p = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    assert rho(s, p) == pytest.approx(-0.5, abs=1e-12)
    assert rho(s, s) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_rho_equals_scipy_on_the_same_pairs(seed):
    rng = np.random.default_rng(seed)
    s = rng.random((60, 24))
    p = rng.integers(0, 3, size=(60, 3, 8))  # small integers: many ties in distances
    p[0] = 0  # a request with no decode tokens: distance 1 to everyone
    i, j = np.triu_indices(60, k=1)
    ref = spearmanr(pairwise_cosine_distance(s, i, j),
                    pairwise_cosine_distance(p.reshape(60, -1), i, j)).statistic
    assert rho(s, p) == pytest.approx(ref, abs=1e-9)


def test_rho_pair_sampling_is_seeded_and_close():
    rng = np.random.default_rng(7)
    base = rng.random((5, 16))
    labels = rng.integers(0, 5, 300)
    s = base[labels] + 0.3 * rng.random((300, 16))
    p = base[labels] + 0.3 * rng.random((300, 16))
    a = rho(s, p, max_pairs=5000, random_state=1)
    assert a == rho(s, p, max_pairs=5000, random_state=1)
    assert a != rho(s, p, max_pairs=5000, random_state=2)
    assert a == pytest.approx(rho(s, p), abs=0.05)


def test_rho_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        rho(np.array([[np.nan, 1.0], [1, 0], [0, 1]]), np.eye(3))
    with pytest.raises(ValueError, match="R=3 rows"):
        rho(np.eye(3), np.eye(4))
    with pytest.raises(ValueError, match="at least 3"):
        rho(np.eye(2), np.eye(2))


def test_idf_hand_computed():
    # 3 requests, 1 layer, 3 experts, k=1: expert 0 used by all, expert 1 by one, 2 by none
    pre = np.array([[[2, 1, 0]], [[1, 0, 0]], [[3, 0, 0]]], dtype=np.int32)
    dec = np.array([[[1, 0, 0]], [[0, 1, 0]], [[1, 0, 0]]], dtype=np.int32)
    enc = SignatureEncoder(layers=[0]).fit(_trace_from_counts(pre, dec, 1))
    np.testing.assert_allclose(enc.idf_, [[0.0, np.log(2.0), np.log(4.0)]])
    sig = enc.transform(pre)
    np.testing.assert_allclose(sig[0], [0.0, 1.0, 0.0], atol=1e-7)  # expert 0 weighs nothing
    assert sig.dtype == np.float32


def test_transform_rows_are_unit_and_scale_invariant(toy_trace):
    for rep in ("count", "count_idf", "sqrt_count", "binary", "gate_prob", "gate_logit"):
        enc = SignatureEncoder(representation=rep, layers=[0, 2]).fit(toy_trace)
        sig = enc.transform(toy_trace)
        assert sig.shape == (len(toy_trace), 2 * toy_trace.meta.num_experts)
        np.testing.assert_allclose(np.linalg.norm(sig, axis=1), 1.0, rtol=1e-5)
    enc = SignatureEncoder(layers=[0, 1, 2, 3]).fit(toy_trace)
    counts = toy_trace.prefill_counts[4]
    np.testing.assert_allclose(enc.transform(counts), enc.transform(counts * 7), rtol=1e-6)


def test_empty_prompt_gives_zero_row_not_nan(toy_trace):
    enc = SignatureEncoder(layers=[0, 1]).fit(toy_trace)
    zero = enc.transform(np.zeros((4, 16)))
    assert zero.shape == (32,) and not np.isnan(zero).any() and not zero.any()


def test_greedy_selection_keeps_signal_layers_and_drops_noise():
    trace = make_trace(200, num_layers=8, num_experts=24, top_k=2, seed=5,
                       signal_layers=(1, 4, 6))
    trace = make_trace_with_long_prompts(trace)
    enc = SignatureEncoder(random_state=0).fit(trace)
    assert set(enc.layers_.tolist()) <= {1, 4, 6}
    assert enc.layers_.size >= 2
    rhos = [r for _, r in enc.rho_curve_]
    assert rhos == sorted(rhos)  # each added layer raised rho
    assert enc.rho_ > SignatureEncoder(layers=range(8)).fit(trace).rho_


def make_trace_with_long_prompts(trace: Trace) -> Trace:
    """Regenerate with longer prompts so per-request counts carry signal (not just noise)."""
    rng = np.random.default_rng(11)
    R, L, E = trace.prefill_counts.shape
    k = trace.meta.top_k
    pref = np.where(np.isin(np.arange(L), [1, 4, 6])[None, :, None],
                    rng.gamma(0.3, size=(3, L, E)) + 1e-3, 1.0)[trace.domains]
    pref /= pref.sum(axis=2, keepdims=True)
    pre = np.stack([[rng.multinomial(k * 40, pref[r, layer]) for layer in range(L)]
                     for r in range(R)])
    dec = np.stack([[rng.multinomial(k * 30, pref[r, layer]) for layer in range(L)]
                     for r in range(R)])
    return Trace(meta=trace.meta, prefill_counts=pre, decode_counts=dec,
                 prompt_lens=np.full(R, 40), output_lens=np.full(R, 31),
                 domains=trace.domains, domain_names=trace.domain_names)


def test_encoder_refuses_other_shapes_and_bad_values(toy_trace):
    enc = SignatureEncoder(layers=[0]).fit(toy_trace)
    with pytest.raises(ValueError, match=r"fitted for \(L, E\) = \(4, 16\)"):
        enc.transform(np.zeros((5, 16)))
    with pytest.raises(ValueError, match="NaN"):
        enc.transform(np.full((4, 16), np.nan))
    with pytest.raises(ValueError, match="negative"):
        enc.transform(-np.ones((4, 16)))
    with pytest.raises(ValueError, match="not fitted"):
        SignatureEncoder().transform(np.zeros((4, 16)))
    with pytest.raises(ValueError, match="unknown representation"):
        SignatureEncoder(representation="tfidf").fit(toy_trace)
    with pytest.raises(ValueError, match="subset"):
        SignatureEncoder(layers=[9]).fit(toy_trace)


def test_gate_representation_needs_gate_field():
    trace = make_trace(with_gates=False)
    with pytest.raises(ValueError, match="prefill_gate_prob"):
        SignatureEncoder(representation="gate_prob").fit(trace)


def test_state_round_trip(toy_trace):
    enc = SignatureEncoder(random_state=0).fit(toy_trace)
    back = SignatureEncoder.from_state(enc.state())
    np.testing.assert_array_equal(back.transform(toy_trace), enc.transform(toy_trace))
    assert back.rho_ == enc.rho_ and back.rho_curve_ == enc.rho_curve_
    bad = enc.state()
    bad["idf"] = bad["idf"][:, :3]
    with pytest.raises(ValueError, match="idf has shape"):
        SignatureEncoder.from_state(bad)


@pytest.mark.parametrize("representation", ["count", "count_idf", "sqrt_count", "binary"])
def test_transform_one_equals_transform_bit_for_bit(representation):
    """The router's per-request path: random counts (int32, int64, uint16, zeros, a
    zero-IDF expert) against the batch transform, on random layer masks."""
    rng = np.random.default_rng(7)
    trace = make_trace(60, 6, 16, 2, seed=3)
    for trial in range(20):
        layers = sorted(rng.choice(6, size=int(rng.integers(1, 7)), replace=False).tolist())
        enc = SignatureEncoder(representation=representation, layers=layers).fit(trace)
        for dtype in (np.int32, np.int64, np.uint16, np.float32, np.float64):
            counts = rng.integers(0, 9, size=(6, 16)).astype(dtype)
            if dtype in (np.float32, np.float64):  # a predicted profile's fractions
                counts = (counts * rng.random((6, 16))).astype(dtype)
            counts[:, rng.integers(16)] = 0
            if trial % 5 == 0:
                counts[layers] = 0  # nothing selected on the mask: the zero row
            got, want = enc.transform_one(counts), enc.transform(counts)
            assert got.dtype == np.float32 and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_transform_one_falls_back_and_fails_like_transform():
    trace = make_trace(40, 4, 16, 2, seed=1)
    enc = SignatureEncoder(layers=[1, 3]).fit(trace)
    floats = np.random.default_rng(0).random((4, 16))
    np.testing.assert_array_equal(enc.transform_one(floats), enc.transform(floats))
    np.testing.assert_array_equal(enc.transform_one(list(floats)), enc.transform(floats))
    for bad_value, match in ((np.nan, "NaN or Inf"), (np.inf, "NaN or Inf"),
                             (-0.5, "negative")):
        bad = floats.astype(np.float32)
        bad[0, 3] = bad_value  # layer 0 is not in the mask: refused as transform does
        for fn in (enc.transform_one, enc.transform):
            with pytest.raises(ValueError, match=match):
                fn(bad)
    with pytest.raises(ValueError, match="negative"):
        enc.transform_one(np.full((4, 16), -1, dtype=np.int32))  # also outside the mask
    bad = np.zeros((4, 16), dtype=np.int32)
    bad[0, 0] = -1  # layer 0 is not in the mask: refused all the same, as transform does
    with pytest.raises(ValueError, match="negative"):
        enc.transform_one(bad)
    with pytest.raises(ValueError, match=r"fitted for \(L, E\) = \(4, 16\)"):
        enc.transform_one(np.zeros((5, 16), dtype=np.int32))
    with pytest.raises(ValueError, match="not fitted"):
        SignatureEncoder().transform_one(np.zeros((4, 16), dtype=np.int32))
    gate = SignatureEncoder(representation="gate_prob", layers=[0, 2]).fit(make_trace(40, 4, 16, 2))
    raw = np.random.default_rng(1).random((4, 16))
    np.testing.assert_array_equal(gate.transform_one(raw), gate.transform(raw))


def test_transform_one_follows_a_refit_and_a_restored_state():
    enc = SignatureEncoder(layers=[0, 1]).fit(make_trace(40, 4, 16, 2, seed=1))
    counts = np.random.default_rng(2).integers(0, 5, size=(4, 16)).astype(np.int32)
    enc.transform_one(counts)  # builds the direct path for the first fit
    enc.layers = [2, 3]
    enc.fit(make_trace(40, 4, 16, 2, seed=2))
    np.testing.assert_array_equal(enc.transform_one(counts), enc.transform(counts))
    back = SignatureEncoder.from_state(enc.state())
    np.testing.assert_array_equal(back.transform_one(counts), enc.transform(counts))
