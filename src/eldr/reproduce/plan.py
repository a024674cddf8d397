"""What a reproduction simulates: a :class:`Plan` of sizes and the :class:`Task` rows it
lists (docs/method.md#results-to-reproduce).

A plan is ``QUICK`` (CI and a first look, ``eldr reproduce --quick``), ``DEFAULT`` (every
claim with its intervals in about 15 minutes on 2 cores, ``eldr reproduce``) or ``FULL``
(the paper's setting, ``--full``), with fields replaced by :func:`with_overrides`;
:func:`plan_tasks` lists one :class:`Task` per simulation:

- ``main``: every policy × rate × workload at 8P16D (median/p99 TPOT, median TTFT);
  includes the oracles (``domain``: oracle labels; ``oracle_signature``: the
  perfect-signature bound), and the calibration-free variant of a policy whose report
  role has an ``online_key``;
- ``tau``: the band's width τ on ``task`` at one rate (τ = 0 is top-1, 1 is JSQ);
- ``pool``: decode pools of 8 / 16 / 24 workers (8 prefill), load balancers vs the
  locality policies;
- ``vanilla``: the band with vanilla (unbalanced) K-means centroids, every rate;
- ``prefix`` and ``ep`` (full plan): prefix caching through the signature cache, and
  Qwen3-235B at TP4/EP4 under three expert layouts;
- ``grid``: every (workload, decode pool, rate) cell, :func:`grid_policies` against each
  of :func:`grid_balancers` (:mod:`eldr.reproduce.grid`), on ``grid_min_seeds`` seeds per cell
  at first; :func:`eldr.reproduce.sweeps.run_plan` adds seeds (:func:`grid_cell_tasks`)
  to cells whose intervals are still wider than ``target_half_width``;
- ``tiny``: the shipped tiny MoE's real trace on its measured CPU preset.

The report's "Routing before prefill" section (``prompt_rates``) and its "Real models"
section (``real_models``) are not task lists: each runs its few simulations itself
(:mod:`eldr.reproduce.before_prefill`, :mod:`eldr.reproduce.real_models`).

Which policies each experiment runs comes from the registry's report roles
(:class:`eldr.routing.ReportRole`), read when the tasks are listed: the band is the
locality policy flagged ``primary``, the load balancers are the ``balancer`` role, the
grid holds the roles marked ``grid``. The groups and the tiny trace's set-up key live
here, beside the plan that uses them, so the modules that build, run and report a plan
all take them from one place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from eldr.routing.registry import POLICIES, report_flagged, report_policies

__all__ = ["DEFAULT", "FULL", "PLANS", "QUICK", "TINY_SETUP", "Plan", "Task", "band",
           "grid_balancers", "grid_cell_tasks", "grid_duration", "grid_policies",
           "load_balancers", "other_locality", "plan_tasks", "replicate_seed", "with_overrides"]

TINY_SETUP = "tiny_moe"  # set-up key of the shipped tiny-MoE trace


def load_balancers() -> tuple[str, ...]:
    """The report's load balancers, in report order (every Δ is against the best one)."""
    return report_policies("balancer")


def grid_balancers() -> tuple[str, ...]:
    """The balancers of the never-worse grid (report role ``grid``)."""
    return report_policies("balancer", grid=True)


def grid_policies() -> tuple[str, ...]:
    """The locality policies the grid holds to :func:`grid_balancers`."""
    return report_policies("locality", grid=True)


def band() -> str:
    """The locality policy whose τ, centroid kind, signature source and expert layout the
    report sweeps (report flag ``primary``)."""
    return report_flagged("primary")[0]


def other_locality() -> tuple[str, ...]:
    """The report's locality policies besides :func:`band`, in report order (each gets
    its own columns beside the band's)."""
    return tuple(p for p in report_policies("locality") if p != band())


@dataclass(frozen=True)
class Plan:
    """Sizes of a reproduction run."""

    name: str  # "quick", "default" or "full"
    model: str = "qwen3-30b-a3b"  # model preset (trace generator and step time)
    workloads: tuple[str, ...] = ("task", "language")
    num_requests: int | None = 2000  # trace size per workload (None: workload default)
    calib_requests: int = 1000  # calibration split (paper: ~1,000 prompts)
    trace_seed: int = 20260402  # eldr.traces.synth's DEFAULT_TRACE seed
    seed: int = 0  # arrivals, tokens, K-means
    rates: tuple[float, ...] = (20, 40, 60, 80, 100)
    warmup_s: float = 30.0
    duration_s: float = 120.0
    num_prefill: int = 8
    num_decode: int = 16
    # the headline's policies; None: every policy with a report role, in report order
    # (headline_policies(), read when the tasks are listed)
    policies: tuple[str, ...] | None = None
    tau: float = 0.1
    tau_values: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
    tau_rate: float = 80
    pool_sizes: tuple[int, ...] = (8, 16, 24)
    pool_rates: tuple[float, ...] = (20, 40, 60, 80, 100)
    vanilla: bool = True
    # prefix caching (task, tau_rate): ELDR through the signature cache vs fresh-token counts;
    # needs a per-token trace (slow to generate), so "full" only
    prefix: bool = False
    prefix_requests: int = 2000
    # expert parallelism: Qwen3-235B-A22B at TP4/EP4, 2P8D (paper §6), task workload;
    # placements: vLLM's contiguous layout, one global greedy layout, per-decoder layouts
    ep_experiment: bool = False
    ep_model: str = "qwen3-235b-a22b"
    ep_requests: int = 2000
    ep_num_prefill: int = 2
    ep_num_decode: int = 8
    ep_tp: int = 4
    ep: int = 4
    ep_rates: tuple[float, ...] = (10, 20, 30, 40)
    # "never worse than load balancing": every (workload, decode pool, rate) cell with
    # short windows; azure_conv / mooncake_conv replay real arrivals and lengths
    grid: bool = True
    grid_workloads: tuple[str, ...] = ("task", "language", "azure_conv", "mooncake_conv")
    grid_pools: tuple[int, ...] = (8, 16, 24, 32)
    grid_rates: tuple[float, ...] = (5, 10, 20, 40, 60, 80, 100)
    grid_warmup_s: float = 10.0
    grid_duration_s: float = 40.0
    # a low-rate cell measures at least this many requests (longer window): a p99 of a few
    # hundred requests moves by several percent between seeds
    grid_min_requests: int = 2000
    # seeds: every Δ of the grid is a mean of per-seed paired differences with a 95 %
    # interval (eldr.intervals); a cell starts with grid_min_seeds seeds and gets one more
    # per round until every interval of the cell is at most target_half_width percentage
    # points wide on each side, or it has grid_max_seeds
    grid_min_seeds: int = 3
    grid_max_seeds: int = 10
    target_half_width: float = 0.5
    # seeds of every main-experiment point (the headline's ± figures; 1: no intervals)
    main_seeds: int = 3
    # the shipped tiny MoE's real captured trace on its measured CPU preset
    tiny: bool = True
    tiny_rates: tuple[float, ...] = (10, 40, 100, 160, 220)
    tiny_num_prefill: int = 8
    tiny_num_decode: int = 4
    tiny_warmup_s: float = 10.0
    tiny_duration_s: float = 60.0
    # "Routing before prefill" (eldr.reproduce.before_prefill): the prompt predictor on the
    # shipped prompt trace, eldr_cost on it vs on the prefill signature vs JSQ at these
    # loads on the tiny-MoE preset (tiny_num_prefill/decode, tiny_warmup_s + this window);
    # empty: no such section (a plan made for tests)
    prompt_rates: tuple[float, ...] = ()
    prompt_duration_s: float = 60.0
    # "Real models" (eldr.reproduce.real_models): the shipped real routing of GPT-OSS-20B
    # and of ESFT (DeepSeek-V2-Lite) replayed at the load the data sustains, each seed its
    # own split, fit and arrivals; ESFT also with outputs capped at real_output_cap tokens
    real_models: bool = True
    real_seeds: int = 3
    real_warmup_s: float = 10.0
    real_duration_s: float = 30.0
    real_output_cap: int = 64
    selection_max_pairs: int | None = 100_000  # layer-mask search pairs (encoder fit)
    max_pairs: int | None = 200_000  # pairs for the reported ρ
    hardware: str = "h200"

    def __post_init__(self) -> None:
        if not isinstance(self.grid_max_seeds, int) or self.grid_max_seeds < 2:
            raise ValueError("Plan: grid_max_seeds must be an integer >= 2 (an interval "
                             f"needs two seeds), got {self.grid_max_seeds!r}")
        if not isinstance(self.grid_min_seeds, int) or self.grid_min_seeds < 2:
            raise ValueError(f"Plan: grid_min_seeds must be an integer >= 2, got "
                             f"{self.grid_min_seeds!r}")
        if not self.target_half_width > 0:
            raise ValueError(f"Plan: target_half_width must be > 0 percentage points, got "
                             f"{self.target_half_width!r}")
        if not isinstance(self.real_seeds, int) or self.real_seeds < 2:
            raise ValueError(f"Plan: real_seeds must be an integer >= 2 (an interval needs "
                             f"two seeds), got {self.real_seeds!r}")
        if not isinstance(self.main_seeds, int) or self.main_seeds < 1:
            raise ValueError(f"Plan: main_seeds must be an integer >= 1, got "
                             f"{self.main_seeds!r}")

    def headline_policies(self) -> tuple[str, ...]:
        """The policies of the ``main`` experiment (``policies``, or every policy with a
        report role)."""
        return report_policies() if self.policies is None else tuple(self.policies)

    @property
    def grid_start_seeds(self) -> int:
        """Seeds every grid cell runs before any is added (never above the maximum)."""
        return min(self.grid_min_seeds, self.grid_max_seeds)


# --quick: every section once, on the smallest inputs that show it (about 45 s on 2 idle
# cores): the task workload at one rate, the grid on one real trace at one low rate (its
# replayed head is then shorter). Same traces, windows and seeds as before otherwise.
QUICK = Plan(
    name="quick", workloads=("task",), rates=(80,), warmup_s=5.0, duration_s=20.0,
    tau_values=(0.0, 0.1, 0.3, 1.0), tau_rate=80, pool_sizes=(8, 16), pool_rates=(80,),
    selection_max_pairs=10_000, max_pairs=50_000,
    grid_workloads=("azure_conv",), grid_pools=(8, 16), grid_rates=(10,),
    grid_warmup_s=5.0, grid_duration_s=15.0, grid_min_requests=300, tiny_rates=(40,),
    tiny_warmup_s=5.0,
    tiny_duration_s=20.0, grid_max_seeds=3, main_seeds=2,
    prompt_rates=(160,), prompt_duration_s=10.0,
    real_seeds=2, real_warmup_s=5.0, real_duration_s=15.0,
)
# --full: the paper's setting. Full-size traces (11k-13k held-out requests), the headline
# at 5 rates with 120 s windows, pools at 3 rates, prefix caching (a per-token trace) and
# expert parallelism (a Qwen3-235B trace), and the whole never-worse grid (112 cells).
# 3 seeds per grid cell (--max-seeds 10 --main-seeds 3 reaches for the ±0.5-point target,
# at several times the run time) and 2 per headline point.
FULL = Plan(name="full", num_requests=None, pool_rates=(20, 60, 100), prefix=True,
            ep_experiment=True, grid_max_seeds=3, main_seeds=2,
            prompt_rates=(40, 100, 160, 220), real_seeds=5, real_duration_s=60.0)
# The default run (no flag), sized for about 15 minutes on 2 cores: every claim of the
# report with its intervals, on less. 4,000-request traces (3,000 held out; built two at
# a time), the headline at 20 / 60 / 100 req/s with 60 s windows, 2 seeds each; the τ
# sweep and pools 8 / 24 at 60 req/s; the grid on all four workloads at pools 8 and 32 and
# 10 / 40 / 80 req/s (24 cells, the full grid's windows), 3 seeds each. Left to --full:
# prefix caching, expert parallelism, the other 88 grid cells, rates 40 and 80 and the
# 120 s windows of the headline, pools at 20 and 100 req/s, the full-size traces.
DEFAULT = replace(FULL, name="default", num_requests=4000, rates=(20, 60, 100),
                  duration_s=60.0, tau_rate=60, pool_rates=(60,), prefix=False,
                  ep_experiment=False, grid_pools=(8, 32), grid_rates=(10, 40, 80),
                  real_seeds=3, real_duration_s=30.0)
PLANS = {"quick": QUICK, "default": DEFAULT, "full": FULL}  # by the name the CLI takes


@dataclass(frozen=True)
class Task:
    """One simulation run."""

    experiment: str  # main / tau / pool / vanilla / prefix / ep
    workload: str  # key of the routing set-up (workload, or workload@model, workload+topk)
    policy: str
    qps: float
    num_decode: int
    tau: float
    kind: str = "balanced"  # centroid kind for eldr: balanced / vanilla
    keep_decoders: bool = False  # also return per-decoder rows
    num_prefill: int | None = None  # None: the plan's
    model: str | None = None  # None: the plan's
    tp: int = 1
    ep: int = 1
    placement: str = "contiguous"  # EP layout: contiguous / global / per_decoder
    signature_source: str | None = None  # prefix caching on with this source; None: off
    warmup_s: float | None = None  # None: the plan's
    duration_s: float | None = None  # None: the plan's
    hardware: str | None = None  # None: the plan's
    replicate: int = 0  # seed number j: runs on replicate_seed(plan.seed, j)

    @property
    def variant(self) -> str:
        # the registry names the policy's variant ("online": no fitted cluster profiles)
        v = POLICIES[self.policy].variant(tau=self.tau, kind=self.kind)
        if self.signature_source is not None:
            v += f"+prefix[{self.signature_source}]"
        if self.ep > 1:
            v += f"+ep[{self.placement}]"
        return v


def plan_tasks(plan: Plan) -> list[Task]:
    """All runs of a plan, without duplicates (later experiments reuse ``main`` rows)."""
    tasks: list[Task] = []
    K = plan.num_decode
    balancers, sweeping = load_balancers(), report_policies("balancer", "locality")
    main = plan.headline_policies()
    # a policy whose calibration-free variant the headline shows runs it too
    online = [p for p in main if POLICIES[p].report is not None
              and POLICIES[p].report.online_key is not None]
    for wl in plan.workloads:
        for q in plan.rates:
            for j in range(plan.main_seeds):
                for p in main:
                    tasks.append(Task("main", wl, p, q, K, plan.tau,
                                      keep_decoders=q == plan.tau_rate and j == 0,
                                      replicate=j))
                tasks += [Task("main", wl, p, q, K, plan.tau, kind="online", replicate=j)
                          for p in online]
    wl0, the_band = plan.workloads[0], band()
    for tau in plan.tau_values:
        if tau != plan.tau or plan.tau_rate not in plan.rates:
            tasks.append(Task("tau", wl0, the_band, plan.tau_rate, K, tau))
    if plan.tau_rate not in plan.rates:
        tasks += [Task("tau", wl0, p, plan.tau_rate, K, plan.tau) for p in balancers]
    for k in plan.pool_sizes:
        for q in plan.pool_rates:
            if k == K and q in plan.rates:
                continue
            for p in sweeping:
                tasks.append(Task("pool", wl0, p, q, k, plan.tau))
    if plan.vanilla:
        for wl in plan.workloads:
            for q in plan.rates:
                tasks.append(Task("vanilla", wl, the_band, q, K, plan.tau, kind="vanilla"))
    if plan.prefix:
        key = f"{wl0}+topk"
        for p in balancers:
            tasks.append(Task("prefix", key, p, plan.tau_rate, K, plan.tau,
                              signature_source="trace"))
        for src in ("sigcache", "fresh"):
            tasks.append(Task("prefix", key, the_band, plan.tau_rate, K, plan.tau,
                              signature_source=src))
    if plan.ep_experiment:
        tasks += _ep_tasks(plan, balancers, the_band)
    if plan.grid:
        for wl in plan.grid_workloads:
            for k in plan.grid_pools:
                for q in plan.grid_rates:
                    for j in range(plan.grid_start_seeds):
                        tasks += grid_cell_tasks(plan, wl, k, q, j)
    if plan.tiny:
        common = dict(num_prefill=plan.tiny_num_prefill, model="tiny-moe", hardware="cpu",
                      warmup_s=plan.tiny_warmup_s, duration_s=plan.tiny_duration_s)
        for q in plan.tiny_rates:
            for p in sweeping:
                tasks.append(Task("tiny", TINY_SETUP, p, q, plan.tiny_num_decode, plan.tau,
                                  **common))
    return tasks


def _ep_tasks(plan: Plan, balancers: tuple[str, ...], the_band: str) -> list[Task]:
    """Expert parallelism: the balancers under two layouts, the band under three."""
    key = f"{plan.workloads[0]}@{plan.ep_model}"
    common = dict(num_prefill=plan.ep_num_prefill, model=plan.ep_model, tp=plan.ep_tp,
                  ep=plan.ep)
    tasks = []
    for q in plan.ep_rates:
        for p in balancers:
            for layout in ("contiguous", "global"):
                tasks.append(Task("ep", key, p, q, plan.ep_num_decode, plan.tau,
                                  placement=layout, **common))
        for layout in ("contiguous", "global", "per_decoder"):
            tasks.append(Task("ep", key, the_band, q, plan.ep_num_decode, plan.tau,
                              placement=layout, **common))
    return tasks


def grid_cell_tasks(plan: Plan, workload: str, num_decode: int, qps: float,
                    replicate: int) -> list[Task]:
    """The runs of one grid cell on seed number ``replicate``: every balancer of
    :func:`grid_balancers` and every policy of :func:`grid_policies` on the same
    arrivals."""
    win = dict(warmup_s=plan.grid_warmup_s, duration_s=grid_duration(plan, qps))
    return [Task("grid", workload, p, qps, num_decode, plan.tau, replicate=replicate, **win)
            for p in (*grid_balancers(), *grid_policies())]


def replicate_seed(base: int, replicate: int) -> int:
    """The simulation seed of seed number ``replicate`` of a point: ``base + replicate``,
    so seed number 0 is the plan's own seed (its single-seed numbers) and every run is
    reproducible from the plan's seed alone."""
    return int(base) + int(replicate)


def grid_duration(plan: Plan, qps: float) -> float:
    """Measured seconds of a grid cell: the plan's window, longer at low rates so that
    every cell measures about ``grid_min_requests`` requests."""
    return max(plan.grid_duration_s, plan.grid_min_requests / float(qps))


def with_overrides(plan: Plan, **changes) -> Plan:
    """A plan with some fields replaced (CLI overrides); ``None`` values are ignored."""
    return replace(plan, **{k: v for k, v in changes.items() if v is not None})
