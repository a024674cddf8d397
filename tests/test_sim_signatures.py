"""Signatures under prefix caching: naive fresh-token counts vs the signature cache."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_trace
from eldr.fit.signature import SignatureEncoder
from eldr.routing import make_policy
from eldr.sim import SimConfig, simulate


@pytest.fixture(scope="module")
def setup():
    tr = make_trace(30, 48, 128, 8, seed=7, with_topk=True)
    enc = SignatureEncoder(layers=[0, 5, 9]).fit(tr)
    cents = enc.transform(tr)[:3]
    return tr, enc, enc.transform(tr), cents


@pytest.mark.parametrize("source", ["fresh", "sigcache"])
def test_sigcache_signatures_are_exact_and_fresh_ones_are_not(setup, source):
    tr, enc, sigs, cents = setup
    cfg = SimConfig(num_prefill=2, num_decode=3, qps=500.0, warmup_s=0.0, duration_s=0.3,
                    prefix_caching=True, signature_source=source)
    res = simulate(tr, cfg, make_policy("eldr", num_workers=3, centroids=cents),
                   signatures=sigs, encoder=enc)
    r = res.requests
    hit = r["cached_tokens"] > 0
    assert hit.sum() > 20 and (~hit).sum() > 0  # repeats of the 30 prompts hit the cache
    assert r["signature_exact"][~hit].all()
    if source == "sigcache":
        assert r["signature_exact"].all()
    else:
        assert not r["signature_exact"][hit].all()
    np.testing.assert_array_equal(r["finishes"], 1)


def test_online_sources_need_what_they_use(setup):
    tr, enc, sigs, _ = setup
    with pytest.raises(ValueError, match="prefix_caching"):
        SimConfig(signature_source="fresh")
    cfg = SimConfig(num_decode=3, prefix_caching=True, signature_source="sigcache",
                    duration_s=0.1, warmup_s=0.0)
    with pytest.raises(ValueError, match="encoder"):
        simulate(tr, cfg, make_policy("jsq", num_workers=3), signatures=sigs)
    no_topk = make_trace(10, 48, 128, 8, with_topk=False)
    with pytest.raises(ValueError, match="prefill_topk"):
        simulate(no_topk, cfg, make_policy("jsq", num_workers=3), encoder=enc)


def test_prompt_inputs_are_the_artifacts_route_inputs_from_prompt():
    from dataclasses import replace

    from _prompt_data import token_trace
    from eldr.fit.artifact import fit_artifact
    from eldr.sim.signatures import prompt_inputs

    tr = token_trace(60)
    art = fit_artifact(tr, worker_ids=["a", "b"], n_init=1,
                       prompt_options={"bits": (10,), "ranks": (4, 8)})
    sigs, profs = prompt_inputs(tr, art.encoder, art.prompt_predictor,
                                profile_alpha=art.profile_alpha,
                                profile_mean=art.profile_mean)
    assert sigs.shape == (60, art.layers.size * tr.meta.num_experts)
    assert profs.shape == (60, tr.meta.num_layers, tr.meta.num_experts)
    for r in (0, 17, 59):
        s, p = art.route_inputs_from_prompt(tr.prompt_tokens(r))
        np.testing.assert_allclose(sigs[r], s, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(profs[r], p, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="no prompt_token_ids"):
        prompt_inputs(replace(tr, prompt_token_ids=None), art.encoder, art.prompt_predictor)
