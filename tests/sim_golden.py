"""Fingerprints of a few fixed simulations, to prove a refactor of the engine changes nothing.

``python tests/sim_golden.py --write`` records them in ``tests/data/sim_golden.json``;
``tests/test_sim_golden.py`` recomputes them and asserts equality (summary scalars exactly,
per-request columns, per-decoder counters and the event log by SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from conftest import make_trace
from eldr.routing import CostPolicy, make_policy, prefill_profile
from eldr.sim import SimConfig, simulate

GOLDEN = Path(__file__).parent / "data" / "sim_golden.json"
L, E, K_TOP = 48, 128, 8
COLUMNS = ("t_arrival", "trace_index", "prompt_len", "n_out", "prefill_worker",
           "cached_tokens", "t_prefill_start", "t_prefill_end", "decoder", "t_kv_done",
           "t_admit", "t_first", "t_last", "tokens_out", "finishes")
VOLATILE = ("wall_s", "sim_requests_per_wall_s")


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _runs():
    """(name, SimResult) of each fixed configuration."""
    from eldr.fit.signature import SignatureEncoder
    from eldr.traces.synth import generate

    topk = make_trace(60, L, E, K_TOP, seed=3, with_topk=True)
    counts = make_trace(60, L, E, K_TOP, seed=4, with_topk=False)
    rng = np.random.default_rng(0)
    cents = _unit(rng.random((4, 40)))
    sigs = _unit(rng.random((60, 40)))
    base = dict(num_prefill=2, num_decode=4, qps=400.0, warmup_s=0.02, duration_s=0.2)
    yield "p2c_topk_prefix_events", simulate(
        topk, SimConfig(**base, max_batch=3, prefix_caching=True),
        make_policy("p2c", num_workers=4, random_state=0), record_events=True)
    yield "jsq_counts", simulate(counts, SimConfig(**base), make_policy("jsq", num_workers=4))
    yield "eldr_counts", simulate(
        counts, SimConfig(**base, seed=2),
        make_policy("eldr", num_workers=4, centroids=cents, random_state=0), signatures=sigs)
    yield "domain_rr", simulate(
        counts, SimConfig(**base, max_batch_tokens=2),
        make_policy("domain", num_workers=4, domain_shares=np.ones(3), random_state=0))
    yield "cost_profiles", simulate(
        topk, SimConfig(**base),
        CostPolicy(4, num_layers=L, num_experts=E, context_weight=0.01, capacity=3.0,
                   memory=0),  # the policy as recorded (its memory came later)
        profiles=lambda r: prefill_profile(topk.prefill_counts[r], int(topk.prompt_lens[r])))
    enc = SignatureEncoder(layers=[0, 5, 9]).fit(topk)
    for source in ("fresh", "sigcache"):
        yield f"eldr_{source}", simulate(
            topk, SimConfig(num_prefill=2, num_decode=3, qps=500.0, warmup_s=0.0,
                            duration_s=0.3, prefix_caching=True, signature_source=source),
            make_policy("eldr", num_workers=3, centroids=enc.transform(topk)[:3]),
            signatures=enc.transform(topk), encoder=enc)
    big = generate("qwen3-235b-a22b", "task", num_requests=80, seed=1, keep_topk=False)
    ep = dict(model="qwen3-235b-a22b", num_prefill=2, num_decode=2, qps=20.0, tp=4, ep=4,
              warmup_s=0.5, duration_s=3.0)
    yield "ep_contiguous", simulate(big, SimConfig(**ep), make_policy("jsq", num_workers=2))
    place = np.random.default_rng(1).integers(0, 4, (2, big.meta.num_layers,
                                                     big.meta.num_experts))
    yield "ep_per_decoder", simulate(big, SimConfig(**ep), make_policy("round_robin",
                                                                       num_workers=2),
                                     placement=place)
    oss = generate("gpt-oss-120b", "task", num_requests=150, seed=1, keep_topk=False)
    yield "sliding_gpt_oss", simulate(
        oss, SimConfig(model="gpt-oss-120b", num_prefill=2, num_decode=3, qps=30.0,
                       warmup_s=1.0, duration_s=4.0),
        make_policy("p2c", num_workers=3, random_state=0))


def fingerprint(res) -> dict:
    """Summary scalars (JSON-exact) and SHA-256 digests of everything else."""
    from eldr.sim.metrics import _clean

    h = hashlib.sha256()
    for name in COLUMNS:
        h.update(name.encode())
        h.update(np.ascontiguousarray(res.requests[name], dtype=np.float64).tobytes())
    if "signature_exact" in res.requests:
        h.update(np.asarray(res.requests["signature_exact"], dtype=bool).tobytes())
    for arr in (res.decoder_steps, res.decoder_batch_sum, res.decoder_distinct_sum):
        h.update(np.asarray(arr, dtype=np.int64).tobytes())
    summary = {k: v for k, v in res.summary().items() if k not in VOLATILE}
    out = {"summary": _clean(summary), "requests_sha256": h.hexdigest(),
           "total_steps": int(res.total_steps), "window_tokens": int(res.window_tokens)}
    if res.events is not None:
        out["events_sha256"] = hashlib.sha256(repr(
            [(float(t), e, int(i), int(w)) for t, e, i, w in res.events]).encode()).hexdigest()
    return out


def compute() -> dict:
    return {name: fingerprint(res) for name, res in _runs()}


if __name__ == "__main__":
    if "--write" in sys.argv:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")
    else:
        print(json.dumps(compute(), indent=1, sort_keys=True))
