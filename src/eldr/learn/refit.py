"""Fit a candidate artifact from the learn buffer and validate it on held-out requests.

Runs in a separate process (:func:`run_fit_job`, the target of the learner's
``ProcessPoolExecutor``): the parent hands over the buffered records (immutable, pickled
by the executor off the event loop) and gets back a small :class:`FitOutcome`.

**Fit.** The project's one fit (:func:`eldr.fit.artifact.fit_artifact`, the recipe of
:mod:`eldr.fit.calibration`). With decode counts on at least half the requests it runs on
those: IDF, greedy layer mask by ρ, balanced K-means, the profile predictor. Without them
ρ is undefined, so it runs on every request with two of its settings changed: every layer
(no mask search) and no profile predictor, i.e. α = 0 (the calibration-free prefill
profile), with each cluster's prefill profile as its decoder profile.

**Score.** The validation score is what ELDR exists to lower: the expected distinct
experts per layer of one decode step of a ``batch_size``-request batch on a decoder,
averaged over decoders, when the held-out requests are assigned to decoders by the
artifact (balanced assignment on ``1 − cos`` to the centroids, as the router keeps
loads even), divided by the same for a random (load-balancing) assignment. Each request
contributes its per-token decode profile ``p`` (decode counts / decode tokens; without
decode counts the prefill profile stands in), and a batch of n requests drawn from a
decoder's set selects expert e with probability ``1 − exp(n · mean log(1 − p_e))``. So 1.0
is no better than load balancing and lower is better. Running without an artifact
scores 1.0.

**Verdict** (:func:`judge`). A candidate is refused when its held-out clusters are
unbalanced (largest argmax cluster over ``max_balance`` × the mean), when it does not beat
load balancing (score ≥ 1 − ``min_gain``), when it scores worse than the running artifact
on the same held-out requests beyond their noise (the 95 % paired interval of the
per-fold score differences, :func:`eldr.intervals.paired_interval`, lies wholly above
zero; otherwise the candidate, fitted on the newer traffic, wins), when its held-out ρ
(decode counts only) is ≤ 0 or more than ``rho_tolerance`` below the running artifact's.

**Prompt predictor.** An accepted candidate also gets a prompt predictor
(:mod:`eldr.fit.prompt`, the router's input before prefill) when at least
:data:`PROMPT_MIN_REQUESTS` of the records keep their prompt's hashed n-gram bag
(:mod:`eldr.learn.buffer`): fitted on those bags and their prefill profiles, its own
cross-validated R² in ``fit_stats["prompt_predictor"]``. It does not take part in the
verdict (the routing after prefill is what is judged); a predictor that cannot be fitted
leaves the candidate without one, said in the notes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import numpy as np

from eldr.fit import artifact as artifact_io
from eldr.fit.artifact import RoutingArtifact, fit_artifact
from eldr.fit.cluster import balanced_assign
from eldr.fit.predictor import decode_profiles, prefill_profiles
from eldr.fit.signature import rho
from eldr.intervals import PairedInterval, paired_interval
from eldr.learn.buffer import Record, records_to_trace
from eldr.learn.drift import DriftDetector
from eldr.traces.trace import Trace

__all__ = ["PROMPT_MIN_REQUESTS", "Evaluation", "FitJob", "FitOutcome", "evaluate",
           "fit_candidate", "fit_prompt_predictor", "judge", "run_fit_job"]


def fit_candidate(trace: Trace, decode_known: np.ndarray, *, worker_ids, tau: float = 0.1,
                  random_state: int | None = 0) -> RoutingArtifact:
    """A routing artifact from a learned trace: the project's one fit
    (:func:`eldr.fit.artifact.fit_artifact`), on the requests with decode counts when at
    least half have them, else on all with every layer and no predictor (module
    docstring). ``fit_stats["decode_counts"]`` says which."""
    known = np.asarray(decode_known, dtype=bool)
    K = len(worker_ids)
    if trace.num_requests < max(2 * K, 8):
        raise ValueError(f"{trace.num_requests} requests are too few to fit {K} decoders")
    with_decode = bool(known.sum() >= max(20, trace.num_requests // 2))
    if with_decode:
        art = fit_artifact(trace.subset(known), worker_ids=worker_ids, tau=tau,
                           random_state=random_state)
    else:  # no ρ without decode counts: keep every layer; α = 0, the prefill profile
        art = fit_artifact(trace, worker_ids=worker_ids, tau=tau,
                           layers=range(trace.meta.num_layers), profile_predictor=False,
                           random_state=random_state)
    art.fit_stats["decode_counts"] = with_decode
    return art


@dataclass(frozen=True)
class Evaluation:
    """An artifact on held-out requests."""

    score: float  # expected distinct experts vs a random assignment (1: no gain; lower better)
    distinct: float  # expected distinct experts per layer per step, assigned by the artifact
    baseline: float  # the same for a random (load-balancing) assignment
    balance: float  # largest argmax cluster / mean cluster size
    sizes: tuple[int, ...]  # held-out requests per decoder under argmax
    rho: float | None  # held-out ρ (None: too few decode counts)
    rho_n: int | None = None  # held-out requests with decode counts behind ρ (None: unknown)

    def to_json(self) -> dict:
        return {"score": self.score, "distinct": self.distinct, "baseline": self.baseline,
                "balance": self.balance, "sizes": list(self.sizes), "rho": self.rho,
                "rho_n": self.rho_n}


def _profiles(trace: Trace, known: np.ndarray) -> np.ndarray:
    """(R, L, E) per-token decode profiles; the prefill profile where decode is unknown."""
    p = prefill_profiles(trace)
    if known.any():
        p[known] = decode_profiles(trace)[known]
    return np.minimum(p, np.float32(1.0 - 1e-6))


def _expected_distinct(logs: np.ndarray, batch: int) -> float:
    """Mean over layers of Σ_e 1 − exp(batch · mean log(1 − p_e)) of a request set."""
    if logs.shape[0] == 0:
        return 0.0
    return float((1.0 - np.exp(batch * logs.mean(axis=0))).sum(axis=-1).mean())


def evaluate(artifact: RoutingArtifact | None, trace: Trace, decode_known: np.ndarray, *,
             batch_size: int = 16) -> Evaluation:
    """Score ``artifact`` on the held-out ``trace`` (module docstring); None scores 1."""
    known = np.asarray(decode_known, dtype=bool)
    logs = np.log1p(-_profiles(trace, known))
    base = _expected_distinct(logs, batch_size)
    if artifact is None:
        return Evaluation(1.0, base, base, 1.0, (trace.num_requests,), None)
    artifact.check_model(trace)
    X = artifact.encoder.transform(trace)
    sims = X @ np.asarray(artifact.centroids, dtype=np.float32).T
    K = sims.shape[1]
    labels = balanced_assign(1.0 - sims)
    sizes = np.bincount(labels, minlength=K)
    distinct = sum(sizes[k] * _expected_distinct(logs[labels == k], batch_size)
                   for k in range(K)) / max(int(sizes.sum()), 1)
    top = np.bincount(sims.argmax(axis=1), minlength=K)
    balance = float(top.max() / max(top.mean(), 1e-9))
    r = None
    if known.sum() >= 10:
        value = rho(X[known], trace.decode_counts[known])
        r = float(value) if np.isfinite(value) else None
    score = float(distinct / base) if base > 0 else 1.0
    return Evaluation(score, float(distinct), base, balance, tuple(int(s) for s in top), r,
                      int(known.sum()))


RHO_MIN_REQUESTS = 20  # held-out requests with decode counts for a ρ comparison


def judge(candidate: Evaluation, current: Evaluation | None, *, min_gain: float = 0.0,
          max_balance: float = 2.0, rho_tolerance: float = 0.05,
          worse: PairedInterval | None = None) -> list[str]:
    """Reasons to refuse ``candidate`` against the running artifact's ``current`` (None:
    no artifact, or one fitted for other decoders), each ``"code: message"`` (code:
    unbalanced, no_gain, worse, rho); an empty list accepts it.

    ``worse``: the paired interval of candidate − running scores over held-out folds
    (:func:`_validate`). The candidate is ``worse`` only when that interval lies wholly
    above zero: a difference within the folds' noise goes to the candidate, fitted on the
    newer traffic (a fixed tolerance refused refits on drift on noise: 0.8641 against
    0.8538 on 40 requests). Without an interval the two scores are compared as they are.
    The two ρ are compared only when each rests on at least :data:`RHO_MIN_REQUESTS`
    held-out requests: on 10 (a 40-request refit's hold-out) ρ moves by more than the
    tolerance from one draw to the next, and a refit on drift was refused on that noise."""
    reasons = []
    if candidate.balance > max_balance:
        reasons.append(f"unbalanced: largest held-out cluster {candidate.balance:.2f} x the "
                       f"mean (limit {max_balance})")
    if candidate.score >= 1.0 - min_gain:
        reasons.append(f"no_gain: no locality gain over load balancing (score "
                       f"{candidate.score:.4f})")
    if current is not None and (worse.low > 0 if worse is not None and worse.n >= 2
                                else candidate.score > current.score):
        beyond = "" if worse is None or worse.n < 2 else \
            f", difference {worse.mean:+.4f} ± {worse.half_width:.4f} over {worse.n} folds"
        reasons.append(f"worse: worse than the running artifact (score {candidate.score:.4f} > "
                       f"{current.score:.4f}{beyond})")
    if candidate.rho is not None:
        if candidate.rho <= 0:
            reasons.append(f"rho: held-out rho {candidate.rho:.3f} <= 0: the signature does not "
                           f"predict decode routing")
        elif current is not None and current.rho is not None and \
                min(candidate.rho_n or RHO_MIN_REQUESTS, current.rho_n or RHO_MIN_REQUESTS) \
                >= RHO_MIN_REQUESTS and candidate.rho < current.rho - rho_tolerance:
            reasons.append(f"rho: held-out rho {candidate.rho:.3f} below the running artifact's "
                           f"{current.rho:.3f}")
    return reasons


@dataclass(frozen=True)
class FitJob:
    """What the fit process needs (picklable: records are numpy arrays and scalars)."""

    records: list[Record]  # the requests to fit and validate on, oldest first
    model: str  # served model name
    top_k: int  # k of the model
    worker_ids: tuple[str, ...]  # decoders, in the router's order
    output: str  # directory to write an accepted candidate to
    current: str | None  # the running artifact's directory, or None
    holdout: float = 0.25  # fraction held out for validation
    batch_size: int = 16
    min_gain: float = 0.0
    max_balance: float = 2.0
    rho_tolerance: float = 0.05
    tau: float = 0.1
    seed: int = 0
    drift: dict | None = None  # DriftDetector keyword arguments; None: no drift calibration
    fit: bool = True  # False: only calibrate drift for the running artifact
    # the router's tokenizer (--tokenizer), for the prompt predictor: fingerprint, vocab size
    tokenizer_fingerprint: str = ""
    vocab_size: int | None = None  # None: 1 + the largest token id seen


@dataclass
class FitOutcome:
    """What came back from the fit process."""

    accepted: bool
    reasons: list[str]  # why it was refused (empty when accepted)
    candidate: dict | None  # Evaluation.to_json of the candidate
    current: dict | None  # Evaluation.to_json of the running artifact on the same requests
    artifact: str | None  # where the accepted candidate was written
    num_requests: int
    num_with_decode: int
    seconds: float
    pid: int  # the process that fitted (not the router's)
    detector: DriftDetector | None = None  # calibrated for the artifact now running
    notes: list[str] = field(default_factory=list)


def _calibrate(art: RoutingArtifact, trace: Trace, known: np.ndarray, kwargs: dict,
               notes: list[str]) -> DriftDetector | None:
    det = DriftDetector(**kwargs)
    if trace.num_requests < det.window + 10:
        notes.append(f"drift: {trace.num_requests} requests are too few to calibrate")
        return None
    X = art.encoder.transform(trace)
    return det.calibrate(X, trace.decode_counts if known.any() else None, known)


def _validate(trace: Trace, known: np.ndarray, job: FitJob, current, notes: list[str]):
    """(candidate, its evaluation, the running artifact's, the paired interval of their
    per-fold score differences or None without a running artifact) by k-fold
    cross-validation, k = round(1 / holdout): each fold is scored by a candidate fitted on
    the other folds and by the running artifact; the candidate kept is fitted on all.

    Every request is held out once, and each fold's pair of scores is one paired
    difference for :func:`judge`. The figures pool the folds (scores as ratios of summed
    distinct experts, sizes summed largest first, ρ the folds' mean, resting on the
    smallest fold's requests). Folds, not sub-samples of one hold-out: the score is the
    distinct experts of a decoder's set of requests, which shrinks with the set, so
    scoring smaller pieces of one hold-out would hide a real difference.
    """
    N = trace.num_requests
    perm = np.random.default_rng(job.seed).permutation(N)
    k = max(2, round(1.0 / job.holdout))
    fit_kw = {"worker_ids": job.worker_ids, "tau": job.tau, "random_state": job.seed}
    folds = [np.sort(f) for f in np.array_split(perm, k)]
    evs_c, evs_o = [], []
    for i, test_idx in enumerate(folds):
        train_idx = np.sort(np.concatenate([f for j, f in enumerate(folds) if j != i]))
        fold_cand = fit_candidate(trace.subset(train_idx), known[train_idx], **fit_kw)
        held = trace.subset(test_idx)
        evs_c.append(evaluate(fold_cand, held, known[test_idx], batch_size=job.batch_size))
        evs_o.append(evaluate(current, held, known[test_idx], batch_size=job.batch_size))
    notes.append(f"validated by {k}-fold cross-validation ({N} requests)")
    diffs = None if current is None else \
        paired_interval([c.score - o.score for c, o in zip(evs_c, evs_o, strict=True)])
    return (fit_candidate(trace, known, **fit_kw), _pooled(evs_c, [len(f) for f in folds]),
            _pooled(evs_o, [len(f) for f in folds]), diffs)


def _pooled(evs: list[Evaluation], sizes: list[int]) -> Evaluation:
    """One evaluation of the folds' evaluations (``sizes``: requests per fold)."""
    w = np.asarray(sizes, dtype=np.float64)
    distinct = float(np.dot(w, [e.distinct for e in evs]) / w.sum())
    base = float(np.dot(w, [e.baseline for e in evs]) / w.sum())
    # cluster labels differ between the folds' candidates: sizes are summed largest first
    # (balance = Σ largest / Σ mean over the folds)
    top = np.sum([sorted(e.sizes, reverse=True) for e in evs], axis=0)
    balance = float(top.max() / max(top.mean(), 1e-9))
    # ρ: the folds' mean; it rests on each fold's requests, not on all of them, so its
    # count is the smallest fold's (the ρ comparison needs each ρ on >= RHO_MIN_REQUESTS)
    with_rho = [e for e in evs if e.rho is not None]
    return Evaluation(distinct / base if base > 0 else 1.0, distinct, base, balance,
                      tuple(int(x) for x in top),
                      float(np.mean([e.rho for e in with_rho])) if with_rho else None,
                      min(e.rho_n or 0 for e in with_rho) if with_rho else None)


PROMPT_MIN_REQUESTS = 24  # records with a prompt bag needed to fit a prompt predictor


def fit_prompt_predictor(records: list[Record], notes: list[str], *,
                         vocab_size: int | None = None, tokenizer_fingerprint: str = ""):
    """A :class:`~eldr.fit.prompt.PromptPredictor` fitted on the records that keep a prompt
    bag, or None (too few, or the fit failed: said in ``notes``). ``vocab_size`` and
    ``tokenizer_fingerprint``: the router's tokenizer's, when it has one (ids outside its
    vocabulary are then refused, and the router routes those prompts by load, counted);
    without it the predictor records the largest id seen and hashes larger ones like any
    other (``vocab_source`` ``calibration``)."""
    rows = [r for r in records if r.prompt_hashes is not None and r.prompt_tokens > 0]
    if len(rows) < PROMPT_MIN_REQUESTS:
        if rows:
            notes.append(f"prompt predictor: {len(rows)} requests with a prompt, need "
                         f"{PROMPT_MIN_REQUESTS}")
        return None
    from eldr.fit.prompt import PromptPredictor

    counts = np.stack([r.prefill_counts for r in rows]).astype(np.float64)
    profiles = counts / np.array([r.prompt_tokens for r in rows], np.float64)[:, None, None]
    top_k = round(float(counts[0, 0].sum()) / rows[0].prompt_tokens)
    seen = 1 + max(int(r.max_token_id) for r in rows)
    if vocab_size is not None and seen > vocab_size:
        notes.append(f"prompt predictor not fitted: token id {seen - 1} is outside the "
                     f"router's tokenizer's vocabulary ({vocab_size})")
        return None
    try:
        return PromptPredictor().fit_hashes([r.prompt_hashes for r in rows], profiles,
                                            top_k=top_k, vocab_size=vocab_size or seen,
                                            tokenizer_fingerprint=tokenizer_fingerprint)
    except ValueError as exc:
        notes.append(f"prompt predictor not fitted: {exc}")
        return None


def run_fit_job(job: FitJob) -> FitOutcome:
    """Fit, validate and (if accepted) write a candidate; calibrate drift for whatever
    runs afterwards. Runs in the learner's worker process."""
    t0 = time.perf_counter()
    trace, known = records_to_trace(job.records, model=job.model, top_k=job.top_k)
    notes: list[str] = []
    current = None
    if job.current is not None:
        try:
            current = artifact_io.load(job.current, expect_model=trace)
        except ValueError as exc:
            notes.append(f"running artifact not comparable: {exc}")
    if not job.fit:
        det = (_calibrate(current, trace, known, job.drift, notes)
               if current is not None and job.drift is not None else None)
        return FitOutcome(False, [], None, None, None, trace.num_requests, int(known.sum()),
                          time.perf_counter() - t0, os.getpid(), det, notes)
    cand, ev_c, ev_o, diffs = _validate(trace, known, job, current, notes)
    same_set = current is not None and tuple(current.worker_ids) == tuple(job.worker_ids)
    if current is not None and not same_set:
        notes.append(f"the running artifact is for decoders {list(current.worker_ids)}, not "
                     f"{list(job.worker_ids)}: judged against load balancing only")
    reasons = judge(ev_c, ev_o if same_set else None, min_gain=job.min_gain,
                    max_balance=job.max_balance, rho_tolerance=job.rho_tolerance,
                    worse=diffs)
    path = None
    if not reasons:
        prompt = fit_prompt_predictor(job.records, notes, vocab_size=job.vocab_size,
                                      tokenizer_fingerprint=job.tokenizer_fingerprint)
        if prompt is not None:
            cand = replace(cand, prompt_predictor=prompt)
            cand.fit_stats["prompt_predictor"] = prompt.summary()
        cand.fit_stats["validation"] = {"candidate": ev_c.to_json(), "running": ev_o.to_json()}
        path = str(artifact_io.save(cand, job.output))
    running = cand if not reasons else current
    det = (_calibrate(running, trace, known, job.drift, notes)
           if running is not None and job.drift is not None else None)
    return FitOutcome(not reasons, reasons, ev_c.to_json(), ev_o.to_json(), path,
                      trace.num_requests, int(known.sum()), time.perf_counter() - t0,
                      os.getpid(), det, notes)
