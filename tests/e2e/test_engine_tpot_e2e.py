"""End to end: a short version of the engine-measured TPOT comparison (issue 22).

``benchmarks/bench_engine_tpot.py`` as the CI can afford it: one narrow prefill engine,
two decode engines running the tiny MoE widened to 256 (:mod:`eldr.capture.wide`, built
into a temporary cache folder), ``eldr serve`` with ``jsq`` and with ``eldr`` (the band,
the artifact fitted on the shipped trace) in front of the same engines, 4 rounds of one
wave per policy (8 requests of code and German, 16 tokens each: two domains that the
artifact's two centroids tell apart, by a margin above τ on every one of their prompts).

What holds regardless of timing, asserted: the loop works (every request answered with
its 16 tokens, every wave measured), the engines' step timings arrive (timed decode steps
with positive seconds and vLLM's own inter-token intervals on every decoder that got
requests), the step model can be fitted on each decoder, the band gives each decoder one
domain in every wave (purity 1.0), where JSQ mixes them, and so the distinct experts per
step are lower under the band: counted in lockstep (``--lockstep``: step t holds every
request's t-th decode token; the served prompts' decode routing captured with
transformers, the engines' function), which depends only on which requests each decoder
got, not on when they ran. Computed from such a capture for 300 random waves of these two
domains, the pure split selected fewer distinct experts per step than a 2+2 mix in every
one (median −10 %; −18 … −6 % between the 5th and 95th percentiles). The engines'
own per-step and per-token expert figures and the timings are printed, not asserted: over
4 short rounds they are not settled (loads per token −12.8 % and +7.0 % against JSQ in two
runs; a CI run failed on asserting them), and this machine is shared and small.

Three engines (≈ 8 GB of RAM), about 5 minutes on 2 cores; marked ``e2e``.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

pytestmark = pytest.mark.e2e


def test_short_wave_comparison_on_the_wide_model(tmp_path, monkeypatch, engine_bench):
    pytest.importorskip("vllm")
    monkeypatch.setenv("ELDR_CACHE_DIR", str(tmp_path / "cache"))
    bench = engine_bench
    args = argparse.Namespace(width=256, rounds=4, per_decoder=4, max_tokens=16,
                              policies=["jsq", "eldr"], prompts=str(bench.PROMPTS), seed=0,
                              domains=2, only_domains=["code", "de"], settle=2.5,
                              artifact=None, fit_on_prompts=False, lockstep=True,
                              log_dir=str(tmp_path / "logs"))
    res = bench.run(args)
    print("\n" + bench.report(res))

    records = res["records"]
    assert len(records) == 2 * 4  # every (round, policy) wave measured
    for rec in records:
        assert sum(f["requests"] for f in rec["per"].values()) == 8
        for name, f in rec["per"].items():
            if f["requests"]:
                assert f["steps"] > 0 and f["step_s"] > 0, (name, f)
                assert f["itl_n"] > 0 and f["itl_s"] > 0, (name, f)
                assert 1.0 <= f["distinct"] <= 64.0, (name, f)
    for name, fit in res["fits"].items():
        assert fit["n"] >= 30 and np.isfinite(fit["r2"]), (name, fit)

    def mean(policy, key):
        return float(np.mean([r["summary"][key] for r in records if r["policy"] == policy]))

    loads = {p: mean(p, "loads_per_token") for p in args.policies}
    lockstep = {p: mean(p, "lockstep") for p in args.policies}
    print(f"expert loads per layer per decode token: {loads}; distinct experts per layer "
          f"per step: { {p: mean(p, 'distinct') for p in args.policies} }; in lockstep: "
          f"{lockstep}; purity { {p: mean(p, 'purity') for p in args.policies} }")
    # What holds whatever the timing: the band keeps the two domains apart in every wave
    # (deterministic: same prompts, same artifact). The engines' expert loads per token are
    # printed, not asserted: over 4 short rounds they are not settled (-12.8 % and +7.0 %
    # against JSQ in two runs of this test; the 20-round benchmark measures them).
    purity = [r["summary"]["purity"] for r in records if r["policy"] == "eldr"]
    assert purity == [1.0] * 4, purity
    # ... and so its decoders' requests select fewer distinct experts per step (timing-free)
    assert lockstep["eldr"] < lockstep["jsq"], lockstep
