"""Online decode routing: one contract for the simulator and the HTTP router.

Modules, in the order a decision runs (llm-d's filter → score → pick shape):

- :mod:`~eldr.routing.protocol`: ``RouteRequest``, ``Decision``, the ``Policy`` protocol
  and its dispatch/release events;
- :mod:`~eldr.routing.filters`: health, capacity, the locality band;
- :mod:`~eldr.routing.scorers`: load, similarity;
- :mod:`~eldr.routing.pickers`: lowest score with tie-breaks;
- policies: :mod:`~eldr.routing.baselines` (random, round-robin, JSQ, P2C, domain),
  :mod:`~eldr.routing.band` (``eldr``), :mod:`~eldr.routing.cost` (``eldr_cost``);
- :mod:`~eldr.routing.registry`: names → factories with declared resources, roles,
  stand-ins and report roles (:mod:`~eldr.routing.roles`); :mod:`~eldr.routing.lazy`: a
  policy served before the model's shape is known;
- :mod:`~eldr.routing.loads`: the router's live per-decoder loads and health.
"""

from eldr.routing import filters, pickers, scorers
from eldr.routing.band import EldrPolicy, decode_patterns
from eldr.routing.baselines import (
    DomainPolicy,
    JSQPolicy,
    P2CPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    domain_groups,
)
from eldr.routing.cost import CostPolicy, ExpertFootprint, prefill_profile
from eldr.routing.lazy import LazyShapePolicy
from eldr.routing.protocol import (
    OUTCOMES,
    Decision,
    NoHealthyWorkerError,
    Outcome,
    Policy,
    PolicyBase,
    RouteRequest,
)
from eldr.routing.registry import (
    POLICIES,
    ROLES,
    SHAPE_RESOURCES,
    PolicySpec,
    ReportRole,
    RoutingResources,
    make_policy,
    make_unbound_policy,
    policies_with_role,
    register_policy,
    report_flagged,
    report_policies,
)

__all__ = [
    "OUTCOMES",
    "POLICIES",
    "ROLES",
    "SHAPE_RESOURCES",
    "CostPolicy",
    "Decision",
    "DomainPolicy",
    "EldrPolicy",
    "ExpertFootprint",
    "JSQPolicy",
    "LazyShapePolicy",
    "NoHealthyWorkerError",
    "Outcome",
    "P2CPolicy",
    "Policy",
    "PolicyBase",
    "PolicySpec",
    "RandomPolicy",
    "ReportRole",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingResources",
    "decode_patterns",
    "domain_groups",
    "filters",
    "make_policy",
    "make_unbound_policy",
    "pickers",
    "policies_with_role",
    "prefill_profile",
    "register_policy",
    "report_flagged",
    "report_policies",
    "scorers",
]
