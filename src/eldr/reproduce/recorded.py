"""Simulating a recorded trace's own routing: which input each policy routes on, the load
the data sustains, and every policy against the balancers with paired intervals
(docs/real-models.md, "Simulated on real routing").

The simulator replays each held-out request's recorded per-token experts
(:class:`~eldr.sim.TokenBank` reads ``decode_topk``). What differs from a synthetic trace:

**Routing inputs.** What a locality policy knows of a request when it picks its decoder
is explicit (:data:`INPUTS`, :func:`routing_input`):

- ``prefill``: the trace records prefill routing (ESFT): the prefill signature and the
  profile predicted from the prefill counts, the project's fit recipe
  (:func:`eldr.reproduce.setup.fit_split`) on the calibration split;
- ``prompt``: decode-only, with the prompts' token ids (GPT-OSS-20B): a
  :class:`~eldr.fit.prompt.PromptPredictor` fitted on the calibration split maps a prompt
  to its DECODE profile (per-token inclusion probability of each expert, the target the
  cost policy needs; :func:`eldr.fit.prompt_decode.fit_decode_predictor`); the band's
  signature is that profile as a unit row. The calibration requests are clustered on
  their own predicted profiles, predicted by a predictor that did not see them (two
  folds), so clusters and held-out requests live in one space. The router's prediction
  gate (:class:`eldr.fit.prompt_decode.PredictionGate`, thresholds from the calibration
  prompts alone) sends a prompt less familiar than the calibration's to load balancing,
  and all of them when the predictor's cross-validated R² is below its floor;
- ``none``: decode-only without token ids: nothing is known before decode, so a locality
  policy has nothing to route on; it is not simulated (it would route by load, as JSQ) and
  the rows say so.

The balancers need no input; an oracle on the true decode pattern
(``oracle_signature``, :attr:`eldr.routing.PolicySpec.reads_true_decode`) reads each
request's (an upper bound no router reaches), clustered on the calibration split's. The
policies compared by default come from the registry's report roles (:func:`balancers`,
:func:`locality`, :func:`oracles`); JSQ, the registry's ``reference`` balancer, is the
one ``vs_jsq`` is against.

**Load.** The held-out split is a few hundred requests; arrivals replay them over and over.
Arrivals cycle through ONE seeded permutation (:func:`recycled_arrivals`), so copies of a
request are exactly ``R`` arrivals apart, and the rate is the highest at which no copy
arrives while another is still in flight (:func:`sustainable_rate`, measured on JSQ with a
margin; every run's count of such overlaps is in its row, ``copies_in_flight``). A request
batched with a copy of itself would share all its experts: a locality policy would pack
them and win for nothing.

**Seeds.** Seed ``j`` draws its own calibration/held-out split, fit and arrivals; every
policy of a seed sees the same arrivals, so differences are paired per seed
(:func:`eldr.intervals.paired_interval`: mean ± 95 % half-width, Student t).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from eldr.fit.calibration import FitSettings
from eldr.fit.cluster import BalancedKMeans
from eldr.fit.predictor import decoder_profiles as _cluster_log_miss
from eldr.intervals import paired_interval
from eldr.reproduce.plan import band, grid_balancers
from eldr.reproduce.setup import RoutingSetup, fit_split
from eldr.routing import POLICIES, decode_patterns, report_flagged, report_policies
from eldr.sim import SimConfig, TokenBank, simulate
from eldr.sim.steptime import routing_resources
from eldr.traces.models import get_preset
from eldr.traces.trace import Trace

__all__ = ["INPUTS", "INPUT_LABELS", "PROMPT_OPTIONS", "Comparison", "PromptSetup",
           "balancers", "cap_outputs", "compare", "copies_in_flight", "fit_recorded",
           "heldout_rho", "locality", "oracles", "policy_input", "recycled_arrivals",
           "reference", "routing_input", "sustainable_rate"]


def balancers() -> tuple[str, ...]:
    """The balancers compared: the grid's (random never wins a cell)."""
    return grid_balancers()


def locality() -> tuple[str, ...]:
    """The locality policies compared (what ELDR ships), in report order."""
    return report_policies("locality")


def oracles() -> tuple[str, ...]:
    """The oracles compared: those on the true decode pattern (the whole-decode bound; a
    recorded trace has it, domain labels it may not)."""
    return tuple(p for p in report_policies("oracle") if POLICIES[p].reads_true_decode)


def reference() -> str:
    """The balancer of one-to-one comparisons (``vs_jsq``; the registry's ``reference``)."""
    return report_flagged("reference")[0]


INPUTS = ("prefill", "prompt", "none")
INPUT_LABELS = {"prefill": "prefill signature", "prompt": "prompt prediction",
                "none": "none (decode-only, no prompt token ids)",
                "load": "none needed (load only)", "decode": "true decode pattern (oracle)"}
# The prompt predictor's candidates, fixed before any real trace was looked at: the
# cross-validation on the calibration split picks among these two weightings and two
# penalties (one bucket count and rank: the full grid costs 20 s per fit)
PROMPT_OPTIONS = {"bits": (16,), "weightings": ("tfidf", "tf"), "ranks": (32,),
                  "alphas": (0.01, 0.1), "folds": 2}
_P_MAX = 1.0 - 1e-6


def routing_input(trace: Trace) -> str:
    """What a locality policy can route ``trace``'s requests on (:data:`INPUTS`)."""
    if trace.prefill_counts is not None:
        return "prefill"
    if trace.prompt_token_ids is not None and (trace.prompt_lens > 0).all():
        return "prompt"
    return "none"


def policy_input(policy: str, trace_input: str) -> str:
    """The routing input ``policy`` has on a trace whose locality input is ``trace_input``
    (a key of :data:`INPUT_LABELS`)."""
    role = POLICIES[policy].role
    if role == "balancer":
        return "load"
    if role == "oracle":
        return "decode"
    return trace_input


# -- set-ups ----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _RowsCalibration:
    """What :class:`RoutingSetup` asks of a calibration, for a trace without prefill
    routing: the calibration requests' routing rows (``None``: no routing input) and their
    per-token profiles (the cost policy's cluster profiles)."""

    trace: Trace  # the calibration split
    rows: np.ndarray | None  # (R, d) float32 unit rows, or None: nothing to cluster on
    profiles_: np.ndarray | None  # (R, L, E) float32 predicted per-token decode profiles
    settings: FitSettings
    predictor: object = None  # the fitted PromptPredictor (reported), or None
    encoder: object = None  # no signature encoder (no prefill counts)
    encoder_seconds: float = 0.0

    def signatures(self) -> np.ndarray:
        if self.rows is None:
            raise ValueError("this decode-only trace has no prompt token ids: no routing "
                             "input to cluster (only balancers and the decode oracle run)")
        return self.rows

    def clusters(self, num_clusters: int, *, balanced: bool = True,
                 rows: np.ndarray | None = None) -> BalancedKMeans:
        X = self.signatures() if rows is None else rows
        return BalancedKMeans(num_clusters, balanced=balanced, n_init=self.settings.n_init,
                              random_state=self.settings.random_state).fit(X)

    def cluster_profiles(self, labels: np.ndarray, num_clusters: int) -> np.ndarray:
        if self.profiles_ is None:
            raise ValueError("no routing input: no cluster profiles")
        return _cluster_log_miss(self.profiles_, labels, num_clusters)


@dataclass(eq=False)
class PromptSetup(RoutingSetup):
    """A :class:`RoutingSetup` of a decode-only trace: the held-out requests' routing
    inputs are predicted from their prompts (``eval_profiles``; ``signatures`` their unit
    rows), or absent (``eval_profiles`` None: no routing input)."""

    eval_profiles: np.ndarray | None = None  # (R_eval, L, E) float32, or None
    # (R_eval,) bool: the prediction gate lets the router use request r's prediction
    # (eldr.fit.prompt_decode.PredictionGate); elsewhere it is routed by load alone
    admitted: np.ndarray | None = None
    gate: dict | None = None  # the gate's figures (cv R², threshold, enabled)

    def profile(self, r: int) -> np.ndarray:
        if self.eval_profiles is None:
            raise ValueError("no routing input: no predicted profile")
        return self.eval_profiles[r]

    @property
    def admitted_share(self) -> float:
        """Share of held-out requests routed on their prediction (nan: no input)."""
        return float("nan") if self.admitted is None else float(self.admitted.mean())

    def inputs(self, policy, *, patterns: bool = True) -> dict:
        out: dict = {}
        if "signature" in policy.inputs and self.eval_profiles is not None:
            # an all-zero signature: the band holds every decoder (load balancing)
            out["signatures"] = np.where(self.admitted[:, None], self.signatures, 0.0
                                         ).astype(np.float32)
        if "decode_pattern" in policy.inputs and patterns:
            out["decode_patterns"] = self.patterns
        if "profile" in policy.inputs and self.eval_profiles is not None:
            out["profiles"] = _GatedProfiles(self.eval_profiles, self.admitted)
        return out


def _domain_shares(calib: Trace) -> np.ndarray | None:
    """(D,) calibration share of each domain label (the ``domain`` oracle's), as
    :func:`eldr.reproduce.setup.fit_split` computes them; None without labels."""
    if calib.domains is None:
        return None
    shares = np.bincount(calib.domains, minlength=len(calib.domain_names)).astype(float)
    shares = shares / shares.sum()
    return (shares + 1e-6) / (shares + 1e-6).sum() if (shares == 0).any() else shares


def _prompt_predictor(fit: Trace, seed: int, vocab: int):
    """A prompt → decode profile predictor fitted on ``fit``
    (:func:`eldr.fit.prompt_decode.fit_decode_predictor`, options :data:`PROMPT_OPTIONS`),
    recording ``vocab`` (1 + the largest id of the calibration and held-out splits) as its
    vocabulary. Its source is ``calibration`` (the ids' tokenizer is unknown here): the
    held-out prompts' ids the fit never saw are hashed like any other, not refused."""
    from eldr.fit.prompt_decode import fit_decode_predictor

    keep = np.flatnonzero((fit.decode_lens > 0) & (fit.prompt_lens > 0))
    if keep.size < 2 * PROMPT_OPTIONS["folds"]:
        raise ValueError(f"{keep.size} calibration requests with decode tokens: too few to "
                         "fit a prompt predictor")
    return fit_decode_predictor(fit, random_state=seed, vocab_size=vocab,
                                vocab_source="calibration", **PROMPT_OPTIONS)


class _GatedProfiles:
    """``profiles(r)``: held-out request ``r``'s predicted profile, or None where the
    prediction gate sent it to load balancing (the cost policy then routes it by load)."""

    def __init__(self, profiles: np.ndarray, admitted: np.ndarray) -> None:
        self.profiles, self.admitted = profiles, admitted

    def __call__(self, r: int):
        return self.profiles[r] if self.admitted[r] else None


def _predict(pred, trace: Trace) -> np.ndarray:
    out = np.stack([pred.predict(trace.prompt_tokens(r)) for r in range(trace.num_requests)])
    return np.minimum(out.astype(np.float32), np.float32(_P_MAX))


def _prompt_setup(calib: Trace, ev: Trace, name: str, seed: int) -> PromptSetup:
    """Routing inputs from the prompts (module docstring): a predictor on the whole
    calibration split for the held-out requests; two fold predictors for the calibration
    requests' own rows (each predicts the half it was not fitted on)."""
    from eldr.fit.prompt_decode import PredictionGate

    t0 = time.perf_counter()
    vocab = int(max(calib.prompt_token_ids.max(), ev.prompt_token_ids.max())) + 1
    pred = _prompt_predictor(calib, seed, vocab)
    eval_profiles = _predict(pred, ev)
    fit_prompts = [calib.prompt_tokens(r) for r in range(calib.num_requests)
                   if calib.prompt_lens[r] > 0 and calib.decode_lens[r] > 0]
    gate = PredictionGate.calibrate(pred, fit_prompts, random_state=seed)
    admitted = gate.admit([ev.prompt_tokens(r) for r in range(ev.num_requests)])
    halves = np.random.default_rng((seed, 0xF01D)).permutation(calib.num_requests) % 2
    calib_profiles = np.empty((calib.num_requests, *eval_profiles.shape[1:]), np.float32)
    for h in (0, 1):
        part = calib.subset(halves != h)
        held = np.flatnonzero(halves == h)
        calib_profiles[held] = _predict(_prompt_predictor(part, seed, vocab),
                                        calib.subset(held))
    cal = _RowsCalibration(calib, decode_patterns(calib_profiles), calib_profiles,
                           FitSettings(random_state=seed), predictor=pred,
                           encoder_seconds=time.perf_counter() - t0)
    return PromptSetup(workload=name, calib=calib, eval=ev, calibration=cal,
                       signatures=decode_patterns(eval_profiles),
                       domain_shares=_domain_shares(calib),
                       tokens=TokenBank(ev, seed=seed), seed=seed,
                       eval_profiles=eval_profiles, admitted=np.asarray(admitted, bool),
                       gate=gate.as_dict())


def fit_recorded(trace: Trace, *, seed: int = 0, calib_share: float = 0.5,
                 name: str | None = None, allow_dealt: bool = False) -> RoutingSetup:
    """Split ``trace`` (seeded by ``seed``; ``calib_share`` calibrates) and fit the routing
    inputs it allows (:func:`routing_input`). The returned set-up carries
    ``routing_input`` (an attribute) and replays the held-out split. ``allow_dealt``: a
    trace without per-token decode experts replays tokens dealt from its decode counts
    (:func:`eldr.sim.steptime.deal_bitsets`: each token's inclusion probabilities exact,
    the recorded token-to-token order lost); otherwise it is refused."""
    if not 0.0 < calib_share < 1.0:
        raise ValueError(f"calib_share must be in (0, 1), got {calib_share}")
    if trace.decode_topk is None and not allow_dealt:
        raise ValueError(f"trace ({trace.meta.source}) has no per-token decode experts "
                         "(decode_topk): there is no recorded routing to replay")
    if trace.num_requests < 8:
        raise ValueError(f"{trace.num_requests} requests: too few to split into a "
                         "calibration and a held-out part")
    name = name or trace.meta.model
    calib, ev = trace.split(calib_share, random_state=seed)
    kind = routing_input(trace)
    if kind == "prefill":
        setup = fit_split(calib, ev, name, seed=seed, selection_max_pairs=20_000,
                          max_pairs=50_000)
    elif kind == "prompt":
        setup = _prompt_setup(calib, ev, name, seed)
    else:
        cal = _RowsCalibration(calib, None, None, FitSettings(random_state=seed))
        setup = PromptSetup(workload=name, calib=calib, eval=ev, calibration=cal,
                            signatures=None, domain_shares=_domain_shares(calib),
                            tokens=TokenBank(ev, seed=seed), seed=seed, eval_profiles=None)
    setup.routing_input = kind
    return setup


def _admitted(setup: RoutingSetup) -> float:
    kind = getattr(setup, "routing_input", "prefill")
    if kind == "prefill":
        return 1.0
    return setup.admitted_share if kind == "prompt" else float("nan")


def heldout_rho(setup: RoutingSetup) -> float:
    """ρ (docs/method.md Eq. 1) of the held-out requests' routing input against their
    decode patterns: the prefill signature's or the prompt prediction's (nan: no input)."""
    from eldr.fit.signature import rho

    if getattr(setup, "routing_input", "prefill") == "none" or setup.signatures is None:
        return float("nan")
    keep = np.flatnonzero(setup.eval.decode_lens > 0)
    if keep.size < 3:
        return float("nan")
    return float(rho(setup.signatures[keep], setup.eval.decode_counts[keep]))


# -- arrivals and load ------------------------------------------------------------------------
def recycled_arrivals(num_requests: int, qps: float, horizon_s: float, seed: int, *,
                      times: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Poisson arrivals at ``qps`` in [0, ``horizon_s``) (or the given ``times``: a real
    trace's, those before the horizon), each replaying held-out request ``perm[i mod R]``
    of one seeded permutation: copies of a request are exactly R arrivals apart (no two
    close together by chance). Returns (times, indices)."""
    if num_requests < 1:
        raise ValueError("no held-out requests to replay")
    rng = np.random.default_rng((seed, 0x2EC0))
    perm = rng.permutation(num_requests)
    if times is not None:
        t = np.asarray(times, dtype=np.float64)
        t = t[t < horizon_s]
        return t, perm[np.arange(t.size) % num_requests].astype(np.int64)
    expected = qps * horizon_s
    n = int(expected + 6 * np.sqrt(expected) + 16)
    times = np.cumsum(rng.exponential(1.0 / qps, size=n))
    while times[-1] < horizon_s:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / qps,
                                                                             size=n))])
    times = times[times < horizon_s]
    return times, perm[np.arange(times.size) % num_requests].astype(np.int64)


def copies_in_flight(res) -> int:
    """Arrivals of a finished run routed to the decoder where an earlier copy of the same
    request was still decoding (0: no request was ever batched with itself). Copies are
    ``R`` arrivals apart (:func:`recycled_arrivals`), so only consecutive ones can meet."""
    req = res.requests
    idx, start, end = req["trace_index"], req["t_prefill_end"], req["t_last"]
    dec = req["decoder"]
    order = np.lexsort((start, idx))
    i, s, e, d = idx[order], start[order], end[order], dec[order]
    meet = (i[1:] == i[:-1]) & (s[1:] < e[:-1]) & (d[1:] == d[:-1])
    return int(meet.sum())


def cap_outputs(trace: Trace, max_decode_tokens: int) -> Trace:
    """``trace`` with every request's recorded decode cut after its first
    ``max_decode_tokens`` tokens (what ``max_tokens`` would have done: its routing up to
    there is the recorded one). Needs ``decode_topk``."""
    if trace.decode_topk is None:
        raise ValueError("cap_outputs needs per-token decode experts (decode_topk)")
    n = int(max_decode_tokens)
    if n < 1:
        raise ValueError(f"max_decode_tokens must be >= 1, got {max_decode_tokens!r}")
    lens = np.minimum(trace.decode_lens, n)
    off = trace.decode_offsets
    rows = np.concatenate([np.arange(off[r], off[r] + lens[r]) for r in
                           range(trace.num_requests)] or [np.zeros(0, np.int64)])
    topk = trace.decode_topk[rows]
    m = trace.meta
    req = np.repeat(np.arange(trace.num_requests), lens)
    flat = ((req[:, None, None] * m.num_layers + np.arange(m.num_layers)[None, :, None])
            * m.num_experts + topk.astype(np.int64)).ravel()
    counts = np.bincount(flat, minlength=trace.num_requests * m.num_layers * m.num_experts)
    kw = {"decode_topk": topk, "output_lens": (lens + 1).astype(np.int64),
          "decode_counts": counts.reshape(trace.decode_counts.shape).astype(np.int32)}
    ids = getattr(trace, "decode_token_ids", None)
    if ids is not None:
        kw["decode_token_ids"] = ids[rows]
    return replace(trace, _cache={}, **kw)


def _config(model, hardware, num_decode: int, qps: float, seed: int, *,
            warmup_s: float, duration_s: float, num_prefill: int) -> SimConfig:
    return SimConfig(model=model, hardware=hardware, num_prefill=num_prefill,
                     num_decode=num_decode, qps=float(qps), warmup_s=warmup_s,
                     duration_s=duration_s, seed=seed)


def sustainable_rate(setup: RoutingSetup, model, hardware, num_decode: int, *,
                     policies: tuple[str, ...] | None = None, margin: float = 0.65,
                     num_prefill: int = 4, warmup_s: float = 10.0, duration_s: float = 30.0,
                     rounds: int = 3, tau: float = 0.1, start: float | None = None) -> float:
    """The highest rate (req/s) at which no held-out request meets a copy of itself.

    Copies arrive ``R / qps`` seconds apart (:func:`recycled_arrivals`), so the rate is
    ``margin · R`` over the longest time a request spends from arrival to its last token
    under any of ``policies`` (a locality policy that packs requests keeps some longer
    than a balancer does), measured at the rate found so far, starting from batch-1 step
    times (or from ``start``, e.g. another split's rate), for ``rounds`` rounds or until
    it moves by less than 5 %. ``policies``: None: :func:`reference` (JSQ)."""
    from eldr.sim.steptime import StepModel

    policies = (reference(),) if policies is None else policies
    ev = setup.eval
    R = ev.num_requests
    probe = _config(model, hardware, num_decode, 1.0, setup.seed, warmup_s=warmup_s,
                    duration_s=duration_s, num_prefill=num_prefill)
    sm = StepModel(probe)
    m = ev.meta
    one = sm.decode_step_time(m.num_layers * m.top_k, int(ev.prompt_lens.max()))
    qps = margin * R / float(ev.output_lens.max() * one) if start is None else float(start)
    for _ in range(rounds):
        cfg = replace(probe, qps=qps)
        arrivals = recycled_arrivals(R, qps, cfg.horizon_s, setup.seed)
        stay = 0.0
        for name in policies:
            pol = setup.policy(name, num_decode, tau=tau, seed=setup.seed,
                               **routing_resources(cfg))
            res = simulate(ev, cfg, pol, tokens=setup.tokens, arrivals=arrivals,
                           **setup.inputs(pol))
            req = res.requests
            stay = max(stay, float(np.nanmax(req["t_last"] - req["t_arrival"])))
        new = margin * R / stay
        if abs(new - qps) <= 0.05 * qps:
            return float(new)
        qps = new
    return float(qps)


# -- the comparison ---------------------------------------------------------------------------
@dataclass
class Comparison:
    """Every policy of :func:`compare` on every seed, and its paired differences.

    ``rows``: one per (seed, policy): the simulator's summary plus ``seed``, ``input``
    (key of :data:`INPUT_LABELS`), ``copies_in_flight``. ``deltas[policy]``: per metric
    (``p50``, ``p99``, ``distinct``) the :class:`~eldr.intervals.PairedInterval` of the %
    differences against the best balancer (lowest mean median TPOT over seeds), and
    ``vs_jsq`` the same against JSQ."""

    model: str
    hardware: str
    num_decode: int
    qps: float
    trace_input: str  # the locality policies' input (key of INPUT_LABELS)
    rows: list[dict]
    best_balancer: str
    deltas: dict = field(default_factory=dict)  # policy -> {"p50", "p99", "distinct"}
    vs_jsq: dict = field(default_factory=dict)  # policy -> {"p50", "p99", "distinct"}
    skipped: dict = field(default_factory=dict)  # policy -> why it did not run
    notes: list[str] = field(default_factory=list)
    rho: list[float] = field(default_factory=list)  # held-out ρ of the routing input, per seed
    # share of held-out requests the prediction gate let route on their prediction, per
    # seed (prompt input only; 1.0 for a prefill signature, nan without an input)
    admitted: list[float] = field(default_factory=list)
    heldout: int = 0  # held-out requests of a seed (the first)
    seconds: float = 0.0

    def mean(self, policy: str, column: str) -> float:
        vals = [r[column] for r in self.rows if r["policy"] == policy]
        return float(np.mean(vals)) if vals else float("nan")

    @property
    def seeds(self) -> int:
        return len({r["seed"] for r in self.rows})

    def as_dict(self) -> dict:
        def iv(d):
            return {p: {k: {"mean": v.mean, "half_width": v.half_width, "n": v.n}
                        for k, v in m.items()} for p, m in d.items()}
        return {"model": self.model, "hardware": self.hardware,
                "num_decode": self.num_decode, "qps": self.qps,
                "trace_input": self.trace_input, "best_balancer": self.best_balancer,
                "deltas": iv(self.deltas), "vs_jsq": iv(self.vs_jsq),
                "skipped": dict(self.skipped), "notes": list(self.notes),
                "rho": list(self.rho), "admitted": list(self.admitted),
                "heldout": self.heldout, "seeds": self.seeds,
                "rows": self.rows, "seconds": self.seconds}


_METRICS = {"p50": "tpot_median_ms", "p99": "tpot_p99_ms",
            "distinct": "mean_distinct_per_layer"}


def _paired(rows: list[dict], policy: str, base: str) -> dict:
    by = {(r["seed"], r["policy"]): r for r in rows}
    seeds = sorted({s for s, p in by if p == policy} & {s for s, p in by if p == base})
    out = {}
    for key, col in _METRICS.items():
        diffs = [100.0 * (by[s, policy][col] / by[s, base][col] - 1.0) for s in seeds
                 if np.isfinite(by[s, policy][col]) and by[s, base][col]]
        if diffs:
            out[key] = paired_interval(diffs)
    return out


def _runnable(policies: tuple[str, ...], kind: str) -> tuple[list[str], dict[str, str]]:
    """(policies that run on a trace whose locality input is ``kind``, {skipped: why})."""
    run, skipped = [], {}
    for p in policies:
        if POLICIES[p].role == "locality" and kind == "none":
            skipped[p] = ("no routing input: the trace is decode-only without prompt token "
                          "ids, so this policy would route by load alone (as JSQ)")
        else:
            run.append(p)
    return run, skipped


def _run_seed(setup: RoutingSetup, cfg: SimConfig, policies: list[str], kind: str,
              tau: float, times: np.ndarray | None = None) -> list[dict]:
    """One row per policy of ``policies`` on one seed's set-up, all on the same arrivals
    (``times``: a real trace's arrival times instead of Poisson ones)."""
    arrivals = recycled_arrivals(setup.eval.num_requests, cfg.qps, cfg.horizon_s, cfg.seed,
                                 times=times)
    rows = []
    for p in policies:
        pol = setup.policy(p, cfg.num_decode, tau=tau, seed=cfg.seed, **routing_resources(cfg))
        res = simulate(setup.eval, cfg, pol, tokens=setup.tokens, arrivals=arrivals,
                       **setup.inputs(pol))
        rows.append({**res.summary(), "seed": cfg.seed, "input": policy_input(p, kind),
                     "copies_in_flight": copies_in_flight(res),
                     "heldout_requests": setup.eval.num_requests})
    return rows


def _rate(setups: list, preset, hardware, num_decode: int, arrival_times, run: list[str],
          lbs: list[str], *, num_prefill: int, warmup_s: float, duration_s: float,
          tau: float, say) -> float:
    """The rate of :func:`compare`: the mean rate of ``arrival_times`` over the run, or
    the lowest of the splits' sustainable rates (:func:`sustainable_rate`)."""
    horizon = warmup_s + duration_s
    if arrival_times is not None:
        t = np.asarray(arrival_times, dtype=np.float64)
        n = int((t < horizon).sum())
        if n < 2:
            raise ValueError(f"the arrivals hold {n} request(s) in the first {horizon:g} s")
        return n / min(horizon, float(t[n - 1]) + 1e-9)
    probes = tuple(p for p in (reference(), band()) if p in run) or (lbs[0],)
    rates: list[float] = []
    for st in setups:  # each split from the last one's rate: one or two rounds
        rates.append(sustainable_rate(st, preset, hardware, num_decode, policies=probes,
                                      num_prefill=num_prefill, warmup_s=warmup_s,
                                      duration_s=duration_s, tau=tau,
                                      start=rates[-1] if rates else None))
    qps = min(rates)
    say(f"{preset.name}: {qps:.1f} req/s, the highest rate at which no request meets a "
        f"copy of itself ({setups[0].eval.num_requests} held-out requests)")
    return qps


def compare(trace: Trace, *, model: str | None = None, hardware: str = "h200",
            num_decode: int = 8, seeds: int = 3, qps: float | None = None,
            policies: tuple[str, ...] | None = None,
            warmup_s: float = 10.0, duration_s: float = 30.0, num_prefill: int = 4,
            calib_share: float = 0.5, tau: float = 0.1, base_seed: int = 0,
            setups: list | None = None, arrival_times: np.ndarray | None = None,
            allow_dealt: bool = False, log=None) -> Comparison:
    """Every policy of ``policies`` on ``trace``'s recorded routing, ``seeds`` seeds (seed
    ``base_seed + j``: its split, fit and arrivals), at ``qps`` (None: the rate the data
    sustains, :func:`sustainable_rate`, the lowest over the seeds' splits, for all).

    ``model``: the preset of the step-time model, a name or a
    :class:`~eldr.traces.models.ModelPreset` (default: the one ``trace.meta.model``
    names); ``setups``: already fitted set-ups, one per seed (:func:`fit_recorded`);
    ``arrival_times``: replay these arrival times (a real trace's, seconds from 0) instead
    of Poisson arrivals, ``qps`` then their mean rate over the run; ``allow_dealt``: see
    :func:`fit_recorded`; ``policies``: None: :func:`balancers`, :func:`locality` and
    :func:`oracles`."""
    t0 = time.perf_counter()
    if policies is None:
        policies = (*balancers(), *locality(), *oracles())
    preset = get_preset(model if model is not None else trace.meta.model)
    if (preset.num_layers, preset.num_experts) != (trace.meta.num_layers,
                                                   trace.meta.num_experts):
        raise ValueError(f"trace is (L, E) = ({trace.meta.num_layers}, "
                         f"{trace.meta.num_experts}), model preset {preset.name} is "
                         f"({preset.num_layers}, {preset.num_experts})")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}")
    kind = routing_input(trace)
    run, skipped = _runnable(policies, kind)
    lbs = [p for p in run if POLICIES[p].role == "balancer"]
    if not lbs:
        raise ValueError("compare needs at least one balancer among the policies")
    say = log or (lambda _msg: None)
    rows: list[dict] = []
    if setups is None:
        ts = time.perf_counter()
        setups = [fit_recorded(trace, seed=base_seed + j, calib_share=calib_share,
                               allow_dealt=allow_dealt) for j in range(seeds)]
        say(f"{preset.name}: {seeds} split(s) fitted, routing input "
            f"{INPUT_LABELS[kind]} ({time.perf_counter() - ts:.1f} s)")
    if arrival_times is not None or qps is None:
        qps = _rate(setups, preset, hardware, num_decode, arrival_times, run, lbs,
                    num_prefill=num_prefill, warmup_s=warmup_s, duration_s=duration_s,
                    tau=tau, say=say)
    rhos = []
    for j in range(seeds):
        ts = time.perf_counter()
        cfg = _config(preset, hardware, num_decode, qps, base_seed + j,
                      warmup_s=warmup_s, duration_s=duration_s, num_prefill=num_prefill)
        rhos.append(heldout_rho(setups[j]))
        rows += _run_seed(setups[j], cfg, run, kind, tau, arrival_times)
        say(f"{preset.name} seed {cfg.seed}: {len(run)} policies at {qps:.1f} req/s "
            f"({time.perf_counter() - ts:.1f} s)")
    means = {p: float(np.mean([r["tpot_median_ms"] for r in rows if r["policy"] == p]))
             for p in lbs}
    best = min(means, key=means.get)
    out = Comparison(preset.name, str(getattr(hardware, "name", hardware)), num_decode,
                     float(qps), kind, rows, best,
                     skipped=skipped, rho=rhos, heldout=setups[0].eval.num_requests,
                     admitted=[_admitted(st) for st in setups])
    jsq = reference()
    for p in run:
        if p != best:
            out.deltas[p] = _paired(rows, p, best)
        if p != jsq and jsq in run:
            out.vs_jsq[p] = _paired(rows, p, jsq)
    overlaps = sum(r["copies_in_flight"] for r in rows)
    if overlaps:
        out.notes.append(f"{overlaps} arrivals (all runs together) met a copy of their "
                         "request still in flight: the load is above what the data sustains")
    out.seconds = time.perf_counter() - t0
    return out
