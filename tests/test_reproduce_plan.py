"""The three plans of ``eldr reproduce``: what the default run keeps, what only --full has."""

from __future__ import annotations

import pytest

from eldr.cli import main
from eldr.reproduce.plan import DEFAULT, FULL, PLANS, QUICK, grid_duration, plan_tasks
from eldr.reproduce.sweeps import task_weight


def _cells(plan):
    return {(t.workload, t.num_decode, t.qps) for t in plan_tasks(plan)
            if t.experiment == "grid"}


def test_the_cli_names_every_plan_by_its_own_name():
    assert {name: p.name for name, p in PLANS.items()} == {
        "quick": "quick", "default": "default", "full": "full"}


def test_the_package_exports_the_plans_the_cli_runs():
    import eldr.reproduce as reproduce

    assert reproduce.PLANS is PLANS and reproduce.DEFAULT is PLANS["default"]
    assert {"DEFAULT", "FULL", "PLANS", "QUICK"} <= set(reproduce.__all__)


def test_the_default_run_carries_every_claim_with_intervals():
    experiments = {t.experiment for t in plan_tasks(DEFAULT)}
    assert {"main", "tau", "pool", "vanilla", "grid", "tiny"} <= experiments
    assert DEFAULT.main_seeds >= 2  # the headline's ± figures
    assert DEFAULT.grid_start_seeds >= 3  # every grid cell's interval
    assert set(DEFAULT.grid_workloads) == set(FULL.grid_workloads)  # real traces included
    assert DEFAULT.prompt_rates  # routing before prefill


def test_what_the_default_run_leaves_out_is_in_the_full_run():
    assert _cells(DEFAULT) < _cells(FULL)
    assert set(DEFAULT.rates) < set(FULL.rates)
    assert set(DEFAULT.pool_rates) <= set(FULL.pool_rates)
    assert set(DEFAULT.pool_sizes) <= set(FULL.pool_sizes)
    assert not DEFAULT.prefix and not DEFAULT.ep_experiment
    assert {"prefix", "ep"} <= {t.experiment for t in plan_tasks(FULL)}


def test_grid_windows_are_no_shorter_than_the_full_runs():
    for q in DEFAULT.grid_rates:
        assert grid_duration(DEFAULT, q) == grid_duration(FULL, q)
    assert DEFAULT.grid_warmup_s == FULL.grid_warmup_s


def test_quick_shows_every_section_on_less():
    experiments = {t.experiment for t in plan_tasks(QUICK)}
    assert {"main", "tau", "pool", "vanilla", "grid", "tiny"} <= experiments
    assert QUICK.main_seeds >= 2 and QUICK.grid_start_seeds >= 2
    assert len(plan_tasks(QUICK)) < len(plan_tasks(DEFAULT)) < len(plan_tasks(FULL))


def test_task_weight_puts_longer_and_costlier_runs_first():
    tasks = [t for t in plan_tasks(DEFAULT) if t.experiment == "main" and t.replicate == 0]
    by = {(t.policy, t.kind, t.qps): task_weight(DEFAULT, t) for t in tasks}
    assert by[("jsq", "balanced", 100)] > by[("jsq", "balanced", 20)]
    assert by[("eldr_cost", "balanced", 60)] > by[("jsq", "balanced", 60)]
    grid = [t for t in plan_tasks(DEFAULT) if t.experiment == "grid"]
    # a low-rate grid cell runs a longer window: its weight counts it
    low = next(t for t in grid if t.qps == 10 and t.policy == "jsq")
    assert task_weight(DEFAULT, low) == pytest.approx(10 * (10 + grid_duration(DEFAULT, 10)))


def test_each_experiment_takes_its_policies_from_the_report_roles():
    from dataclasses import replace

    from eldr.reproduce.plan import band, grid_balancers, grid_policies, other_locality

    assert QUICK.policies is None  # read from the registry when the tasks are listed
    assert QUICK.headline_policies() == ("random", "round_robin", "jsq", "p2c", "domain",
                                         "eldr", "eldr_cost", "oracle_signature")
    assert (band(), other_locality()) == ("eldr", ("eldr_cost",))
    assert (grid_balancers(), grid_policies()) == (("round_robin", "jsq", "p2c"),
                                                   ("eldr", "eldr_cost"))
    tasks = plan_tasks(QUICK)
    by = {}
    for t in tasks:
        by.setdefault(t.experiment, set()).add((t.policy, t.kind))
    assert ("eldr_cost", "online") in by["main"]  # its report role has an online_key
    assert {p for p, _ in by["tau"]} == {"eldr"} and by["vanilla"] == {("eldr", "vanilla")}
    assert {p for p, _ in by["pool"]} == {"random", "round_robin", "jsq", "p2c", "eldr",
                                          "eldr_cost"}
    assert {p for p, _ in by["grid"]} == {"round_robin", "jsq", "p2c", "eldr", "eldr_cost"}
    mine = replace(QUICK, policies=("jsq", "eldr"))  # a plan's own headline policies
    assert {t.policy for t in plan_tasks(mine) if t.experiment == "main"} == {"jsq", "eldr"}


def test_quick_and_full_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "--quick", "--full"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
