"""What the reproduction's report needs of a policy: its :class:`ReportRole`.

A policy registered with ``report=ReportRole(...)`` (:func:`eldr.routing.register_policy`)
is simulated and shown by ``eldr reproduce`` wherever its role belongs, without the
report naming it (docs/adding-a-policy.md):

- every policy with a report role runs the headline experiment and appears in its plot;
  its rows sit in the order of ``order``;
- a ``balancer`` is one of the load balancers every Δ is taken against; a ``locality``
  policy gets its Δ columns in the headline, decode-pool, tiny-MoE and real-model
  tables; an ``oracle`` gets its Δ columns in the headline (evaluation only);
- ``grid``: in the "never worse than load balancing" grid (a balancer is held against,
  a locality policy held to them);
- the flags of :data:`UNIQUE_FLAGS` name the one policy (two for ``check_pair``) a
  section is about: the band whose τ, centroid kind, signature source and expert
  layout the report sweeps (``primary``), the balancer of one-to-one comparisons
  (``reference``: JSQ), the paper's vanilla-vs-balanced baseline (``paper_baseline``:
  round robin), the two balancers the grid's rule is checked on (``check_pair``), the
  policy the prompt predictor is measured on (``before_prefill``).

:func:`check_report_role` refuses, at registration, a role without what it needs or one
that contradicts a registered policy's, with one line naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["FLAG_ROLES", "UNIQUE_FLAGS", "ReportRole", "check_report_role"]

# flag -> how many registered policies may carry it (check_pair: the two compared)
UNIQUE_FLAGS: Mapping[str, int] = {"primary": 1, "reference": 1, "paper_baseline": 1,
                                   "check_pair": 2, "before_prefill": 1}
# flag -> the policy role it belongs to
FLAG_ROLES: Mapping[str, str] = {"primary": "locality", "reference": "balancer",
                                 "paper_baseline": "balancer", "check_pair": "balancer",
                                 "before_prefill": "locality"}


@dataclass(frozen=True)
class ReportRole:
    """What ``eldr reproduce`` needs of a registered policy (module docstring).

    ``key`` names its columns in ``results.json`` (``cost`` → ``cost_d_p50``) and the
    D/layer chains of the tables; ``label`` heads its columns in the tables; both default
    to the policy's name. A locality policy other than the primary one gets a sub-heading
    in the headline, ``title`` (e.g. "The cost policy"), with ``about`` (one sentence)
    under it. ``online_key``: the key of its calibration-free variant (kind ``online``,
    no fitted cluster profiles), run beside it in the headline; None: not run.
    ``preference``: among locality policies, lower is recommended first when their gains
    tie (``eldr advise``) and shown first in the real-models table (None: after those
    that have one). ``sweep_weight``: its ``simulate()`` time per request relative to a
    balancer's (only the order the sweep runs tasks in depends on it, never a row).
    """

    order: int  # position in the report's task lists, tables and plots (unique)
    key: str | None = None
    label: str | None = None
    title: str = ""
    about: str = ""
    grid: bool = False
    primary: bool = False
    reference: bool = False
    paper_baseline: bool = False
    check_pair: bool = False
    before_prefill: bool = False
    online_key: str | None = None
    preference: int | None = None
    sweep_weight: float = 1.0

    def flags(self) -> tuple[str, ...]:
        """The :data:`UNIQUE_FLAGS` this role carries."""
        return tuple(f for f in UNIQUE_FLAGS if getattr(self, f))

    def keys(self, name: str) -> tuple[str, ...]:
        """Every results.json key it claims (its own, its online variant's)."""
        return (self.key or name, *(() if self.online_key is None else (self.online_key,)))


def _refuse(name: str, field: str, why: str) -> ValueError:
    return ValueError(f"policy {name!r}: report.{field} {why}")


def check_report_role(name: str, role: str, needs: frozenset[str], options: frozenset[str],
                      report: ReportRole, registered: Mapping[str, object]) -> None:
    """Refuse (``ValueError``, one line naming the field) a report role that lacks what it
    needs or contradicts the report roles of ``registered`` (name → PolicySpec)."""
    if not isinstance(report, ReportRole):
        raise ValueError(f"policy {name!r}: report must be a ReportRole, got "
                         f"{type(report).__name__}")
    _check_values(name, report)
    for flag in report.flags():
        if role != FLAG_ROLES[flag]:
            raise _refuse(name, flag, f"belongs to a {FLAG_ROLES[flag]} policy, not a {role}")
    if report.grid and role == "oracle":
        raise _refuse(name, "grid", "needs a balancer or locality policy (an oracle is "
                      "never held to the grid)")
    if report.check_pair and not report.grid:
        raise _refuse(name, "check_pair", "needs report.grid (the check reads grid rows)")
    if report.primary and not ({"centroids"} <= needs and "tau" in options):
        raise _refuse(name, "primary", "needs a policy on centroids with a tau option (the "
                      "report sweeps the band's τ and centroid kind)")
    if report.online_key is not None and "decoder_profiles" not in options:
        raise _refuse(name, "online_key", "needs decoder_profiles among the options (the "
                      "online variant runs without fitted cluster profiles)")
    if role == "locality" and not report.primary and not report.title:
        raise _refuse(name, "title", "is required of a locality policy other than the "
                      "primary one (the heading of its headline rows)")
    if report.preference is not None and role != "locality":
        raise _refuse(name, "preference", f"belongs to a locality policy, not a {role}")
    _check_against(name, report, registered)


def _check_values(name: str, report: ReportRole) -> None:
    if isinstance(report.order, bool) or not isinstance(report.order, int):
        raise _refuse(name, "order", f"must be an integer, got {report.order!r}")
    for f in fields(report):
        v = getattr(report, f.name)
        if f.name in ("key", "label", "online_key") and v is not None \
                and (not isinstance(v, str) or not v):
            raise _refuse(name, f.name, f"must be a non-empty string or None, got {v!r}")
    w = report.sweep_weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w)
                                                                     and w > 0):
        raise _refuse(name, "sweep_weight", f"must be a finite number > 0, got {w!r}")


def _check_against(name: str, report: ReportRole, registered: Mapping[str, object]) -> None:
    """Contradictions with the registered policies' report roles."""
    others = {n: s.report for n, s in registered.items()
              if getattr(s, "report", None) is not None}
    for n, r in others.items():
        if r.order == report.order:
            raise _refuse(name, "order", f"{report.order} is {n!r}'s already")
        if report.preference is not None and r.preference == report.preference:
            raise _refuse(name, "preference", f"{report.preference} is {n!r}'s already")
        clash = set(report.keys(name)) & set(r.keys(n))
        if clash:
            raise _refuse(name, "key", f"{sorted(clash)[0]!r} is {n!r}'s already")
    for flag in report.flags():
        holders = [n for n, r in others.items() if getattr(r, flag)]
        if len(holders) >= UNIQUE_FLAGS[flag]:
            raise _refuse(name, flag, f"is held by {', '.join(map(repr, holders))} already "
                          f"(at most {UNIQUE_FLAGS[flag]})")
