import numpy as np
import pytest

from _prompt_data import token_trace
from eldr.fit.prompt_eval import (
    evaluate_prompt_predictor,
    expected_distinct_experts,
    routed_locality,
    token_tfidf,
)


def test_expected_distinct_experts_by_hand():
    # one layer of 3 experts; group 0: two requests, group 1: one
    p = np.array([[[1.0, 0.0, 0.0]], [[0.5, 0.5, 0.0]], [[0.0, 0.0, 1.0]]])
    # group 0: expert 0 surely, expert 1 with 0.5 -> 1.5; group 1: 1
    assert expected_distinct_experts(p, np.array([0, 0, 1]), 2) == pytest.approx(1.25)
    # all together: 1 + 0.5 + 1
    assert expected_distinct_experts(p, np.array([0, 0, 0]), 1) == pytest.approx(2.5)


def test_grouping_by_a_signature_that_knows_the_experts_beats_round_robin():
    rng = np.random.default_rng(0)
    R, E = 40, 16
    half = np.arange(R) % 2
    probs = np.zeros((R, 1, E))
    for r in range(R):  # two kinds of requests, each on its own 8 experts
        probs[r, 0, 8 * half[r]: 8 * half[r] + 8] = rng.dirichlet(np.ones(8)) * 2
    probs = np.minimum(probs, 1.0)
    sig = np.eye(2)[half] + 0.01 * rng.random((R, 2))
    loc = routed_locality(sig, probs, 2, draws=10)
    assert loc.clustered < loc.round_robin and loc.reduction > 0.3
    blind = routed_locality(rng.random((R, 2)), probs, 2, draws=10)
    assert blind.reduction < loc.reduction


def test_token_tfidf_rows_are_unit_and_weight_rare_tokens_up():
    fit = [np.array([0, 1]), np.array([0, 2]), np.array([0, 3])]
    x = token_tfidf(fit, [np.array([0, 1, 1]), np.array([5])], vocab_size=6)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0)
    assert x[0, 1] > x[0, 0] > 0  # token 1: more frequent here and rarer in the fit set
    assert x[1, 5] == pytest.approx(1.0)


def test_evaluation_splits_fits_and_scores_three_inputs():
    ev = evaluate_prompt_predictor(token_trace(90), num_groups=2,
                                   predictor_options={"bits": (10,), "ranks": (4, 8)})
    assert ev.num_fit + ev.num_heldout == 90 and ev.num_heldout == 45
    assert set(ev.rho) == set(ev.locality) == {"prompt", "prefill", "tfidf"}
    assert ev.r2 > 0.5
    d = ev.as_dict()
    assert d["round_robin"] == ev.locality["prompt"].round_robin
    assert "grid" not in d["predictor"]
    with pytest.raises(ValueError, match="heldout must be in"):
        evaluate_prompt_predictor(token_trace(30), heldout=1.0)
    with pytest.raises(ValueError, match="too few usable requests"):
        evaluate_prompt_predictor(token_trace(12), num_groups=8)
