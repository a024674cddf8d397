import dataclasses
import os

import numpy as np
import pytest

from _learn_data import K, mix, records
from eldr.fit import artifact as artifact_io
from eldr.intervals import paired_interval
from eldr.learn.buffer import records_to_trace
from eldr.learn.refit import Evaluation, FitJob, evaluate, fit_candidate, judge, run_fit_job

IDS = ("d0", "d1")


def _trace(seed, n, shares=(1, 1, 0, 0), with_decode=True):
    rng = np.random.default_rng(seed)
    return records_to_trace(records(rng, mix(rng, n, shares), with_decode=with_decode),
                            model="s", top_k=K)


@pytest.mark.parametrize("with_decode", [True, False])
def test_a_fitted_candidate_beats_load_balancing_on_held_out_requests(with_decode):
    trace, known = _trace(0, 200, with_decode=with_decode)
    held, held_known = _trace(1, 100, with_decode=with_decode)
    art = fit_candidate(trace, known, worker_ids=IDS)
    assert art.fit_stats["decode_counts"] is with_decode
    if not with_decode:  # rho undefined: no mask search, the prefill-only predictor
        assert art.layers.tolist() == list(range(trace.meta.num_layers))
        assert art.profile_alpha == 0.0
    ev = evaluate(art, held, held_known)
    assert ev.score < 0.9  # two domains on two decoders: far fewer distinct experts
    assert ev.balance <= 1.5
    assert (ev.rho is not None) is with_decode
    assert evaluate(None, held, held_known).score == 1.0


def test_judge_refuses_a_worse_candidate_with_reasons():
    good = Evaluation(0.7, 7.0, 10.0, 1.1, (50, 50), 0.5)
    worse = Evaluation(0.8, 8.0, 10.0, 1.1, (50, 50), 0.5)
    assert judge(good, None) == [] and judge(good, worse) == []
    assert [r.split(":")[0] for r in judge(worse, good)] == ["worse"]
    # with the folds' paired interval: worse only when it lies wholly above zero
    noisy = paired_interval([0.03, -0.01, 0.02, 0.0])  # mean +0.01, the interval spans 0
    sure = paired_interval([0.09, 0.11, 0.10, 0.10])
    assert noisy.low < 0 < noisy.high and sure.low > 0
    assert judge(worse, good, worse=noisy) == []  # within the noise: the newer fit wins
    reasons = judge(worse, good, worse=sure)
    assert [r.split(":")[0] for r in reasons] == ["worse"]
    assert "+0.1000 ± " in reasons[0] and "over 4 folds" in reasons[0]
    assert judge(good, worse, worse=paired_interval([-0.1, -0.09, -0.11])) == []
    one_fold = paired_interval([0.5])  # no interval from one fold: the scores as they are
    assert [r.split(":")[0] for r in judge(worse, good, worse=one_fold)] == ["worse"]
    lopsided = Evaluation(0.6, 6.0, 10.0, 2.5, (90, 10), 0.2)
    assert [r.split(":")[0] for r in judge(lopsided, good)] == ["unbalanced", "rho"]
    assert [r.split(":")[0] for r in judge(Evaluation(1.0, 10, 10, 1, (1,), None), None)] \
        == ["no_gain"]


def test_judge_compares_rho_only_on_enough_held_out_decode_counts():
    running = Evaluation(0.8, 8.0, 10.0, 1.1, (50, 50), 0.68, 40)
    few = Evaluation(0.7, 7.0, 10.0, 1.1, (5, 5), 0.61, 10)  # a 40-request drift refit
    many = Evaluation(0.7, 7.0, 10.0, 1.1, (20, 20), 0.61, 40)
    assert judge(few, running) == []  # 10 held-out requests: their rho is noise
    assert [r.split(":")[0] for r in judge(many, running)] == ["rho"]
    negative = Evaluation(0.7, 7.0, 10.0, 1.1, (5, 5), -0.1, 10)
    assert [r.split(":")[0] for r in judge(negative, running)] == ["rho"]  # always refused


def test_fit_job_refuses_a_worse_candidate_and_writes_nothing(tmp_path, monkeypatch):
    """A candidate with no locality (every centroid the same unit row: any assignment is as
    good as load balancing) against a running artifact fitted on the traffic: worse in
    every fold, so refused as worse; nothing written, the running one untouched. (Random
    unit rows are not enough: their balanced assignment still groups some domains, and
    four folds cannot tell that from the running artifact.)"""
    import dataclasses

    from eldr.learn import refit

    rng = np.random.default_rng(2)
    recs = records(rng, mix(rng, 240, (1, 1, 1, 1)))
    trace, known = records_to_trace(recs, model="s", top_k=K)
    running = fit_candidate(trace, known, worker_ids=IDS)
    artifact_io.save(running, tmp_path / "running")
    good = run_fit_job(FitJob(records=recs, model="s", top_k=K, worker_ids=IDS,
                              output=str(tmp_path / "cand"), current=None, drift=None))
    assert good.accepted and good.artifact == str(tmp_path / "cand")
    assert good.pid == os.getpid()  # called directly here; the learner runs it elsewhere
    real = refit.fit_candidate

    def scrambled(*args, **kwargs):
        art = real(*args, **kwargs)
        c = np.random.default_rng(0).standard_normal(art.centroids.shape[1])
        c = np.tile(c / np.linalg.norm(c), (art.centroids.shape[0], 1))
        return dataclasses.replace(art, centroids=c.astype(np.float32))

    monkeypatch.setattr(refit, "fit_candidate", scrambled)
    before = (tmp_path / "running" / "arrays.npz").read_bytes()
    bad = run_fit_job(FitJob(records=recs, model="s", top_k=K, worker_ids=IDS,
                             output=str(tmp_path / "bad"), current=str(tmp_path / "running"),
                             drift=None))
    assert not bad.accepted and bad.artifact is None
    assert "worse" in [r.split(":")[0] for r in bad.reasons]
    assert "over 4 folds" in next(r for r in bad.reasons if r.startswith("worse"))
    assert bad.candidate["score"] > bad.current["score"]
    assert not (tmp_path / "bad").exists()
    assert (tmp_path / "running" / "arrays.npz").read_bytes() == before


def test_a_refit_for_other_decoders_is_judged_against_load_balancing(tmp_path, monkeypatch):
    """After a decoder joined, the running artifact (fitted for two) is no yardstick for
    a candidate for three: a candidate that beats load balancing is accepted even where
    the old artifact scores better on the same held-out requests."""
    from eldr.learn import refit

    rng = np.random.default_rng(4)
    recs = records(rng, mix(rng, 240, (1, 1, 1, 1)))
    trace, known = records_to_trace(recs, model="s", top_k=K)
    running = fit_candidate(trace, known, worker_ids=IDS)
    artifact_io.save(running, tmp_path / "running")
    real = refit.evaluate

    def evaluate(artifact, *args, **kwargs):  # the running artifact scores near-perfectly
        ev = real(artifact, *args, **kwargs)
        if artifact is not None and np.array_equal(artifact.centroids, running.centroids):
            return dataclasses.replace(ev, score=0.01, distinct=0.01 * ev.baseline)
        return ev

    monkeypatch.setattr(refit, "evaluate", evaluate)
    three = (*IDS, "d-new")
    job = FitJob(records=recs, model="s", top_k=K, worker_ids=three,
                 output=str(tmp_path / "cand"), current=str(tmp_path / "running"), drift=None)
    out = run_fit_job(job)
    assert out.accepted, out.reasons
    assert out.current["score"] < out.candidate["score"] < 1.0
    assert any("judged against load balancing only" in n for n in out.notes)
    assert tuple(artifact_io.load(out.artifact).worker_ids) == three
    same = run_fit_job(dataclasses.replace(job, worker_ids=IDS, output=str(tmp_path / "c2")))
    assert not same.accepted and "worse" in [r.split(":")[0] for r in same.reasons]


def test_calibrate_only_job_returns_a_detector(tmp_path):
    rng = np.random.default_rng(3)
    recs = records(rng, mix(rng, 150, (1, 1, 1, 1)))
    trace, known = records_to_trace(recs, model="s", top_k=K)
    artifact_io.save(fit_candidate(trace, known, worker_ids=IDS), tmp_path / "a")
    out = run_fit_job(FitJob(records=recs, model="s", top_k=K, worker_ids=IDS,
                             output=str(tmp_path / "x"), current=str(tmp_path / "a"),
                             drift={"window": 50}, fit=False))
    assert out.detector is not None and out.detector.is_calibrated
    assert not out.accepted and not (tmp_path / "x").exists()


def test_a_small_refit_is_validated_by_cross_validation_and_kept_fitted_on_all(tmp_path):
    """40 requests (a drift refit at min_requests 40): k-fold cross-validation scores every
    request once, the candidate kept is fitted on all
    40, and the pooled figures are the folds' (a ratio of summed distinct experts)."""
    from eldr.learn import refit

    rng = np.random.default_rng(7)
    old = records(rng, mix(rng, 160, (1, 1, 0, 0)))
    new = records(rng, mix(rng, 40, (0, 0, 1, 1)))  # the traffic moved to two other domains
    trace, known = records_to_trace(old, model="s", top_k=K)
    artifact_io.save(fit_candidate(trace, known, worker_ids=IDS), tmp_path / "running")
    out = run_fit_job(FitJob(records=new, model="s", top_k=K, worker_ids=IDS,
                             output=str(tmp_path / "cand"), current=str(tmp_path / "running"),
                             drift=None))
    assert "validated by 4-fold cross-validation (40 requests)" in out.notes
    assert out.accepted, out.reasons
    # ρ is the folds' mean: it rests on 10 requests each, too few for a ρ comparison
    assert sum(out.candidate["sizes"]) == 40 and out.candidate["rho_n"] == 10
    assert out.candidate["score"] < min(1.0, out.current["score"] + 0.01)
    kept = artifact_io.load(out.artifact)
    assert kept.fit_stats["num_requests"] == 40  # fitted on every request, not 30
    # the pooled score is the ratio of the summed figures, not a mean of ratios
    a = Evaluation(0.5, 5.0, 10.0, 1.0, (3, 2), 0.4, 5)
    b = Evaluation(0.9, 18.0, 20.0, 2.0, (1, 4), None, None)
    c = Evaluation(0.8, 8.0, 10.0, 1.0, (3, 2), 0.6, 4)
    pooled = refit._pooled([a, b, c], [5, 5, 5])
    assert pooled.score == (5.0 + 18.0 + 8.0) / (10.0 + 20.0 + 10.0)
    assert pooled.sizes == (10, 5) and pooled.balance == 10 / 7.5
    assert pooled.rho == 0.5 and pooled.rho_n == 4  # the smallest fold's count
    big = run_fit_job(FitJob(records=old + new, model="s", top_k=K, worker_ids=IDS,
                             output=str(tmp_path / "big"), current=None, drift=None))
    assert "validated by 4-fold cross-validation (200 requests)" in big.notes  # always


def test_the_prompt_predictor_is_fitted_only_from_enough_bags_of_the_router_vocabulary():
    from eldr.learn.buffer import make_record
    from eldr.learn.refit import PROMPT_MIN_REQUESTS, fit_prompt_predictor

    rng = np.random.default_rng(0)

    def record(domain: int):
        ids = rng.integers(0, 50, size=12) + 50 * domain  # each domain its own words
        counts = np.zeros((4, 16), dtype=np.int32)
        for layer in range(4):
            counts[layer, [domain * 2, domain * 2 + 1]] = 12  # k = 2
        return make_record(counts, top_k=2, decoder="d", time=0.0, prompt_ids=ids)

    recs = [record(i % 2) for i in range(PROMPT_MIN_REQUESTS)]
    notes: list[str] = []
    assert fit_prompt_predictor(recs[:-1], notes) is None
    assert notes == [f"prompt predictor: {PROMPT_MIN_REQUESTS - 1} requests with a prompt, "
                     f"need {PROMPT_MIN_REQUESTS}"]
    assert fit_prompt_predictor(recs, notes, vocab_size=60) is None  # ids up to 99
    assert "outside the router's tokenizer's vocabulary (60)" in notes[-1]
    pred = fit_prompt_predictor(recs, notes, vocab_size=128, tokenizer_fingerprint="ab" * 32)
    assert pred is not None and pred.vocab_size == 128
    # it learned which words go with which experts
    code, law = pred.predict(np.arange(5, 15)), pred.predict(np.arange(55, 65))
    assert code[:, :2].sum() > code[:, 2:4].sum() and law[:, 2:4].sum() > law[:, :2].sum()
