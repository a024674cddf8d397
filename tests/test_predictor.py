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
