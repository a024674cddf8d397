import numpy as np
import pytest

from eldr.fit.predictor import ProfilePredictor, decode_profiles, prefill_profiles
from eldr.traces.synth import generate


@pytest.fixture(scope="module")
def trace():
    return generate("qwen3-30b-a3b", "task", num_requests=200, seed=1, keep_topk=False)


def test_profiles_are_per_token_and_rows_sum_to_k(trace):
    k = trace.meta.top_k
    pre, dec = prefill_profiles(trace), decode_profiles(trace)
    ok = trace.prompt_lens > 0
    np.testing.assert_allclose(pre[ok].sum(axis=2), k, rtol=1e-4)
    ok = trace.output_lens > 1
    np.testing.assert_allclose(dec[ok].sum(axis=2), k, rtol=1e-4)


def test_fit_chooses_the_alpha_with_the_lowest_held_out_error(trace):
    p = ProfilePredictor(alphas=(0.0, 0.5, 1.0)).fit(trace)
    assert p.alpha_ == min(p.errors_, key=p.errors_.get)
    assert p.r2_ >= p.r2_prefill_  # alpha = 0 is a candidate: never worse than prefill
    r = 3
    got = p.predict(trace.prefill_counts[r], int(trace.prompt_lens[r]))
    want = (1 - p.alpha_) * prefill_profiles(trace)[r] + p.alpha_ * p.mean_
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert set(p.summary()) == {"alpha", "r2", "r2_prefill", "errors"}


def test_predictor_validates(trace):
    with pytest.raises(ValueError, match="alphas"):
        ProfilePredictor(alphas=(1.5,))
    with pytest.raises(RuntimeError, match="not fitted"):
        ProfilePredictor().predict(trace.prefill_counts[0], 3)
    p = ProfilePredictor().fit(trace)
    with pytest.raises(ValueError, match="shape"):
        p.predict(np.zeros((2, 2)), 3)


def test_shrink_is_the_one_formula_with_the_prefill_profile_clipped_at_one():
    from eldr.fit.predictor import shrink

    mean = np.full((2, 3), 0.25, dtype=np.float32)
    pre = np.array([[0.0, 0.5, 1.0], [1.5, 3.0, 0.2]], dtype=np.float32)
    got = shrink(pre, 0.2, mean)
    want = np.float32(0.8) * np.minimum(pre, np.float32(1)) + np.float32(0.2) * mean
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32 and got.max() <= 1.0  # a mix of two probabilities
    np.testing.assert_array_equal(shrink(pre, 0.0, mean), np.minimum(pre, 1))  # α = 0
    np.testing.assert_array_equal(shrink(pre, 0.3, None), np.minimum(pre, 1))  # no mean
    many = np.stack([pre, pre / 2])
    np.testing.assert_array_equal(shrink(many, 0.2, mean)[0], got)  # (R, L, E) alike


def test_every_caller_of_the_shrinkage_gets_the_same_bits(trace):
    """The predictor, the fitted artifact and the recipe's profiles: one formula."""
    from eldr.fit.artifact import fit_artifact
    from eldr.fit.calibration import FitSettings, calibrate

    art = fit_artifact(trace, worker_ids=["a", "b"], layers=[0, 1], n_init=1)
    cal = calibrate(trace, FitSettings(layers=(0, 1), n_init=1))
    p = cal.predictor
    assert art.profile_alpha == cal.profile_alpha == p.alpha_
    profiles = cal.profiles()
    np.testing.assert_array_equal(profiles, p.predict_trace(trace))
    for r in (0, 7, 42):
        counts, n = trace.prefill_counts[r], int(trace.prompt_lens[r])
        np.testing.assert_array_equal(p.predict(counts, n), profiles[r])
        np.testing.assert_array_equal(art.predict_profile(counts, n), profiles[r])


def test_the_clip_only_acts_on_counts_the_tokens_cannot_hold(trace):
    p = ProfilePredictor().fit(trace)
    counts = trace.prefill_counts[0]
    n = int(trace.prompt_lens[0])
    assert (counts <= n).all()  # a consistent request: nothing to clip
    raw = (1 - p.alpha_) * (counts.astype(np.float32) / n) + p.alpha_ * p.mean_
    np.testing.assert_allclose(p.predict(counts, n), raw, rtol=1e-6)
    over = p.predict(counts, 1)  # one token reported for the whole prompt's counts
    assert over.max() <= 1.0
    np.testing.assert_array_equal(over[counts > 0],
                                  (np.float32(1 - p.alpha_) + np.float32(p.alpha_)
                                   * p.mean_)[counts > 0])
