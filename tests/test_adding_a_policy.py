"""docs/adding-a-policy.md, followed: the example locality policy
(docs/examples/nearest_within.py, one module with its registration) registered, then run
through the router's decision path, the simulator and every section of the report it
belongs to, with no other file naming it."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import make_trace
from eldr.reproduce import Plan
from eldr.routing import POLICIES, RouteRequest, make_policy, registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "nearest_within.py"
DOC = ROOT / "docs" / "adding-a-policy.md"
NAME = "nearest_within"
# a plan of seconds whose headline policies come from the registry (policies=None)
PLAN = Plan(
    name="tiny", workloads=("task",), calib_requests=40, rates=(150.0,), warmup_s=0.05,
    duration_s=0.3, num_prefill=2, num_decode=4, tau_values=(0.1,), tau_rate=150.0,
    pool_sizes=(2, 4), pool_rates=(150.0,), selection_max_pairs=2_000, max_pairs=5_000,
    grid_workloads=("task",), grid_pools=(4,), grid_rates=(150.0,), grid_warmup_s=0.05,
    grid_duration_s=0.4, grid_min_requests=10, grid_max_seeds=3, main_seeds=2,
    tiny_rates=(100.0,), tiny_num_prefill=2, tiny_warmup_s=0.1, tiny_duration_s=0.5,
    real_models=False)


@pytest.fixture
def example():
    """The example module imported (which registers it); the registry restored after."""
    saved = dict(registry.POLICIES)
    spec = importlib.util.spec_from_file_location("nearest_within_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)
        sys.modules.pop("nearest_within_example", None)


def test_the_walkthroughs_code_is_the_example_module():
    """Every Python block of the page is verbatim in the example the tests run."""
    text, source = DOC.read_text(), EXAMPLE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    for block in blocks:
        assert block.strip() in source, block[:80]


def test_registered_it_decides_nearest_within_the_slack(example):
    spec = POLICIES[NAME]
    assert spec.role == "locality" and spec.needs == {"centroids"}
    assert spec.report.key == "nearest" and spec.report.label == NAME  # label: the name
    c = np.array([[1, 0, 0], [0, 1, 0], [0, 0.6, 0.8]], dtype=np.float32)  # unit rows
    pol = make_policy(NAME, num_workers=3, centroids=c, tau=0.3)  # tau: not its resource
    near_1 = RouteRequest("a", signature=c[1])  # similarities 0, 1, 0.6
    assert pol.choose(near_1, np.array([0.0, 2.0, 1.0])) == 1  # within 2 of the least
    assert pol.choose(near_1, np.array([0.0, 3.0, 1.0])) == 2  # too far: the next nearest
    assert pol.choose(near_1, np.array([0.0, 3.0, 3.0])) == 0  # only the least is within
    d = pol.decide(RouteRequest("b"), np.array([4.0, 1.0, 2.0]))
    assert (d.worker, d.fallback, pol.num_fallbacks) == (1, True, 1)  # no signature: JSQ
    assert pol.add_worker(like=1) == 3  # a twin of decoder 1
    assert pol.choose(near_1, np.array([0.0, 5.0, 1.0, 0.0])) == 3
    pol.remove_worker(3)
    assert pol.centroids.shape == (3, 3)


def test_the_router_routes_with_it(example):
    from _proxy_fakes import cluster, run

    async def go():
        async with cluster(policy=NAME) as (router, client, _p, _d):
            r1 = await client.post("/v1/completions", json={"model": "tiny",
                                                            "prompt": "write code now"})
            r2 = await client.post("/v1/completions", json={"model": "tiny",
                                                            "prompt": "a legal text"})
            return router, r1.status, r1.headers["X-Eldr-Decoder"], r2.status, \
                r2.headers["X-Eldr-Decoder"]

    router, s1, d1, s2, d2 = run(go())
    assert (s1, d1, s2, d2) == (200, "w-code", 200, "w-other")  # each to its centroid
    assert router.metrics.decisions.get(policy=NAME, decoder="w-code") == 1


def test_the_simulator_and_every_report_section_show_it(example, tmp_path, monkeypatch):
    from eldr.reproduce import run_plan, write_report
    from eldr.reproduce.plan import plan_tasks

    # registered by this process, not at the import of eldr.routing: worker processes
    # would not know it (docs/adding-a-policy.md), so the set-ups are built here too
    monkeypatch.setattr("eldr.reproduce.building.setup_jobs", lambda plan: 1)

    tasks = plan_tasks(PLAN)
    assert {t.experiment for t in tasks if t.policy == NAME} == {"main", "pool", "grid",
                                                                 "tiny"}
    trace = make_trace(100, 48, 128, 8, seed=5, with_topk=False)
    res = run_plan(PLAN, trace=trace, jobs=1, log=lambda msg: None, progress=False)
    mine = [r for r in res.rows if r["policy"] == NAME]
    assert {r["experiment"] for r in mine} == {"main", "pool", "grid", "tiny"}
    assert all(r["requests_measured"] > 0 and np.isfinite(r["tpot_median_ms"]) for r in mine)
    text = write_report(res, tmp_path).read_text()
    assert "### The cost policy (`eldr_cost`) and the nearest-within-slack example " \
           "(`nearest_within`) in the same cells" in text  # the headline's sub-table
    assert "within two requests of the least-loaded one" in text  # its `about`
    assert "D/layer LB→ELDR→cost→nearest" in text  # headline and tiny-MoE tables
    assert "| nearest_within Δ p50 | nearest_within Δ p99 |" in text  # decode pools
    assert "| `nearest_within` | any balancer |" in text  # the grid's counts
    assert "`eldr` · `eldr_cost` · `nearest_within`" in text  # the grid's cells
    assert text.count("nearest_within Δ p50 / p99") == 2  # headline and tiny-MoE
    doc = json.loads((tmp_path / "results.json").read_text())
    (h,) = doc["headline"]
    assert np.isfinite(h["nearest_d_p50"]) and np.isfinite(h["nearest_d_p50_h"])
    assert {"nearest_d_p50", "nearest_d_p99"} <= doc["pool"][0].keys()
    assert {r["policy"] for r in doc["grid"]} == {"eldr", "eldr_cost", NAME}
    assert NAME in doc["plan"]["policies"]
