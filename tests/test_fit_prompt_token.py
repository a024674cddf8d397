"""eldr.fit.prompt_token: the token model's tables, learned from every prompt token."""

import numpy as np
import pytest

from eldr.fit.prompt_features import ngram_hashes
from eldr.fit.prompt_token import TokenData, dense_table, token_fold_predictions


def test_a_compact_table_is_placed_in_its_buckets():
    keys, vals = np.array([1, 5]), np.array([[1.0, 2.0], [3.0, 4.0]])
    out = dense_table((keys, vals), 8)
    assert out.shape == (8, 2)
    np.testing.assert_array_equal(out[[1, 5]], vals)
    assert not out[[0, 2, 3, 4, 6, 7]].any()


def test_each_unigram_row_is_the_mean_deviation_of_its_tokens():
    """One-token prompts (no bigram): with no shrinkage a unigram's row is the mean of its
    tokens' k-hot deviations from the mean profile, in the basis; a prompt's prediction is
    its token's row; shrinkage pulls rows towards 0 by n / (n + lambda)."""
    L, E = 2, 4
    choice = {0: [[0], [1]], 1: [[2], [3]], 2: [[1], [0]]}  # token id -> (L, k) experts
    ids = [np.array([t]) for t in (0, 1, 2, 0, 1, 0)]
    experts = [np.array([choice[int(p[0])]]) for p in ids]  # (1, L, k) each
    tokens = TokenData(ids, [ngram_hashes(p) for p in ids], experts, E,
                       np.random.default_rng(0))
    onehot = np.zeros((len(ids), L * E))
    for i, p in enumerate(ids):
        for layer, (e,) in enumerate(choice[int(p[0])]):
            onehot[i, layer * E + e] = 1.0
    mean = onehot.mean(axis=0)
    basis = np.eye(L * E)  # coordinates = the profile itself
    everyone = np.arange(len(ids))
    table = tokens.tables(everyone, 16, basis, mean, 0.0)
    for i in range(len(ids)):
        np.testing.assert_allclose(tokens.mean_row(i, 16, table), onehot[i] - mean,
                                   atol=1e-12)
    shrunk = tokens.tables(everyone, 16, basis, mean, 3.0)  # token 0 seen 3 times
    np.testing.assert_allclose(tokens.mean_row(0, 16, shrunk),
                               (onehot[0] - mean) * 3 / (3 + 3.0), atol=1e-12)
    # the fold predictions are the held-out prompts' rows, per alpha
    folds = dict(token_fold_predictions(tokens, 16, (0.0, 3.0), everyone[:3], everyone[3:],
                                        mean, basis))
    assert set(folds) == {0.0, 3.0} and folds[0.0].shape == (3, L * E)
    np.testing.assert_allclose(folds[0.0], onehot[3:] - mean, atol=1e-12)
    assert folds[3.0] == pytest.approx(folds[0.0] * 0.25, abs=1e-12)  # seen once each
