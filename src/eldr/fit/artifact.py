"""The routing artifact: what the online router needs, fitted offline (docs/fit-and-routing.md).

An artifact is a directory with two files (format in ``docs/fit-and-routing.md``):

- ``artifact.json`` — format name and version, the model fingerprint (name, L, E, k),
  the signature settings (representation, layer mask, ρ and its greedy curve), the
  routing settings (τ, decode worker ids, balanced or vanilla K-means) and fit statistics;
- ``arrays.npz`` — ``idf`` (L, E) float64 and ``centroids`` (K, |S|·E) float32 unit rows
  (row k is the centroid of ``worker_ids[k]``), read with ``allow_pickle=False``; since
  version 2 also the cost policy's parts: ``profile_mean`` (L, E) float32, the mean
  per-token decode profile the profile predictor shrinks toward (by ``cost.alpha`` in the
  JSON), and ``decoder_profiles`` (K, L, E) float32, each cluster's mean ``log(1 − p)``
  (:func:`eldr.fit.predictor.decoder_profiles`). Version 1 artifacts (no cost parts) load;
- ``prompt.npz`` (optional, with a ``prompt_predictor`` section in the JSON): the prompt
  predictor (:mod:`eldr.fit.prompt`), ``idf`` (2**bits,) and ``mean`` (L·E,) float32,
  ``weights`` (2**bits, rank) and ``basis`` (rank, L·E) float16, the table over the power
  of two ``weights_scale`` in the JSON section (an older eldr wrote them float32, without
  ``weights_scale``: they load, rounded to float16). A separate file, so an artifact
  without it is exactly a version 2 artifact, and an older eldr reads one with it
  (ignoring the predictor): no version bump.

:func:`save` writes a temporary directory next to the target and renames it into place,
so a reader never sees half an artifact. :func:`load` validates everything it reads and
refuses, with a message naming the problem, a wrong version, bad shapes, non-finite
values, centroids that are not unit rows, a model fingerprint other than the expected one
and (via :meth:`RoutingArtifact.check_workers`) a decode worker set other than the
artifact's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eldr.fileio import atomic_directory, open_regular
from eldr.fit._artifact_io import (
    ARRAYS_FILE,
    JSON_FILE,
    MAX_ARRAYS_BYTES,
    MAX_JSON_BYTES,
    MAX_PROMPT_BYTES,
    PROMPT_FILE,
    artifact_fields,
    check_tau,
    check_worker_ids,
    read_arrays,
)
from eldr.fit.calibration import Calibration, FitSettings, calibrate
from eldr.fit.cluster import BalancedKMeans
from eldr.fit.predictor import shrink
from eldr.fit.prompt import (
    PromptPredictor,
    config_vocab_size,
    tokenizer_fingerprint,
    tokenizer_vocab_size,
)
from eldr.fit.prompt_decode import MIN_ROUTING_R2
from eldr.fit.signature import SignatureEncoder
from eldr.traces.trace import Trace, TraceMeta

__all__ = ["ARTIFACT_VERSION", "MAX_ARRAYS_BYTES", "MAX_JSON_BYTES", "RoutingArtifact",
           "fit_artifact", "fit_report", "load", "save"]

ARTIFACT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
FORMAT_NAME = "eldr-routing-artifact"


@dataclass(frozen=True, eq=False)
class RoutingArtifact:
    """A fitted router: signature encoder, one centroid per decode worker, τ."""

    model: str  # model name from the calibration trace
    num_layers: int  # L, MoE layers of the model
    num_experts: int  # E, routed experts per layer
    top_k: int  # k, experts per token
    encoder: SignatureEncoder  # fitted: representation, layer mask, IDF (L, E)
    centroids: np.ndarray  # (K, |S|·E) float32 unit rows; row k belongs to worker_ids[k]
    worker_ids: tuple[str, ...]  # K decode worker ids, in centroid order
    tau: float  # locality band width of the eldr policy
    balanced: bool = True  # balanced K-means (False: vanilla, the ablation)
    fit_stats: dict = field(default_factory=dict)  # JSON-able statistics of the fit
    profile_alpha: float | None = None  # predictor shrinkage α (cost policy), or None
    profile_mean: np.ndarray | None = None  # (L, E) float32 mean decode profile, or None
    decoder_profiles: np.ndarray | None = None  # (K, L, E) float32 cluster log(1 − p)
    prompt_predictor: PromptPredictor | None = None  # prompt ids → prefill profile, or None

    def predict_profile(self, counts: np.ndarray, prompt_len: int) -> np.ndarray:
        """(L, E) float32 per-token profile of prefill ``counts`` (L, E) for the cost
        policy: the fitted shrinkage, or ``counts / prompt_len`` without one."""
        c = np.asarray(counts, dtype=np.float32)
        return shrink(c / np.float32(max(int(prompt_len), 1)), self.profile_alpha or 0.0,
                      self.profile_mean)

    def route_inputs_from_prompt(self, token_ids, *, tokenizer_fingerprint: str | None = None
                                 ) -> tuple[np.ndarray, np.ndarray]:
        """Routing inputs of a request whose prefill signature is not (yet) known, from its
        prompt token ids alone: ``(signature (d,) float32 unit row, profile (L, E)
        float32)``, what ``RouteRequest.signature`` / ``RouteRequest.profile`` take.

        The prompt predictor's expected prefill profile stands in for
        ``counts / prompt_len``: the signature is the encoder applied to it (exact analogue
        of the real signature for ``count``, ``count_idf`` and ``sqrt_count``, which are
        scale-free after normalisation; ``binary`` sees every expert with a non-zero
        prediction), the profile is :meth:`predict_profile`'s shrinkage of it.
        ``tokenizer_fingerprint`` (optional): the caller's tokenizer, refused if it is
        not the predictor's. ValueError when the artifact has no predictor, or the prompt
        is empty or holds unknown ids.
        """
        pred = self.prompt_predictor
        if pred is None:
            raise ValueError("this routing artifact has no prompt predictor (fit it from a "
                             "trace with prompt_token_ids)")
        pred.check_tokenizer(tokenizer_fingerprint)
        pre = pred.predict(token_ids)
        signature = self.encoder.transform_one(pre)  # = transform(pre), bit for bit
        return signature, shrink(pre, self.profile_alpha or 0.0, self.profile_mean)

    @property
    def num_workers(self) -> int:
        return len(self.worker_ids)

    @property
    def layers(self) -> np.ndarray:
        """(|S|,) int64 layer mask of the signature."""
        return self.encoder.layers_

    @property
    def rho(self) -> float:
        return float(self.encoder.rho_)

    def fingerprint(self) -> str:
        return f"L={self.num_layers} E={self.num_experts} k={self.top_k}"

    def check_model(self, meta: TraceMeta | Trace, *, what: str = "trace") -> None:
        """Refuse a model whose (L, E, k) differ from the artifact's."""
        if isinstance(meta, Trace):
            meta = meta.meta
        theirs = (meta.num_layers, meta.num_experts, meta.top_k)
        if theirs != (self.num_layers, self.num_experts, self.top_k):
            raise ValueError(
                f"artifact is for {self.fingerprint()} ({self.model}), {what} has "
                f"L={theirs[0]} E={theirs[1]} k={theirs[2]} ({meta.model})"
            )

    def check_workers(self, worker_ids: Sequence[str]) -> np.ndarray:
        """Refuse a decode worker set other than the artifact's; else return the order.

        Returns ``order`` (K,) int64 with ``centroids[order][i]`` the centroid of
        ``worker_ids[i]``: the caller may list the same workers in any order.
        """
        ids = [str(w) for w in worker_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"decode worker ids are not unique: {ids}")
        missing = sorted(set(self.worker_ids) - set(ids))
        extra = sorted(set(ids) - set(self.worker_ids))
        if missing or extra:
            raise ValueError(
                f"decode workers do not match the artifact's {list(self.worker_ids)}: "
                f"missing {missing}, unknown {extra}"
            )
        return np.array([self.worker_ids.index(w) for w in ids], dtype=np.int64)


# -- fitting --------------------------------------------------------------------------------
def fit_artifact(
    trace: Trace,
    *,
    worker_ids: Sequence[str],
    tau: float = 0.1,
    representation: str = "count_idf",
    layers: Sequence[int] | None = None,
    balanced: bool = True,
    n_init: int = 4,
    selection_max_pairs: int | None = 20_000,
    max_pairs: int | None = None,
    profile_predictor: bool = True,
    prompt_predictor: bool | None = None,
    tokenizer: str | os.PathLike | bytes | None = None,
    prompt_options: dict | None = None,
    random_state: int | None = 0,
    on_stage=None,
    model_config: str | os.PathLike | dict | None = None,
) -> RoutingArtifact:
    """The routing artifact of ``trace``: the fit recipe (:mod:`eldr.fit.calibration`:
    encoder, profile predictor, K-means with K = len(worker_ids), cluster profiles).

    ``selection_max_pairs``: request pairs ranked per candidate layer in the greedy mask
    search (``None``: all). The search ranks ~|S|·L candidate masks, so this sets most of
    the fit time; 20,000 pairs (the encoder's own default is 100,000) keeps a 1,000-request
    48-layer fit within the paper's 10 s budget, and every candidate is ranked on the
    same pairs, so the comparisons between layers are paired. The reported ρ uses
    ``max_pairs`` pairs (``None``: all). ``profile_predictor=False`` (a trace without
    decode counts): α = 0, the prefill profile. ``prompt_predictor``: fit the prompt
    predictor (:mod:`eldr.fit.prompt`) too; ``None`` (default): when the trace has
    ``prompt_token_ids``, at least 6 non-empty prompts and is not synthetic (a synthetic
    trace draws its token ids uniformly: there is nothing to learn, and the fit would only
    cost time); ``True``: always (an error without prompt ids); ``False``: never. ``tokenizer`` (a
    ``tokenizer.json``, a model folder or its bytes) gives it its fingerprint and
    vocabulary size; without one, ``model_config`` (the model's ``config.json``, its
    folder or the parsed document) gives its vocabulary size, and without either the
    predictor hashes any id (:mod:`eldr.fit.prompt`); ``prompt_options``: keyword settings of
    :class:`~eldr.fit.prompt.PromptPredictor` (bits, ranks, alphas, weightings, folds,
    max_bytes). ``on_stage(name)`` (optional) is called when a stage starts, for progress.
    """
    ids, tau = _checked_workers_and_tau(trace, worker_ids, tau)
    settings = FitSettings(representation=representation,
                           layers=None if layers is None else tuple(layers),
                           selection_max_pairs=selection_max_pairs, max_pairs=max_pairs,
                           n_init=n_init, profile_predictor=profile_predictor,
                           random_state=random_state)
    cal, km, cluster_profiles, times = _calibrate_and_cluster(trace, settings, len(ids),
                                                              balanced, on_stage)
    prompt = _fit_prompt_predictor(trace, prompt_predictor, (tokenizer, model_config),
                                   prompt_options, random_state, on_stage)
    m = trace.meta
    stats = _fit_stats(cal, km, times)
    stats["prompt_predictor"] = None if prompt is None else prompt.summary()
    if prompt is not None and prompt_predictor is None and not (
            prompt.cv_r2_ >= MIN_ROUTING_R2):
        # the gate: a prediction that explains less than this of the profiles on held-out
        # folds of its own fit data is not shipped, so the router balances load before
        # prefill instead of routing on noise (docs/real-models.md)
        stats["prompt_predictor"] = {"refused": f"cross-validated R^2 {prompt.cv_r2_:.3f} < "
                                     f"{MIN_ROUTING_R2}", **prompt.summary()}
        prompt = None
    return RoutingArtifact(
        model=m.model, num_layers=m.num_layers, num_experts=m.num_experts, top_k=m.top_k,
        encoder=cal.encoder, centroids=np.asarray(km.cluster_centers_, dtype=np.float32),
        worker_ids=ids, tau=tau, balanced=balanced,
        fit_stats=stats, profile_alpha=cal.profile_alpha,
        profile_mean=cal.profile_mean, decoder_profiles=cluster_profiles,
        prompt_predictor=prompt,
    )


def fit_report(art: RoutingArtifact, trace: Trace, *,
               prompt_predictor: bool | None = None) -> list[str]:
    """The lines ``eldr fit`` prints about a fitted artifact: ρ and the layer mask, the
    K-means' clusters, the fit times and τ, then the prompt predictor (its choice, or why
    there is none). ``trace``: the calibration trace; ``prompt_predictor``: what
    :func:`fit_artifact` was asked (``False``: not fitted on purpose, nothing said)."""
    stats = art.fit_stats
    sizes = np.asarray(stats["cluster_sizes"])
    layers = ",".join(str(x) for x in art.layers.tolist())
    lines = [
        f"rho = {art.rho:.4f} ({art.encoder.representation}), N* = {art.layers.size} of "
        f"{art.num_layers} layers: {layers}",
        f"{'balanced' if art.balanced else 'vanilla'} K-means, K = {art.num_workers}: "
        f"cluster sizes {sizes.tolist()} (max/mean {sizes.max() / sizes.mean():.2f}, "
        f"cap {stats['capacity']}), inertia {stats['inertia']:.3f}, "
        f"{stats['n_iter']} iterations",
        f"fit time {stats['fit_seconds']:.2f}s (encoder {stats['encoder_seconds']:.2f}s, "
        f"K-means {stats['kmeans_seconds']:.2f}s); tau = {art.tau}"]
    pp, pstats = art.prompt_predictor, stats.get("prompt_predictor")
    if pp is not None:
        fp = pp.tokenizer_fingerprint[:12] or "unknown"
        lines.append(
            f"prompt predictor: 2**{pp.bits_} buckets ({pp.weighting_}), rank {pp.rank_}, "
            f"alpha {pp.alpha_:g}, cross-validated R^2 {pp.cv_r2_:.3f} on "
            f"{pp.num_requests_} prompts, {pp.nbytes / 2**20:.1f} MiB, tokenizer {fp}, "
            f"vocabulary {pp.vocab_size} ({pp.vocab_source}), fitted in "
            f"{pp.fit_seconds_:.1f}s")
    elif isinstance(pstats, dict) and "refused" in pstats:
        lines.append(f"prompt predictor: fitted but not kept ({pstats['refused']}): the "
                     "router balances load before prefill; --prompt-predictor keeps it")
    elif prompt_predictor is not False and trace.prompt_token_ids is None:
        lines.append("prompt predictor: not fitted (the trace has no prompt_token_ids)")
    elif prompt_predictor is not False:
        lines.append("prompt predictor: not fitted (synthetic trace or fewer than 6 "
                     "prompts; --prompt-predictor forces it)")
    return lines


def _checked_workers_and_tau(trace: Trace, worker_ids: Sequence[str], tau: float
                             ) -> tuple[tuple[str, ...], float]:
    """(the K decode worker ids as strings, τ) checked before any fitting starts: unique
    ids, a valid τ, and no more workers than calibration requests (each of the K
    clusters needs at least one request). ValueError otherwise, in that order."""
    ids = tuple(str(w) for w in worker_ids)
    check_worker_ids(ids)
    tau = check_tau(tau)
    if len(ids) > trace.num_requests:
        raise ValueError(f"{len(ids)} decode workers but only {trace.num_requests} "
                         "calibration requests")
    return ids, tau


def _calibrate_and_cluster(trace: Trace, settings: FitSettings, num_workers: int,
                           balanced: bool, on_stage
                           ) -> tuple[Calibration, BalancedKMeans, np.ndarray,
                                      tuple[float, float, float]]:
    """The timed core of the fit: ``(calibration, K-means, cluster profiles (K, L, E)
    float32, times)`` with K = ``num_workers``; ``times`` (the fit's start, the
    calibration's end, the clusters' end) is what :func:`_fit_stats` reports the K-means
    and total seconds from. The cluster profiles are the cost policy's decoder profiles."""
    t0 = time.perf_counter()
    cal = calibrate(trace, settings, on_stage=on_stage)
    t1 = time.perf_counter()
    if on_stage:
        on_stage(f"{'balanced' if balanced else 'vanilla'} K-means, K={num_workers}")
    km = cal.clusters(num_workers, balanced=balanced)
    if on_stage:
        on_stage("cluster profiles (cost policy)")
    cluster_profiles = cal.cluster_profiles(km.labels_, num_workers)
    t2 = time.perf_counter()
    return cal, km, cluster_profiles, (t0, t1, t2)


def _fit_prompt_predictor(trace: Trace, choice: bool | None, vocabulary: tuple,
                          options: dict | None, random_state: int | None, on_stage
                          ) -> PromptPredictor | None:
    """The prompt predictor of ``trace``, or None when ``choice`` (``fit_artifact``'s
    ``prompt_predictor``) says not to fit one. ``None`` decides from the trace: it needs
    ``prompt_token_ids``, at least 6 non-empty prompts and a non-synthetic source (a
    synthetic trace draws its ids uniformly: nothing to learn). ``vocabulary``:
    (``tokenizer``, ``model_config``) of :func:`fit_artifact`, either None: the tokenizer
    gives the predictor its fingerprint and vocabulary, else the config its vocabulary;
    ``options``: its keyword settings.
    Fitted outside :func:`_calibrate_and_cluster`'s timing: its own ``fit_seconds`` are
    in its summary (the artifact's ``fit.prompt_predictor``)."""
    want = choice
    if want is None:
        want = trace.prompt_token_ids is not None and int((trace.prompt_lens > 0).sum()) >= 6 \
            and not trace.meta.source.startswith("synthetic")
    if not want:
        return None
    if on_stage:
        on_stage("prompt predictor (hashed n-grams, ridge)")
    tokenizer, config = vocabulary
    fp, vocab, source = "", None, None
    if tokenizer is not None:
        fp, vocab = tokenizer_fingerprint(tokenizer), tokenizer_vocab_size(tokenizer)
        source = "tokenizer"
    elif config is not None:
        vocab, source = config_vocab_size(config), "config"
    return PromptPredictor(random_state=random_state, **(options or {})).fit(
        trace, vocab_size=vocab, tokenizer_fingerprint=fp, vocab_source=source)


def _fit_stats(cal: Calibration, km: BalancedKMeans, times: tuple[float, float, float]
               ) -> dict:
    """The artifact's JSON-able ``fit`` statistics; ``times``: the fit's start, the
    calibration's end (encoder and predictor), the clusters' end."""
    t0, t1, t2 = times
    s, trace = cal.settings, cal.trace
    sizes = np.bincount(km.labels_, minlength=km.n_clusters)
    return {
        "num_requests": trace.num_requests,
        "trace_source": trace.meta.source,
        "cluster_sizes": [int(x) for x in sizes],
        "capacity": int(km.capacity_),
        "inertia": float(km.inertia_),
        "n_iter": int(km.n_iter_),
        "n_init": int(s.n_init),
        "selection_max_pairs": s.selection_max_pairs,
        "random_state": s.random_state,
        "encoder_seconds": round(cal.encoder_seconds, 4),
        "predictor_seconds": round(cal.predictor_seconds, 4),
        "kmeans_seconds": round(t2 - t1, 4),
        "fit_seconds": round(t2 - t0, 4),
        "profile_predictor": cal.predictor_summary(),
    }


# -- save -----------------------------------------------------------------------------------
def _document(art: RoutingArtifact) -> dict:
    enc = art.encoder.state()
    return {
        "format": FORMAT_NAME,
        "version": ARTIFACT_VERSION,
        "model": {"name": art.model, "num_layers": art.num_layers,
                  "num_experts": art.num_experts, "top_k": art.top_k},
        "signature": {"representation": enc["representation"],
                      "layers": [int(x) for x in enc["layers"]],
                      "rho": enc["rho"], "rho_curve": enc["rho_curve"]},
        "routing": {"tau": art.tau, "worker_ids": list(art.worker_ids),
                    "balanced": bool(art.balanced)},
        "arrays": {"idf": list(enc["idf"].shape), "centroids": list(art.centroids.shape)},
        "cost": None if art.profile_alpha is None else {"alpha": float(art.profile_alpha)},
        "prompt_predictor": (None if art.prompt_predictor is None
                             else art.prompt_predictor.state()[0]),
        "fit": art.fit_stats,
    }


def save(artifact: RoutingArtifact, directory: str | os.PathLike) -> Path:
    """Write ``artifact`` to ``directory`` atomically (temporary directory, then rename).

    An existing artifact there is replaced; a directory holding anything else is refused
    rather than deleted.
    """
    target = Path(directory)
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"{target}: exists and is not a directory")
        foreign = sorted(p.name for p in target.iterdir()
                         if p.name not in (JSON_FILE, ARRAYS_FILE, PROMPT_FILE))
        if foreign:
            raise ValueError(f"{target}: not an artifact directory (holds {foreign[:3]}); "
                             "refusing to replace it")
    doc = _document(artifact)
    with atomic_directory(target) as tmp:
        (tmp / JSON_FILE).write_text(json.dumps(doc, indent=2) + "\n")
        arrays = {"idf": np.asarray(artifact.encoder.idf_, dtype=np.float64),
                  "centroids": np.asarray(artifact.centroids, dtype=np.float32)}
        if artifact.profile_alpha is not None:
            arrays["profile_mean"] = np.asarray(artifact.profile_mean, dtype=np.float32)
            arrays["decoder_profiles"] = np.asarray(artifact.decoder_profiles,
                                                    dtype=np.float32)
        with open(tmp / ARRAYS_FILE, "wb") as fh:
            np.savez(fh, **arrays)
        if artifact.prompt_predictor is not None:
            with open(tmp / PROMPT_FILE, "wb") as fh:
                np.savez(fh, **artifact.prompt_predictor.state()[1])
    return target


# -- load -----------------------------------------------------------------------------------
def load(directory: str | os.PathLike, *,
         expect_model: TraceMeta | Trace | None = None,
         expect_tokenizer: str | None = None) -> RoutingArtifact:
    """Read and validate an artifact written by :func:`save`. Never unpickles anything.

    ``expect_model`` (a trace or its meta): refuse the artifact unless (L, E, k) match.
    ``expect_tokenizer`` (a :func:`~eldr.fit.prompt.tokenizer_fingerprint`): refuse an
    artifact whose prompt predictor was fitted for another tokenizer.
    Defensive like the trace loader: regular files only (a FIFO is refused without
    blocking), sizes capped before reading, ``artifact.json`` validated before
    ``arrays.npz`` is opened, and each array's header must declare exactly the shape the
    document implies before its data is decompressed. Every failure is one ``ValueError``.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d}: no such artifact directory")
    try:
        with open_regular(d / JSON_FILE, max_bytes=MAX_JSON_BYTES, what=JSON_FILE) as fh:
            text = fh.read()
        doc = json.loads(text.decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{d}: not an artifact (no {JSON_FILE})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{d / JSON_FILE}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{d / JSON_FILE}: not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ValueError(f"{d / JSON_FILE}: not an eldr routing artifact")
    version = doc.get("version")
    if isinstance(version, bool) or version not in _READABLE_VERSIONS:
        raise ValueError(f"{d}: artifact format version {version!r} is not supported "
                         f"(this eldr reads versions {list(_READABLE_VERSIONS)})")
    try:
        art = RoutingArtifact(**artifact_fields(
            doc, lambda shapes: read_arrays(d / ARRAYS_FILE, shapes),
            lambda shapes: read_arrays(d / PROMPT_FILE, shapes, max_bytes=MAX_PROMPT_BYTES)))
    except ValueError as exc:
        raise ValueError(f"{d}: {exc}") from exc
    if expect_model is not None:
        art.check_model(expect_model)
    if expect_tokenizer is not None and art.prompt_predictor is not None:
        try:
            art.prompt_predictor.check_tokenizer(expect_tokenizer)
        except ValueError as exc:
            raise ValueError(f"{d}: {exc}") from None
    return art
