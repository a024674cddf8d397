"""The policy registry: each policy declares the fitted resources it needs.

    policy = make_policy("eldr", num_workers=K, centroids=C, tau=0.1)

A factory receives exactly the resources its :class:`PolicySpec` declares (``needs`` are
required, ``options`` may be absent); :func:`make_policy` refuses unknown resource names
(a typo is an error, not a silently ignored keyword) and ignores known resources the policy
does not use, so a caller holding one fitted bundle (:class:`RoutingResources`) can build
any policy from it. Registered policies:

- ``random``, ``round_robin``, ``jsq``, ``p2c``: load only (:mod:`eldr.routing.baselines`);
- ``domain``: oracle domain label → worker group (evaluation; needs ``domain_shares``);
- ``eldr``: the locality band (:mod:`eldr.routing.band`; ``centroids``, ``tau``);
- ``eldr_top1``: the band with τ = 0;
- ``eldr_cost``: marginal expert cost (:mod:`eldr.routing.cost`; ``num_layers``,
  ``num_experts``, optional ``context_weight`` and ``capacity``);
- ``oracle_signature``: the band on the TRUE decode pattern (evaluation only).

Each spec also says what the policy is for (``role``: balancer, locality, oracle), what
it needs fitted (``fitted``), what a router runs while that is missing (``stand_in``) and
what the reproduction's report needs of it (``report``, a
:class:`~eldr.routing.roles.ReportRole`; None: not in the report), so callers (the
router, the reproduction) ask the registry instead of matching policy names:
:func:`report_policies` lists the report's policies of a role in report order,
:func:`report_flagged` the one(s) a section is about (docs/adding-a-policy.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

import numpy as np

from eldr.routing.band import EldrPolicy
from eldr.routing.baselines import (
    DomainPolicy,
    JSQPolicy,
    P2CPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from eldr.routing.cost import CostPolicy
from eldr.routing.lazy import LazyShapePolicy
from eldr.routing.protocol import Policy
from eldr.routing.roles import UNIQUE_FLAGS, ReportRole, check_report_role

__all__ = [
    "POLICIES",
    "ROLES",
    "SHAPE_RESOURCES",
    "PolicySpec",
    "ReportRole",
    "RoutingResources",
    "make_policy",
    "make_unbound_policy",
    "policies_with_role",
    "register_policy",
    "report_flagged",
    "report_policies",
]


@dataclass(frozen=True)
class RoutingResources:
    """Everything policies may be built from; ``None`` = not available.

    One bundle per (fit, decode pool): :meth:`from_artifact` fills it from a routing
    artifact, the reproduction (:class:`eldr.reproduce.setup.RoutingSetup`) from its
    calibration split.
    """

    centroids: np.ndarray | None = None  # (K, d) float32 signature centroids
    decode_centroids: np.ndarray | None = None  # (K, d') decode-pattern centroids (oracle)
    tau: float | None = None  # band width
    domain_shares: np.ndarray | None = None  # (D,) calibration share of each domain
    num_layers: int | None = None  # L of the model (cost policy)
    num_experts: int | None = None  # E of the model (cost policy)
    context_weight: float | None = None  # κ: step seconds per context token / per expert
    capacity: float | None = None  # a decoder's batch limit (cost policy's admission)
    decoder_profiles: np.ndarray | None = None  # (K, L, E) cluster mean log(1 − p) (cost)
    load_slack: float | None = None  # cost policy's bounded-load slack (None: unbounded)
    layer_stride: int | None = None  # cost policy prices every s-th layer (None, 1: all)
    random_state: int | np.random.Generator | None = None  # seed of random policies

    @classmethod
    def from_artifact(cls, artifact, order=None, **deployment) -> RoutingResources:
        """The bundle of a routing artifact (:class:`eldr.fit.artifact.RoutingArtifact`),
        decoders in ``order`` (its ``check_workers`` order; None: the artifact's).
        ``deployment``: what the fit does not know (``context_weight``, ``capacity``,
        ``random_state``)."""
        idx = np.arange(len(artifact.worker_ids)) if order is None else np.asarray(order)
        profiles = getattr(artifact, "decoder_profiles", None)
        return cls(centroids=np.asarray(artifact.centroids)[idx], tau=artifact.tau,
                   num_layers=artifact.num_layers, num_experts=artifact.num_experts,
                   decoder_profiles=None if profiles is None else profiles[idx], **deployment)

    def as_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


RESOURCE_NAMES = frozenset(f.name for f in fields(RoutingResources))


SHAPE_RESOURCES = frozenset({"num_layers", "num_experts"})  # the model's (L, E): no fit
ROLES = ("balancer", "locality", "oracle")


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: its factory, what it needs, and what it is for.

    ``role``: ``"balancer"`` (load only: the baselines every locality policy is held
    against), ``"locality"`` (routes on expert locality; what ELDR ships) or ``"oracle"``
    (reads labels a deployment lacks: evaluation only). ``stand_in``: the policy a router
    runs while what this one needs fitted is missing (``--learn`` before its first
    artifact), or None. ``report``: what the reproduction's report needs of it, or None
    (not in the report).
    """

    name: str
    factory: Callable[..., Policy]  # factory(num_workers, **declared resources)
    needs: frozenset[str] = frozenset()  # required resources
    options: frozenset[str] = frozenset()  # resources used when given
    role: str = "balancer"
    stand_in: str | None = None
    report: ReportRole | None = None

    @property
    def evaluation_only(self) -> bool:
        """Needs labels a deployment lacks (oracles): the router refuses it."""
        return self.role == "oracle"

    @property
    def fitted(self) -> frozenset[str]:
        """Resources that come from a fit (an artifact), not from the model alone."""
        return self.needs - SHAPE_RESOURCES

    def variant(self, *, tau: float, kind: str = "balanced") -> str:
        """The name of one evaluated variant of the policy (rows of the reproduction):
        a policy on centroids carries its τ and centroid kind (``eldr[tau=0.1,balanced]``);
        one whose fitted cluster profiles are optional names a kind other than
        ``balanced`` (``eldr_cost[online]``: none fitted); others are their name."""
        if self.needs & {"centroids", "decode_centroids"}:
            return f"{self.name}[tau={tau:g},{kind}]"
        if "decoder_profiles" in self.options and kind != "balanced":
            return f"{self.name}[{kind}]"
        return self.name

    @property
    def reads_true_decode(self) -> bool:
        """Routes on each request's TRUE decode pattern (an oracle's bound on what routing
        by locality can reach; a recorded trace has it, a deployment never)."""
        return "decode_centroids" in self.needs

    @property
    def needs_only_shape(self) -> bool:
        """Needs the model's (L, E) and nothing fitted: it can run before the shape is
        known (:mod:`eldr.routing.lazy`)."""
        return bool(self.needs & SHAPE_RESOURCES) and not self.fitted


_REGISTRY: dict[str, PolicySpec] = {}
POLICIES: Mapping[str, PolicySpec] = MappingProxyType(_REGISTRY)  # name → spec


def register_policy(name: str, factory: Callable[..., Policy], *, needs=(), options=(),
                    role: str = "balancer", stand_in: str | None = None,
                    report: ReportRole | None = None) -> None:
    """Add a policy. A name can be registered once; resources must be known names, each
    either needed or optional; a stand-in must be registered already and need nothing
    fitted; a report role must have what its role needs and agree with the registered
    ones (:func:`eldr.routing.roles.check_report_role`). A refusal is one line naming
    the field."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"policy {name!r}: name is already registered")
    if not callable(factory):
        raise ValueError(f"policy {name!r}: factory must be callable, got {factory!r}")
    unknown = (set(needs) | set(options)) - RESOURCE_NAMES
    if unknown:
        raise ValueError(f"policy {name!r} declares unknown resources {sorted(unknown)}; "
                         f"known: {sorted(RESOURCE_NAMES)}")
    both = set(needs) & set(options)
    if both:
        raise ValueError(f"policy {name!r}: options {sorted(both)} are in needs too")
    if role not in ROLES:
        raise ValueError(f"policy {name!r}: role must be one of {ROLES}, got {role!r}")
    if stand_in is not None and (stand_in not in _REGISTRY or _REGISTRY[stand_in].fitted):
        raise ValueError(f"policy {name!r}: stand-in {stand_in!r} must be a registered "
                         f"policy that needs nothing fitted")
    if report is not None:
        check_report_role(name, role, frozenset(needs), frozenset(options), report,
                          _REGISTRY)
        report = replace(report, key=report.key or name, label=report.label or name)
    _REGISTRY[name] = PolicySpec(name, factory, frozenset(needs), frozenset(options),
                                 role, stand_in, report)


def policies_with_role(role: str) -> tuple[str, ...]:
    """Names of the registered policies of ``role``, in registration order."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return tuple(n for n, spec in _REGISTRY.items() if spec.role == role)


def report_policies(*roles: str, grid: bool | None = None) -> tuple[str, ...]:
    """Names of the policies with a report role, in report order (``ReportRole.order``):
    of ``roles`` only when given; of the grid only (``grid=True``) or outside it."""
    for role in roles:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    specs = sorted((s for s in _REGISTRY.values() if s.report is not None),
                   key=lambda s: s.report.order)
    return tuple(s.name for s in specs if (not roles or s.role in roles)
                 and (grid is None or s.report.grid == grid))


def report_flagged(flag: str) -> tuple[str, ...]:
    """The policies carrying report flag ``flag`` (:data:`eldr.routing.roles.UNIQUE_FLAGS`),
    in report order; exactly as many as the flag takes, else ``ValueError``."""
    if flag not in UNIQUE_FLAGS:
        raise ValueError(f"report flag must be one of {tuple(UNIQUE_FLAGS)}, got {flag!r}")
    names = tuple(n for n in report_policies() if getattr(_REGISTRY[n].report, flag))
    if len(names) != UNIQUE_FLAGS[flag]:
        raise ValueError(f"the report needs {UNIQUE_FLAGS[flag]} registered polic"
                         f"{'y' if UNIQUE_FLAGS[flag] == 1 else 'ies'} with report.{flag}, "
                         f"found {len(names)}")
    return names


def make_policy(name: str, *, num_workers: int, **resources) -> Policy:
    """Build the registered policy ``name`` for ``num_workers`` decoders from ``resources``
    (keywords of :class:`RoutingResources`; ``None`` values count as absent)."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(_REGISTRY)}")
    unknown = set(resources) - RESOURCE_NAMES
    if unknown:
        raise ValueError(f"make_policy: unknown resources {sorted(unknown)}; "
                         f"known: {sorted(RESOURCE_NAMES)}")
    given = {k: v for k, v in resources.items() if v is not None}
    missing = spec.needs - given.keys()
    if missing:
        raise ValueError(f"{name}: {', '.join(sorted(missing))} "
                         f"{'is' if len(missing) == 1 else 'are'} required")
    used = {k: v for k, v in given.items() if k in spec.needs | spec.options}
    return spec.factory(num_workers, **used)


def make_unbound_policy(name: str, *, num_workers: int, **resources) -> Policy:
    """Policy ``name`` before the model's (L, E) is known: a
    :class:`~eldr.routing.lazy.LazyShapePolicy` that balances load until ``bind(L, E)``
    builds the policy with ``resources``. Only for a policy that needs nothing fitted
    (:attr:`PolicySpec.needs_only_shape`)."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(_REGISTRY)}")
    if not spec.needs_only_shape:
        raise ValueError(f"{name}: only a policy that needs the model's shape and nothing "
                         f"fitted can start before the shape is known")
    probe = make_policy(name, num_workers=1, num_layers=1, num_experts=1, **resources)

    def build(k: int, num_layers: int, num_experts: int) -> Policy:
        return make_policy(name, num_workers=k, num_layers=num_layers,
                           num_experts=num_experts, **resources)

    return LazyShapePolicy(name, num_workers, probe.inputs, build)


# The report roles (eldr.routing.roles): `order` is the report's order of rows, tables and
# plot lines; keys and labels are the names its results.json columns and tables use.
register_policy("random", lambda K, **kw: RandomPolicy(K, **kw), options={"random_state"},
                report=ReportRole(order=0))  # never wins a grid cell: not in the grid
register_policy("round_robin", lambda K: RoundRobinPolicy(K),
                report=ReportRole(order=1, grid=True, paper_baseline=True))
register_policy("jsq", lambda K: JSQPolicy(K),
                report=ReportRole(order=2, grid=True, reference=True, check_pair=True))
register_policy("p2c", lambda K, **kw: P2CPolicy(K, **kw), options={"random_state"},
                report=ReportRole(order=3, grid=True, check_pair=True))
register_policy("domain", lambda K, **kw: DomainPolicy(K, **kw), needs={"domain_shares"},
                role="oracle", report=ReportRole(order=4))
register_policy("eldr_cost", lambda K, **kw: CostPolicy(K, **kw),
                needs={"num_layers", "num_experts"},
                options={"context_weight", "capacity", "decoder_profiles", "load_slack",
                         "layer_stride"},
                role="locality",
                report=ReportRole(
                    order=6, key="cost", title="The cost policy", grid=True,
                    about="`eldr_cost` routes on the marginal expert cost "
                          "(docs/fit-and-routing.md): fitted = the artifact's profile "
                          "predictor and cluster profiles; online = no calibration at all.",
                    before_prefill=True, online_key="online", preference=0,
                    sweep_weight=2.0))  # simulates slower than a balancer: its tasks start first
register_policy("eldr", lambda K, **kw: EldrPolicy(K, **kw), needs={"centroids"},
                options={"tau"}, role="locality", stand_in="eldr_cost",
                report=ReportRole(order=5, label="band", grid=True, primary=True,
                                  preference=1))
register_policy("eldr_top1", lambda K, centroids: EldrPolicy(K, centroids=centroids, tau=0.0,
                                                             name="eldr_top1"),
                needs={"centroids"}, role="locality", stand_in="eldr_cost")
register_policy("oracle_signature",
                lambda K, decode_centroids, tau=0.1: EldrPolicy(
                    K, centroids=decode_centroids, tau=tau, use_decode_pattern=True,
                    name="oracle_signature"),
                needs={"decode_centroids"}, options={"tau"}, role="oracle",
                report=ReportRole(order=7, key="oracle", label="oracle"))
