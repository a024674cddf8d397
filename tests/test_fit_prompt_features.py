"""eldr.fit.prompt_features: the pinned n-gram hash, the id checks, the feature rows."""

import numpy as np
import pytest

from _prompt_data import mix64
from eldr.fit.prompt_features import (
    bucket_counts,
    check_token_ids,
    feature_row,
    ngram_hashes,
    tfidf_features,
)


def test_ngram_hashes_are_pinned_and_unigrams_differ_from_bigrams():
    mix = mix64
    ids = np.array([5, 0, 7])
    expected = [mix(5), mix(0), mix(7), mix((6 << 32) | 0), mix((1 << 32) | 7)]
    assert ngram_hashes(ids).tolist() == expected
    assert ngram_hashes(np.array([3])).tolist() == [mix(3)]
    # the largest ids (the bigrams' product is built from the unigrams' by shifts and
    # adds), whatever the integer dtype
    top = (1 << 31) - 1
    expected = [mix(top), mix(top - 1), mix(0), mix((top + 1) << 32 | top - 1), mix(top << 32)]
    for dtype in (np.int64, np.uint32, np.int32, np.uint64):
        assert ngram_hashes(np.array([top, top - 1, 0], dtype=dtype)).tolist() == expected
    # coarser buckets are a shift of finer ones
    h = ngram_hashes(np.arange(100))
    np.testing.assert_array_equal(h >> np.uint64(64 - 10), (h >> np.uint64(64 - 12)) >> 2)


def test_token_ids_are_checked_naming_the_problem():
    np.testing.assert_array_equal(check_token_ids(np.array([3, 1], np.uint16), 4), [3, 1])
    assert check_token_ids([5, 2**40], None).dtype == np.int64  # no limit: non-negative only
    for ids, limit, match in (([], 4, "empty prompt"), ([[1]], 4, "1-D"),
                              ([1.0], 4, "integers"), ([1, -2], 4, "unknown token id -2"),
                              ([1, 4], 4, r"unknown token id 4: outside \[0, 4\) of it"),
                              ([-1], None, "non-negative")):
        with pytest.raises(ValueError, match=match):
            check_token_ids(ids, limit, "of it")


def test_feature_rows_weight_the_buckets_of_a_prompt():
    h = ngram_hashes(np.array([7, 7, 7, 9]))  # 4 unigrams, 3 bigrams
    buckets, counts = bucket_counts(h, 10)
    assert counts.sum() == 7 and np.all(np.diff(buckets) > 0)
    b, tf = feature_row(h, 10, np.ones(1 << 10, np.float32), "tf")
    np.testing.assert_array_equal(b, buckets)
    np.testing.assert_allclose(tf, counts / 7)
    idf = np.arange(1 << 10, dtype=np.float32) + 1
    b, w = feature_row(h, 10, idf, "tfidf")
    assert np.linalg.norm(w) == pytest.approx(1.0)
    raw = np.log1p(counts) * idf[buckets]
    np.testing.assert_allclose(w, raw / np.linalg.norm(raw), rtol=1e-6)


def test_tfidf_features_weight_rare_buckets_up():
    prompts = [np.array([1, 2]), np.array([1, 3]), np.array([1, 4])]
    idf, rows = tfidf_features([ngram_hashes(p) for p in prompts], 12, "tfidf")
    everywhere = bucket_counts(ngram_hashes(np.array([1])), 12)[0][0]
    once = bucket_counts(ngram_hashes(np.array([2])), 12)[0][0]
    assert idf[everywhere] < idf[once]
    assert idf[everywhere] == pytest.approx(np.log(4 / 4) + 1)
    assert len(rows) == 3 and all(np.linalg.norm(w) == pytest.approx(1.0) for _, w in rows)
