"""Workloads: the paper's domain shares, length distributions, validation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from eldr.traces.workloads import WORKLOADS, LengthDist, get_workload


def test_task_has_four_domains_with_ratio_1_41():
    t = WORKLOADS["task"]
    assert t.domain_names == ("code", "math", "medical", "legal")
    assert max(t.domain_weights) / min(t.domain_weights) == pytest.approx(1.41)
    assert sum(t.domain_weights) == pytest.approx(1.0)
    assert t.num_requests == 12_000
    assert t.domain_sharpness == "sharp"


def test_language_top_two_carry_75_percent_and_top_four_87_6():
    lang = WORKLOADS["language"]
    assert lang.domain_names[:4] == ("english", "chinese", "russian", "french")
    w = sorted(lang.domain_weights, reverse=True)
    assert sum(w[:2]) == pytest.approx(0.75)
    assert sum(w[:4]) == pytest.approx(0.876)
    assert len(lang.domain_names) > 4  # a tail of other languages
    assert lang.num_requests == 14_000
    assert lang.domain_sharpness == "soft"


def test_sample_domains_follows_the_shares():
    t = WORKLOADS["task"]
    d = t.sample_domains(np.random.default_rng(0), 40_000)
    share = np.bincount(d, minlength=4) / d.size
    np.testing.assert_allclose(share, t.domain_weights, atol=0.01)
    assert d.dtype == np.int32


def test_length_dist_is_clipped_rounded_and_seeded():
    dist = LengthDist(median=100, sigma=1.5, low=10, high=300)
    a = dist.sample(np.random.default_rng(1), 5000)
    b = dist.sample(np.random.default_rng(1), 5000)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and a.min() == 10 and a.max() == 300
    assert abs(np.median(a) - 100) <= 5
    assert LengthDist(median=7, sigma=0.0, low=1, high=10).sample(
        np.random.default_rng(0), 3).tolist() == [7, 7, 7]
    assert LengthDist(median=100, sigma=0.5, low=1, high=10**6).mean() == pytest.approx(
        100 * np.exp(0.125))


@pytest.mark.parametrize(("kw", "msg"), [
    ({"median": 0, "sigma": 1, "low": 1, "high": 2}, "median"),
    ({"median": 1, "sigma": -1, "low": 1, "high": 2}, "sigma"),
    ({"median": 1, "sigma": 1, "low": 3, "high": 2}, "low"),
])
def test_length_dist_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LengthDist(**kw)


@pytest.mark.parametrize(("kw", "msg"), [
    ({"domain_weights": (0.5, 0.5, 0.0, 0.0)}, "domain_weights"),
    ({"domain_weights": (0.5, 0.5)}, "domain_weights"),
    ({"domain_names": ("a", "a", "b", "c")}, "unique"),
    ({"num_requests": 0}, "num_requests"),
    ({"output_len": LengthDist(10, 1, 0, 20)}, "output lengths"),
    ({"domain_sharpness": "fuzzy"}, "sharpness"),
    ({"shared_prefix_prob": 1.5}, "shared_prefix_prob"),
    ({"shared_prefixes_per_domain": 0}, "shared_prefixes_per_domain"),
    ({"shared_prefix_blocks": (3, 2)}, "shared_prefix_blocks"),
])
def test_workload_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        replace(WORKLOADS["task"], **kw)


def test_get_workload():
    assert get_workload("Task") is WORKLOADS["task"]
    assert get_workload(WORKLOADS["language"]) is WORKLOADS["language"]
    with pytest.raises(ValueError, match="task, language"):
        get_workload("code")
