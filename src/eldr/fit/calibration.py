"""The fit recipe: what a calibration trace gives routing (docs/fit-and-routing.md).

Every fit in the project runs these steps on the calibration requests, in this order:

1. the :class:`~eldr.fit.signature.SignatureEncoder`: IDF, then the layer mask by greedy
   ρ (unless the mask is given);
2. the :class:`~eldr.fit.predictor.ProfilePredictor`: α by held-out error against the
   true decode profiles, so it needs decode counts; without it α = 0 (the prefill
   profile);
3. per decode pool size K: spherical K-means on the calibration signatures, balanced
   (cluster sizes ≤ ⌈N/K⌉) or vanilla;
4. per cluster, the mean ``log(1 − p)`` of the predicted profiles p of its requests: the
   cost policy's picture of each decoder's usual requests.

:func:`calibrate` runs steps 1–2 once; the :class:`Calibration` it returns runs 3–4 for any
K, because ``eldr reproduce`` clusters one calibration for several pool sizes and kinds.
The callers differ only in :class:`FitSettings` and in the K they ask for:

- ``eldr fit`` and :func:`eldr.fit.artifact.fit_artifact`: the defaults (20,000
  selection pairs, ρ on all pairs, 4 K-means restarts), one K;
- ``eldr reproduce`` (:func:`eldr.reproduce.setup.fit_split`): the plan's pair budgets,
  K per pool size, balanced and vanilla;
- the learner (:func:`eldr.learn.refit.fit_candidate`): the defaults, or, with too few
  decode counts, every layer (no ρ to search by) and no predictor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from eldr.fit.cluster import BalancedKMeans
from eldr.fit.predictor import ProfilePredictor, decoder_profiles, prefill_profiles, shrink
from eldr.fit.signature import REPRESENTATIONS, SignatureEncoder
from eldr.traces.trace import Trace

__all__ = ["Calibration", "FitSettings", "calibrate"]


def _optional_pairs(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 2:
        raise ValueError(f"{name} must be None (all pairs) or an integer >= 2, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class FitSettings:
    """How a calibration is fitted; every field is a difference some caller needs."""

    representation: str = "count_idf"  # signature representation (REPRESENTATIONS)
    layers: tuple[int, ...] | None = None  # fixed layer mask; None: greedy search by ρ
    selection_max_pairs: int | None = 20_000  # pairs per candidate of the mask search
    max_pairs: int | None = None  # pairs behind the reported ρ (None: all, exact)
    n_init: int = 4  # K-means restarts, the lowest inertia kept
    profile_predictor: bool = True  # fit α on decode counts; False: α = 0 (prefill profile)
    random_state: int | None = 0  # seeds pair sampling, the predictor's split, K-means

    def __post_init__(self) -> None:
        if self.representation not in REPRESENTATIONS:
            raise ValueError(f"unknown representation {self.representation!r}; choose one "
                             f"of {', '.join(REPRESENTATIONS)}")
        if self.layers is not None:
            layers = tuple(self.layers)
            if not layers or not all(isinstance(x, (int, np.integer))
                                     and not isinstance(x, bool) for x in layers):
                raise ValueError(f"layers must be a non-empty list of layer indices, got "
                                 f"{self.layers!r}")
            object.__setattr__(self, "layers", tuple(int(x) for x in layers))
        object.__setattr__(self, "selection_max_pairs",
                           _optional_pairs("selection_max_pairs", self.selection_max_pairs))
        object.__setattr__(self, "max_pairs", _optional_pairs("max_pairs", self.max_pairs))
        if isinstance(self.n_init, bool) or not isinstance(self.n_init, (int, np.integer)) \
                or self.n_init < 1:
            raise ValueError(f"n_init must be a positive integer, got {self.n_init!r}")


@dataclass(frozen=True, eq=False)
class Calibration:
    """A calibration trace with the encoder and the profile predictor fitted on it.

    Made by :func:`calibrate`. Clusters and cluster profiles are fitted per call (nothing
    cached: ``eldr reproduce`` keeps what it uses), and the calibration signatures are
    recomputed per call rather than kept (|S|·E float32 per request, for the life of a
    reproduction's set-up).
    """

    trace: Trace  # the calibration requests everything here was fitted on
    settings: FitSettings  # how
    encoder: SignatureEncoder  # fitted: IDF (L, E), layer mask, ρ
    predictor: ProfilePredictor | None  # fitted shrinkage, or None: α = 0
    profile_mean: np.ndarray  # (L, E) float32 what p̂ shrinks toward (below)
    encoder_seconds: float  # wall time of the encoder fit
    predictor_seconds: float  # wall time of the predictor fit (0 without one)

    # ``profile_mean``: the predictor's mean decode profile; without a predictor the mean
    # prefill profile, which α = 0 never uses but an artifact stores all the same.

    @property
    def profile_alpha(self) -> float:
        """The shrinkage α of :func:`eldr.fit.predictor.shrink` (0 without a predictor)."""
        return 0.0 if self.predictor is None else float(self.predictor.alpha_)

    def signatures(self) -> np.ndarray:
        """(R, |S|·E) float32 unit signature rows of the calibration requests."""
        return self.encoder.transform(self.trace)

    def clusters(self, num_clusters: int, *, balanced: bool = True,
                 rows: np.ndarray | None = None) -> BalancedKMeans:
        """Spherical K-means with K = ``num_clusters`` on the calibration signatures, fitted
        (``labels_``, ``cluster_centers_`` ...). ``balanced=False``: vanilla K-means, the
        ablation. ``rows`` (R, d): other rows of the same requests clustered the same way
        (the oracle bound clusters their true decode patterns)."""
        X = self.signatures() if rows is None else rows
        return BalancedKMeans(num_clusters, balanced=balanced, n_init=self.settings.n_init,
                              random_state=self.settings.random_state).fit(X)

    def profiles(self) -> np.ndarray:
        """(R, L, E) float32 predicted per-token profiles p̂ of the calibration requests."""
        return shrink(prefill_profiles(self.trace), self.profile_alpha, self.profile_mean)

    def cluster_profiles(self, labels: np.ndarray, num_clusters: int) -> np.ndarray:
        """(K, L, E) float32 mean ``log(1 − p̂)`` of each cluster's calibration requests
        (``labels`` (R,) from :meth:`clusters`; :func:`eldr.fit.predictor.decoder_profiles`)."""
        return decoder_profiles(self.profiles(), labels, num_clusters)

    def predictor_summary(self) -> dict:
        """JSON-able statistics of the profile predictor, for an artifact's ``fit``."""
        if self.predictor is None:
            return {"alpha": 0.0, "note": "no decode counts: prefill profile"}
        return self.predictor.summary()


def calibrate(trace: Trace, settings: FitSettings | None = None, *,
              on_stage: Callable[[str], None] | None = None) -> Calibration:
    """Steps 1–2 of the recipe (module docstring) on ``trace``: the encoder, then the
    profile predictor. ``on_stage(name)`` is called as each starts, for progress."""
    s = FitSettings() if settings is None else settings
    if not isinstance(trace, Trace):
        raise ValueError(f"calibrate expects an eldr Trace, got {type(trace).__name__}")
    if on_stage:
        on_stage("signature encoder (IDF, layer mask by rho)")
    t0 = time.perf_counter()
    layers: Sequence[int] | None = None if s.layers is None else list(s.layers)
    encoder = SignatureEncoder(representation=s.representation, layers=layers,
                               max_pairs=s.max_pairs,
                               selection_max_pairs=s.selection_max_pairs,
                               random_state=s.random_state).fit(trace)
    t1 = time.perf_counter()
    predictor = None
    if s.profile_predictor:
        if on_stage:
            on_stage("profile predictor (cost policy)")
        predictor = ProfilePredictor(random_state=s.random_state).fit(trace)
        mean = predictor.mean_
    else:
        mean = prefill_profiles(trace).mean(axis=0).astype(np.float32)
    t2 = time.perf_counter()
    return Calibration(trace=trace, settings=s, encoder=encoder, predictor=predictor,
                       profile_mean=mean, encoder_seconds=t1 - t0, predictor_seconds=t2 - t1)
