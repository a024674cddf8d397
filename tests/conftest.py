"""Shared test helpers: small constructed traces with exact, valid counts."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.traces.trace import Trace, TraceMeta

# Test files whose outcomes pass through BLAS kernels (numpy's OpenBLAS, torch's MKL), numpy's
# SIMD loops (float32 exp and log, reductions) or thread counts. They assert what holds on
# every CPU (docs/testing.md), and `.ci/run` runs them a second time under other kernel
# paths (`scripts/other_kernels.sh`, `-m floats`) so a test that holds on one CPU's kernels
# only fails on any machine. A new test file of that kind belongs here.
FLOAT_SENSITIVE = frozenset({
    "test_artifact.py", "test_assign.py", "test_capture_hf.py", "test_capture_wide.py",
    "test_cluster.py", "test_commands_calibrate.py", "test_fit_prompt.py",
    "test_fit_prompt_eval.py", "test_fit_prompt_kernel.py", "test_intervals.py",
    "test_learn_drift.py", "test_locality.py",
    "test_learn_refit.py", "test_placement.py", "test_predictor.py", "test_premises.py",
    "test_routing.py", "test_routing_cost.py", "test_routing_stages.py", "test_signature.py",
    "test_sim_engine.py", "test_sim_golden.py", "test_sim_metrics.py", "test_sim_stepfit.py",
    "test_sim_steptime.py", "test_synth.py", "test_traces_sampling.py",
})


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "floats: results depend on BLAS kernels, SIMD paths or thread counts "
        "(run again under scripts/other_kernels.sh in CI)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in FLOAT_SENSITIVE:
            item.add_marker(pytest.mark.floats)


def make_trace(
    num_requests: int = 40,
    num_layers: int = 4,
    num_experts: int = 16,
    top_k: int = 2,
    *,
    seed: int = 0,
    signal_layers: tuple[int, ...] | None = None,
    num_domains: int = 3,
    with_topk: bool = True,
    with_gates: bool = True,
) -> Trace:
    """A valid trace whose tokens pick k distinct experts per layer.

    In ``signal_layers`` (default: all) each domain prefers its own experts; other layers are
    uniform noise, and decode follows the same per-request distribution as prefill.
    """
    rng = np.random.default_rng(seed)
    L, E, k = num_layers, num_experts, top_k
    signal = set(range(L)) if signal_layers is None else set(signal_layers)
    domains = rng.integers(0, num_domains, num_requests)
    base = rng.gamma(0.3, size=(num_domains, L, E)) + 1e-3
    for layer in range(L):
        if layer not in signal:
            base[:, layer, :] = 1.0
    prompt_lens = rng.integers(1, 12, num_requests)
    output_lens = rng.integers(1, 10, num_requests)

    def tokens(n: int, r: int) -> np.ndarray:
        logits = np.log(base[domains[r]])[None] + rng.gumbel(size=(n, L, E))
        return np.argsort(-logits, axis=2)[:, :, :k].astype(np.int16)

    pre = [tokens(int(n), r) for r, n in enumerate(prompt_lens)]
    dec = [tokens(int(n) - 1, r) for r, n in enumerate(output_lens)]

    def counts(chunks: list[np.ndarray]) -> np.ndarray:
        out = np.zeros((num_requests, L, E), dtype=np.int32)
        for r, ids in enumerate(chunks):
            for layer in range(L):
                out[r, layer] = np.bincount(ids[:, layer, :].ravel(), minlength=E)
        return out

    gate_prob = gate_logit = None
    if with_gates:
        gate_logit = rng.normal(size=(num_requests, L, E)).astype(np.float32)
        gate_prob = rng.random((num_requests, L, E)).astype(np.float32)
    return Trace(
        meta=TraceMeta("toy", L, E, k, block_size=4, source="synthetic:test"),
        prefill_counts=counts(pre),
        decode_counts=counts(dec),
        prompt_lens=prompt_lens,
        output_lens=output_lens,
        domains=domains,
        domain_names=tuple(f"d{i}" for i in range(num_domains)),
        prefill_gate_prob=gate_prob,
        prefill_gate_logit=gate_logit,
        prefill_topk=np.concatenate(pre) if with_topk else None,
        decode_topk=np.concatenate(dec) if with_topk else None,
        prompt_token_ids=rng.integers(0, 100, int(prompt_lens.sum())) if with_topk else None,
    )


@pytest.fixture
def toy_trace() -> Trace:
    return make_trace()


@pytest.fixture(scope="session")
def engine_bench():
    """``benchmarks/bench_engine_tpot.py`` as a module (benchmarks are scripts, not part of
    the package): its engine-free pieces in unit tests, its ``run`` in the e2e test."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_engine_tpot.py"
    spec = importlib.util.spec_from_file_location("bench_engine_tpot", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
