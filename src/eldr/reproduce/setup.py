"""The routing set-up of an experiment: traces, the fitted artifact, policy inputs.

For one workload: generate (or take) a trace, split it into a calibration part (the
offline fit sees only this) and a held-out evaluation part (the simulator replays only
this), and run the project's fit recipe (:mod:`eldr.fit.calibration`, the same as
``eldr fit``'s) on the calibration part: the encoder (IDF, greedy layer mask by ρ) and
the profile predictor once, then, per decode-pool size K, balanced (and vanilla)
spherical K-means centroids and the cluster profiles. The ``oracle_signature`` bound gets
centroids of the calibration requests' TRUE decode patterns, clustered the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eldr.fit.calibration import Calibration, FitSettings, calibrate
from eldr.fit.placement import greedy_placement
from eldr.routing import POLICIES, decode_patterns, make_policy, prefill_profile
from eldr.sim import TokenBank
from eldr.traces.trace import Trace

__all__ = ["PrefillProfiles", "RoutingSetup", "fit_setup", "fit_split"]


@dataclass(eq=False)
class RoutingSetup:
    """Everything the sweeps need for one workload. Centroids are cached per (K, kind)."""

    workload: str  # workload name
    calib: Trace  # calibration split (fit only)
    eval: Trace  # held-out split (simulated)
    calibration: Calibration  # the fit recipe run on ``calib``: encoder, predictor
    signatures: np.ndarray  # (R_eval, d) float32 unit rows of the eval requests
    domain_shares: np.ndarray | None  # (D,) calibration share of each domain
    tokens: TokenBank  # per-request decode bitsets of the eval split, shared by runs
    seed: int  # seed of the K-means fits
    # a real trace's replayed arrivals: (R_eval,) float64 seconds in file time of eval
    # request i, and the whole file's mean rate (req/s) that scaling to a rate divides by
    arrival_times: np.ndarray | None = None
    arrival_rate: float | None = None
    _decoder_profiles: dict = field(default_factory=dict)  # K -> (K, L, E) float32
    _centroids: dict = field(default_factory=dict)  # (K, kind) -> (K, d) float32
    _labels: dict = field(default_factory=dict)  # (K, kind) -> calibration labels
    _placements: dict = field(default_factory=dict)  # (K, ep, layout) -> placement
    _patterns: np.ndarray | None = None  # see ``patterns``

    @property
    def encoder(self):
        """The fitted :class:`~eldr.fit.signature.SignatureEncoder`."""
        return self.calibration.encoder

    @property
    def predictor(self):
        """The fitted :class:`~eldr.fit.predictor.ProfilePredictor` (eldr_cost), or None."""
        return self.calibration.predictor

    @property
    def fit_seconds(self) -> float:
        """Wall time of the encoder fit."""
        return self.calibration.encoder_seconds

    @property
    def patterns(self) -> np.ndarray:
        """(R_eval, L*E) float32 unit decode patterns of the eval requests (the oracle's
        input), computed on first use: 0.3 GB at 11k requests of 48 x 128."""
        if self._patterns is None:
            self._patterns = decode_patterns(self.eval.decode_counts)
        return self._patterns

    def centroids(self, K: int, kind: str = "balanced") -> np.ndarray:
        """(K, d) centroids. kind: ``balanced``, ``vanilla`` or ``oracle`` (decode patterns,
        balanced)."""
        key = (K, kind)
        if key not in self._centroids:
            rows = decode_patterns(self.calib.decode_counts) if kind == "oracle" else None
            km = self.calibration.clusters(K, balanced=kind != "vanilla", rows=rows)
            self._centroids[key] = np.asarray(km.cluster_centers_, dtype=np.float32)
            self._labels[key] = np.asarray(km.labels_, dtype=np.int64)
        return self._centroids[key]

    def cluster_sizes(self, K: int, kind: str = "balanced") -> np.ndarray:
        self.centroids(K, kind)
        return np.bincount(self._labels[(K, kind)], minlength=K)

    def placement(self, K: int, ep: int, layout: str) -> np.ndarray:
        """EP layout from calibration decode activation: ``global`` (L, E) balances the
        whole calibration set; ``per_decoder`` (K, L, E) balances each decoder's cluster
        (balanced K-means labels), docs/method.md#per-decoder-expert-placement."""
        key = (K, ep, layout)
        if key not in self._placements:
            dc = self.calib.decode_counts.astype(np.float64)
            if layout == "global":
                self._placements[key] = greedy_placement(dc.sum(axis=0), ep)
            elif layout == "per_decoder":
                self.centroids(K, "balanced")
                labels = self._labels[(K, "balanced")]
                self._placements[key] = np.stack(
                    [greedy_placement(dc[labels == k].sum(axis=0), ep) for k in range(K)])
            else:
                raise ValueError(f"unknown EP layout {layout!r}")
        return self._placements[key]

    def profile(self, r: int) -> np.ndarray:
        """(L, E) float32 predicted per-token expert profile of eval request ``r`` (the
        predictor fitted on the calibration split; the raw prefill profile without one)."""
        return PrefillProfiles(self.eval, self.predictor)(r)

    def prime(self, name: str, K: int, kind: str = "balanced") -> None:
        """Fit what policy ``name`` needs for K decoders now (before forking workers)."""
        needs = POLICIES[name].needs
        if "centroids" in needs:
            self.centroids(K, kind)
        if "decode_centroids" in needs:
            self.centroids(K, "oracle")
        if "decoder_profiles" in POLICIES[name].options and kind == "balanced":
            self.decoder_profiles(K)

    def decoder_profiles(self, K: int) -> np.ndarray:
        """(K, L, E) float32 mean log(1 − p) of each balanced cluster's calibration requests
        (p from the fitted predictor): the cost policy's picture of each decoder's usual
        requests, as :func:`eldr.fit.artifact.fit_artifact` stores it."""
        if K not in self._decoder_profiles:
            self.centroids(K, "balanced")
            self._decoder_profiles[K] = self.calibration.cluster_profiles(
                self._labels[(K, "balanced")], K)
        return self._decoder_profiles[K]

    def arrivals(self, qps: float, horizon_s: float) -> tuple[np.ndarray, np.ndarray] | None:
        """A real trace's (times, eval index) at ``qps``: the file's times scaled by one
        factor (order and every gap ratio kept), those before ``horizon_s``; None for a
        Poisson workload."""
        if self.arrival_times is None:
            return None
        times = self.arrival_times * (self.arrival_rate / float(qps))
        n = int(np.searchsorted(times, horizon_s, side="left"))
        return times[:n].copy(), np.arange(n, dtype=np.int64)

    def policy(self, name: str, K: int, *, tau: float = 0.1, seed: int = 0,
               kind: str = "balanced", context_weight: float | None = None,
               capacity: float | None = None):
        """A fresh policy instance (policies keep state: round-robin pointer, RNG, the cost
        policy's footprints); it takes from this set-up what its registry entry declares.
        ``kind="online"`` gives eldr_cost no fitted cluster profiles (its calibration-free
        form, learning each decoder's usual requests online)."""
        needs = POLICIES[name].needs | POLICIES[name].options
        m = self.eval.meta
        return make_policy(
            name, num_workers=K, tau=tau, random_state=seed,
            centroids=self.centroids(K, kind) if "centroids" in needs else None,
            decode_centroids=self.centroids(K, "oracle") if "decode_centroids" in needs
            else None,
            domain_shares=self.domain_shares, num_layers=m.num_layers,
            num_experts=m.num_experts, context_weight=context_weight, capacity=capacity,
            decoder_profiles=self.decoder_profiles(K)
            if "decoder_profiles" in needs and kind == "balanced" else None)

    def inputs(self, policy, *, patterns: bool = True) -> dict:
        """Keyword inputs of :func:`eldr.sim.simulate` for the request fields ``policy``
        reads (its declared ``inputs``); ``patterns=False`` leaves out the oracle's
        decode patterns (large; a sweep computes them where it runs)."""
        out: dict = {}
        if "signature" in policy.inputs:
            out["signatures"] = self.signatures
        if "decode_pattern" in policy.inputs and patterns:
            out["decode_patterns"] = self.patterns
        if "profile" in policy.inputs:
            out["profiles"] = PrefillProfiles(self.eval, self.predictor)
        return out


class PrefillProfiles:
    """``profiles(r)``: the (L, E) float32 predicted per-token expert profile of trace
    request ``r`` from its prefill counts. A small picklable callable (a bound method of
    the set-up would carry the whole set-up to worker processes). With a fitted
    :class:`eldr.fit.predictor.ProfilePredictor` (a scalar and one (L, E) array) the
    profile is its shrinkage; without, the raw ``counts / prompt_len``."""

    def __init__(self, trace: Trace, predictor=None) -> None:
        self.trace = trace
        self.predictor = predictor

    def __call__(self, r: int) -> np.ndarray:
        t = self.trace
        if self.predictor is not None:
            return self.predictor.predict(t.prefill_counts[r], int(t.prompt_lens[r]))
        return prefill_profile(t.prefill_counts[r], int(t.prompt_lens[r]), t.meta.top_k)


def fit_setup(trace: Trace, workload: str, *, calib_requests: int, seed: int = 0,
              selection_max_pairs: int | None = 100_000, max_pairs: int | None = 200_000,
              representation: str = "count_idf") -> RoutingSetup:
    """Split ``trace`` (``calib_requests`` for calibration), fit the encoder, encode eval."""

    R = trace.num_requests
    if not 3 <= calib_requests < R:
        raise ValueError(f"calib_requests={calib_requests} must be in [3, {R})")
    calib, ev = trace.split(calib_requests / R, random_state=seed)
    return fit_split(calib, ev, workload, seed=seed, selection_max_pairs=selection_max_pairs,
                     max_pairs=max_pairs, representation=representation)


def fit_split(calib: Trace, ev: Trace, workload: str, *, seed: int = 0,
              selection_max_pairs: int | None = 100_000, max_pairs: int | None = 200_000,
              representation: str = "count_idf") -> RoutingSetup:
    """The set-up of an explicit (calibration, held-out) pair, e.g. a real trace's
    calibration draw and its replayed arrivals (:func:`eldr.traces.arrivals.
    calibration_and_replay`): the fit recipe (encoder, profile predictor; K-means and the
    cluster profiles later, per pool size) and the domain shares see ``calib`` only.
    K-means keeps its 4 restarts, as ``eldr fit`` does."""
    cal = calibrate(calib, FitSettings(representation=representation,
                                       selection_max_pairs=selection_max_pairs,
                                       max_pairs=max_pairs, random_state=seed))
    shares = None
    if calib.domains is not None:
        shares = np.bincount(calib.domains, minlength=len(calib.domain_names)).astype(float)
        shares = shares / shares.sum()
        if (shares == 0).any():  # a domain absent from calibration still needs a worker
            shares = (shares + 1e-6) / (shares + 1e-6).sum()
    return RoutingSetup(
        workload=workload, calib=calib, eval=ev, calibration=cal,
        signatures=_signatures(cal.encoder, ev),
        domain_shares=shares, tokens=TokenBank(ev, seed=seed), seed=seed,
    )


def _signatures(encoder, trace: Trace, chunk: int = 1024) -> np.ndarray:
    """``encoder.transform(trace)`` a chunk of requests at a time (same rows: the transform
    is per request). Whole, it makes float64 (R, L, E) temporaries: 2 GB at 13k
    requests, the peak of a full ``eldr reproduce``."""
    if encoder.representation.startswith("gate_"):
        return encoder.transform(trace)
    counts = trace.prefill_counts
    if counts.shape[0] <= chunk:
        return encoder.transform(trace)
    return np.concatenate([encoder.transform(counts[a:a + chunk])
                           for a in range(0, counts.shape[0], chunk)])
