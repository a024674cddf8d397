"""``eldr reproduce``: the paper's experiments in simulation, written up as a report.

:mod:`eldr.reproduce.setup` fits the routing artifact on a calibration split;
:mod:`eldr.reproduce.sweeps` runs the simulations of a :class:`Plan` (``QUICK`` or
``FULL``); :mod:`eldr.reproduce.report` writes ``report.md``, plots and tidy CSV/JSON.
"""

from eldr.reproduce.report import Analysis, headline_text, write_report
from eldr.reproduce.setup import RoutingSetup, fit_setup
from eldr.reproduce.sweeps import FULL, QUICK, Plan, Results, run_plan, with_overrides

__all__ = [
    "FULL",
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
