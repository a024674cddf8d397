"""Shared test helpers: small constructed traces with exact, valid counts."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.traces.trace import Trace, TraceMeta


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
