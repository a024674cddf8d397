"""Premise measurements: hand-built traces with known answers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import make_trace
from eldr.fit.premises import (
    PremiseRow,
    calibration_report,
    distinct_experts_reduction,
    effective_experts,
    format_report,
    prefill_decode_pearson,
    representation_rho,
)
from eldr.traces.trace import Trace, TraceMeta


def _trace(prefill, decode, prompt_lens, output_lens, k=1, **kw) -> Trace:
    prefill, decode = np.asarray(prefill), np.asarray(decode)
    _, L, E = prefill.shape
    return Trace(meta=TraceMeta("toy", L, E, k), prefill_counts=prefill, decode_counts=decode,
                 prompt_lens=np.asarray(prompt_lens), output_lens=np.asarray(output_lens), **kw)


def test_pearson_matches_numpy_and_is_nan_without_decode():
    pre = [[[3, 1, 0, 0]], [[1, 1, 1, 1]], [[0, 2, 2, 0]]]
    dec = [[[2, 1, 0, 1]], [[1, 0, 0, 1]], [[0, 0, 0, 0]]]
    t = _trace(pre, dec, [4, 4, 4], [5, 3, 1])
    r = prefill_decode_pearson(t)
    assert r[0] == pytest.approx(np.corrcoef([3, 1, 0, 0], [2, 1, 0, 1])[0, 1])
    assert np.isnan(r[1])  # constant prefill counts
    assert np.isnan(r[2])  # no decode tokens


def _two_domain_trace(n_per_domain=32, with_topk=True, extra_idle=0) -> Trace:
    """Domain 0 decodes with experts {0, 1}, domain 1 with {2, 3}; k = 2, E = 8, L = 3."""
    R, L, E, k = 2 * n_per_domain + extra_idle, 3, 8, 2
    domains = np.repeat([0, 1], n_per_domain)
    domains = np.concatenate([domains, np.zeros(extra_idle, int)])
    out_lens = np.full(R, 4)
    out_lens[2 * n_per_domain:] = 1  # idle requests: no decode token
    dec_rows = []
    decode = np.zeros((R, L, E), np.int32)
    for r in range(R):
        experts = [0, 1] if domains[r] == 0 else [2, 3]
        for _ in range(out_lens[r] - 1):
            dec_rows.append(np.tile(experts, (L, 1)))
        decode[r, :, experts] = out_lens[r] - 1
    prefill = np.zeros((R, L, E), np.int32)
    prefill[:, :, 4:6] = 1  # one prompt token on experts 4, 5
    return Trace(
        meta=TraceMeta("toy", L, E, k), prefill_counts=prefill, decode_counts=decode,
        prompt_lens=np.ones(R, int), output_lens=out_lens, domains=domains,
        domain_names=("a", "b"),
        decode_topk=np.array(dec_rows, np.int16) if with_topk else None,
    )


@pytest.mark.parametrize("with_topk", [True, False])
def test_distinct_experts_same_domain_vs_mixed(with_topk):
    t = _two_domain_trace(with_topk=with_topk)
    res = distinct_experts_reduction(t, batch_size=16, num_batches=50, random_state=1)
    assert res.same_domain == 2.0  # one domain's two experts, every layer
    assert res.mixed > 3.9  # both domains present in (almost) every mixed batch
    assert res.reduction == pytest.approx(1 - 2.0 / res.mixed)
    np.testing.assert_array_equal(res.per_layer_same, [2.0, 2.0, 2.0])
    assert res.source == ("decode_topk" if with_topk else "decode_counts")
    assert res.batch_size == 16 and res.num_batches == 50


def test_distinct_experts_skips_requests_without_decode_tokens():
    t = _two_domain_trace(extra_idle=40)  # 40 idle domain-0 requests would add no experts
    res = distinct_experts_reduction(t, num_batches=30)
    assert res.same_domain == 2.0


def test_distinct_experts_from_counts_is_the_expectation_of_sampling():
    t = make_trace(num_requests=60, num_layers=2, num_experts=16, top_k=2, seed=3)
    a = distinct_experts_reduction(t, batch_size=4, num_batches=400, random_state=0)
    b = distinct_experts_reduction(replace(t, decode_topk=None, prefill_topk=None,
                                           prompt_token_ids=None, _cache={}),
                                   batch_size=4, num_batches=400, random_state=0)
    assert a.source == "decode_topk" and b.source == "decode_counts"
    assert b.mixed == pytest.approx(a.mixed, rel=0.05)
    assert b.same_domain == pytest.approx(a.same_domain, rel=0.05)


def test_distinct_experts_input_errors():
    t = _two_domain_trace()
    with pytest.raises(ValueError, match="domain labels"):
        distinct_experts_reduction(replace(t, domains=None, domain_names=None, _cache={}))
    with pytest.raises(ValueError, match="batch_size"):
        distinct_experts_reduction(t, batch_size=1)
    with pytest.raises(ValueError, match="decode tokens"):
        distinct_experts_reduction(t, batch_size=100)
    with pytest.raises(ValueError, match="no domain"):
        distinct_experts_reduction(t, batch_size=40)


def test_effective_experts_uniform_and_concentrated():
    uniform = np.full((2, 1, 4), 3)
    t = _trace(uniform, uniform, [12, 12], [13, 13])
    np.testing.assert_allclose(effective_experts(t), [4.0])
    one = np.zeros((2, 2, 4), int)
    one[:, :, 2] = 5
    t = _trace(one, one, [5, 5], [6, 6])
    np.testing.assert_allclose(effective_experts(t), [1.0, 1.0])


def test_representation_rho_returns_each_representation():
    t = make_trace(num_requests=40, seed=1)
    r = representation_rho(t, ("count", "count_idf", "gate_prob"), max_pairs=None)
    assert set(r) == {"count", "count_idf", "gate_prob"}
    assert all(-1.0 <= v <= 1.0 for v in r.values())
    assert r["count"] > 0.3  # the toy trace's decode follows its prefill distribution


def test_calibration_report_without_known_targets():
    rows = calibration_report(make_trace(num_requests=60, seed=2), rho_max_pairs=None)
    assert [r.premise.split()[0] for r in rows] == [
        "prefill-decode", "same-domain", "rho(count_idf)", "effective"]
    assert all(isinstance(r, PremiseRow) for r in rows)
    assert rows[0].ok is None and rows[0].target == "n/a"  # "toy" has no published Pearson
    assert rows[1].ok is None  # unknown workload
    text = format_report(rows)
    assert text.splitlines()[0].startswith("premise")
    assert len(text.splitlines()) == 5


def test_calibration_report_uses_model_and_workload_targets():
    rows = calibration_report(make_trace(num_requests=60, seed=2), "gpt-oss-120b",
                              workload="language", with_rho=False)
    assert rows[0].target == "0.70 ± 0.05"
    assert rows[1].target.startswith("3%-10%")
    assert len(rows) == 3
