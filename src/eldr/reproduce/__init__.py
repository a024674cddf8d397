"""``eldr reproduce``: the paper's experiments in simulation, written up as a report.

:mod:`eldr.reproduce.plan` lists the simulations of a :class:`Plan` (``QUICK``,
``DEFAULT`` or ``FULL``; ``PLANS`` maps the CLI's names to them);
:mod:`eldr.reproduce.setup` fits the routing artifact on a calibration split,
:mod:`eldr.reproduce.building` does so for every trace of a plan;
:mod:`eldr.reproduce.sweeps` runs the simulations (large arrays shared through
:mod:`eldr.reproduce.memmaps`); :mod:`eldr.reproduce.analysis` and
:mod:`eldr.reproduce.grid` derive the tables, :mod:`eldr.reproduce.plots` the figures, and
:mod:`eldr.reproduce.report` writes ``report.md``, plots and tidy CSV/JSON.
"""

from eldr.reproduce.analysis import Analysis
from eldr.reproduce.plan import DEFAULT, FULL, PLANS, QUICK, Plan, with_overrides
from eldr.reproduce.report import headline_text, write_report
from eldr.reproduce.setup import RoutingSetup, fit_setup
from eldr.reproduce.sweeps import Results, run_plan

__all__ = [
    "DEFAULT",
    "FULL",
    "PLANS",
    "QUICK",
    "Analysis",
    "Plan",
    "Results",
    "RoutingSetup",
    "fit_setup",
    "headline_text",
    "run_plan",
    "with_overrides",
    "write_report",
]
