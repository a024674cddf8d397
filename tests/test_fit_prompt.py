import json
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest

from _prompt_data import K_TOP, VOCAB, E, L, mix64, token_trace
from eldr.cli import main
from eldr.fit import artifact
from eldr.fit.artifact import fit_artifact
from eldr.fit.prompt import WEIGHTINGS, PromptPredictor, ngram_hashes, tokenizer_fingerprint
from eldr.traces.trace import save as save_trace

SMALL = {"bits": (10, 12), "ranks": (4, 8), "alphas": (0.01, 0.1, 1.0)}


@pytest.fixture(scope="module")
def trace():
    return token_trace(160)


@pytest.fixture(scope="module")
def fitted(trace):
    return PromptPredictor(**SMALL).fit(trace.subset(np.arange(120)), vocab_size=VOCAB,
                                        tokenizer_fingerprint="ab" * 32)


def _profiles(trace):
    return trace.prefill_counts / trace.prompt_lens[:, None, None].astype(np.float64)


def test_predictions_are_profiles_rows_summing_to_top_k(fitted, trace):
    p = fitted.predict(trace.prompt_tokens(130))
    assert p.shape == (L, E) and p.dtype == np.float32
    assert (p >= 0).all()
    np.testing.assert_allclose(p.sum(axis=1), K_TOP, rtol=1e-5)
    assert (fitted.num_layers, fitted.num_experts, fitted.top_k) == (L, E, K_TOP)
    assert fitted.vocab_size == VOCAB and fitted.tokenizer_fingerprint == "ab" * 32


def test_held_out_profiles_are_predicted_far_better_than_the_mean(fitted, trace):
    """Each token id fixes its experts here, so the prompt determines the profile."""
    held = trace.subset(np.arange(120, 160))
    truth = _profiles(held)
    mean = _profiles(trace.subset(np.arange(120))).mean(axis=0)
    pred = fitted.predict_trace(held)
    r2 = 1 - ((pred - truth) ** 2).sum() / ((truth - mean) ** 2).sum()
    assert r2 > 0.8
    assert fitted.cv_r2_ > 0.7
    # the chosen candidate is the cheapest within the tolerance of the grid's best
    top = max(g["r2"] for g in fitted.grid_)
    assert top - fitted.tolerance <= fitted.cv_r2_ <= top
    cheaper = [g for g in fitted.grid_ if (g["bits"], g["rank"]) < (fitted.bits_, fitted.rank_)]
    assert all(g["r2"] < top - fitted.tolerance for g in cheaper)
    assert {g["bits"] for g in fitted.grid_} == {10, 12}


def test_rows_sum_to_top_k_before_clipping(fitted):
    """The basis spans centred profiles (layer rows summing to 0), so the linear
    prediction keeps each layer's sum at top_k; clipping only rescales."""
    np.testing.assert_allclose(fitted.mean_.reshape(L, E).sum(1), K_TOP, rtol=1e-4)
    basis = fitted.basis_.astype(np.float64).reshape(-1, L, E)
    # stored as half floats: each entry moved by at most 2**-11 of itself
    bound = np.abs(basis).sum(2) * 2.0 ** -11 + 1e-6
    assert (np.abs(basis.sum(2)) <= bound).all()


def test_the_table_and_basis_are_stored_as_half_floats(fitted):
    """Half the bytes a prediction reads; the table's power-of-two scale puts its largest
    entry in [2**13, 2**14), and weights_ gives back exactly scale x the stored values."""
    assert fitted.basis_.dtype == np.float16 and fitted._half_weights.dtype == np.float16
    top = np.abs(fitted._half_weights.astype(np.float32)).max()
    assert 2.0 ** 13 <= top < 2.0 ** 14
    assert np.frexp(fitted.weights_scale_)[0] == 0.5
    np.testing.assert_array_equal(
        fitted.weights_, fitted._half_weights.astype(np.float64) * fitted.weights_scale_)
    assert fitted.nbytes == fitted.idf_.nbytes + fitted.mean_.nbytes + 2 * (
        fitted._half_weights.size + fitted.basis_.size)


@pytest.mark.parametrize("weighting", ["tf", "tfidf"])
def test_predict_is_the_model_on_the_fitted_features(trace, weighting):
    """predict's fast paths compute what the fit's feature rows imply."""
    from eldr.fit.prompt_features import feature_row

    p = PromptPredictor(**SMALL, weightings=(weighting,)).fit(trace.subset(np.arange(60)))
    ids = trace.prompt_tokens(100)
    b, w = feature_row(ngram_hashes(ids), p.bits_, p.idf_, weighting)
    y = (p.mean_ + (w @ p.weights_[b]) @ p.basis_).reshape(L, E)
    y = np.maximum(y, 0)
    y *= K_TOP / y.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(p.predict(ids), y, rtol=1e-4, atol=1e-6)


def _predict_written_out(p: PromptPredictor, ids) -> np.ndarray:
    """The model of the module docstring, plainly and in float64: each unigram ``t`` and
    bigram ``(a + 1) << 32 | b`` mixed and bucketed by its top bits; bucket weights tf
    (count / n-grams), token (count / tokens) or tfidf (log(1 + count) · idf,
    L2-normalised); the weighted rows summed and projected; each layer clipped at 0 and
    rescaled to top_k (an all-zero layer uniform)."""
    ids = [int(t) for t in ids]
    keys = ids + [(a + 1) << 32 | b for a, b in pairwise(ids)]
    count = Counter(mix64(key) >> (64 - p.bits_) for key in keys)
    if p.weighting_ == "tfidf":
        w = {b: np.log1p(c) * float(p.idf_[b]) for b, c in count.items()}
        norm = np.sqrt(sum(v * v for v in w.values()))
        w = {b: v / norm for b, v in w.items()}
    else:
        n = len(keys) if p.weighting_ == "tf" else len(ids)
        w = {b: c / n for b, c in count.items()}
    z = sum(v * p.weights_[b].astype(np.float64) for b, v in w.items())
    y = p.mean_.astype(np.float64) + z @ p.basis_.astype(np.float64)
    y = np.maximum(y.reshape(p.num_layers, p.num_experts), 0)
    y[y.sum(axis=1) <= 0] = 1.0
    return y * p.top_k / y.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("rank", [8, 30, 32])
def test_predict_is_the_model_written_out(weighting, rank):
    """predict's fast path (fused hashing, one gather of 64-byte aligned rows, padded to
    whole lines at rank 30, a BLAS sum) is the model within 1e-6, on a 2,048-token prompt,
    repeated n-grams, the largest ids and a layer that clips to zero."""
    rng = np.random.default_rng(rank)
    bits, layers, experts, k, vocab = 12, 4, 16, 2, 1 << 31
    doc = {"hash": "mul64-unigram-bigram-v1", "num_layers": layers, "num_experts": experts,
           "top_k": k, "vocab_size": vocab, "tokenizer_fingerprint": "", "bits": bits,
           "weighting": weighting, "rank": rank, "alpha": 0.1}
    mean = rng.dirichlet(np.ones(experts), size=layers) * k
    mean[0] = -1.0  # layer 0 clips to zero: uniform
    basis = rng.standard_normal((rank, layers, experts))
    basis -= basis.mean(axis=2, keepdims=True)
    arrays = {"idf": (1 + rng.random(1 << bits)).astype(np.float32),
              "weights": (0.01 * rng.standard_normal((1 << bits, rank))).astype(np.float32),
              "basis": basis.reshape(rank, -1).astype(np.float32),
              "mean": mean.reshape(-1).astype(np.float32)}
    p = PromptPredictor.from_state(doc, arrays)
    long = rng.integers(0, vocab, 2048)
    for ids in (long, np.concatenate([long[:300], long[:300], long[:5]]),
                np.array([vocab - 1, 0, vocab - 1, vocab - 2]), np.array([7])):
        y = p.predict(ids)
        np.testing.assert_allclose(y, _predict_written_out(p, ids), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y[0], k / experts, rtol=1e-6)
    # a float32 table (an older eldr's artifact) is kept as half floats over a power of
    # two, gathered from an aligned copy; stored and read back, it predicts the same
    doc2, saved = p.state()
    scale = doc2["weights_scale"]
    assert saved["weights"].flags.c_contiguous and saved["weights"].dtype == np.float16
    np.testing.assert_array_equal(
        saved["weights"], (arrays["weights"] / np.float32(scale)).astype(np.float16))
    assert p._rows.ctypes.data % 64 == 0
    back = PromptPredictor.from_state(doc2, saved)
    np.testing.assert_array_equal(back.predict(long), p.predict(long))

@pytest.mark.parametrize("ids, match", [
    ([], "empty prompt"),
    (np.array([], dtype=np.int64), "empty prompt"),
    ([1.5, 2.0], "must be integers"),
    (["a"], "must be integers"),
    ([[1, 2]], "1-D"),
    ([1, -1], "unknown token id -1"),
    ([1, VOCAB], f"unknown token id {VOCAB}"),
])
def test_bad_prompts_are_refused_naming_the_problem(fitted, ids, match):
    with pytest.raises(ValueError, match=match):
        fitted.predict(ids)


def test_token_ids_may_be_any_integer_sequence(fitted, trace):
    ids = trace.prompt_tokens(3)
    ref = fitted.predict(ids)
    for other in (ids.astype(np.int64), ids.astype(np.uint16), [int(t) for t in ids]):
        np.testing.assert_array_equal(fitted.predict(other), ref)


def test_another_tokenizer_is_refused(fitted):
    fitted.check_tokenizer("ab" * 32)
    fitted.check_tokenizer("")  # unknown: accepted
    fitted.check_tokenizer(None)
    with pytest.raises(ValueError, match="another model or vocabulary"):
        fitted.check_tokenizer("cd" * 32)


def test_state_round_trip_predicts_the_same_bits(fitted, trace):
    doc, arrays = fitted.state()
    back = PromptPredictor.from_state(json.loads(json.dumps(doc)), arrays)
    for r in (0, 50, 140):
        ids = trace.prompt_tokens(r)
        np.testing.assert_array_equal(back.predict(ids), fitted.predict(ids))
    assert back.nbytes == fitted.nbytes
    assert back.cv_r2_ == pytest.approx(fitted.cv_r2_, abs=1e-6)


@pytest.mark.parametrize("edit, match", [
    (lambda d, a: d.update(hash="other"), "made by another eldr"),
    (lambda d, a: d.update(bits=30), "bits must be in"),
    (lambda d, a: d.update(rank=True), "rank must be a positive integer"),
    (lambda d, a: d.update(weighting="bm25"), "weighting must be one of"),
    (lambda d, a: d.update(alpha=-1), "alpha must be a positive"),
    (lambda d, a: d.update(tokenizer_fingerprint=7), "tokenizer_fingerprint"),
    (lambda d, a: a.update(weights=a["weights"][:-1]), "array weights"),
    (lambda d, a: a.update(basis=a["basis"].astype(np.float64)), "array basis"),
    (lambda d, a: a["mean"].__setitem__(0, np.nan), "NaN or Inf"),
    (lambda d, a: a["idf"].__setitem__(0, -1), "idf must be non-negative"),
    (lambda d, a: a.pop("idf"), "array idf"),
    (lambda d, a: d.update(weights_scale=3.0), "weights_scale must be a positive power"),
    (lambda d, a: d.update(weights_scale=0), "weights_scale must be a positive power"),
    (lambda d, a: d.update(weights_scale=True), "weights_scale must be a positive power"),
    # half floats without their scale: read as an older eldr's float32 arrays, refused
    (lambda d, a: d.pop("weights_scale"), "array weights"),
])
def test_damaged_states_are_refused(fitted, edit, match):
    doc, arrays = fitted.state()
    doc = json.loads(json.dumps(doc))
    arrays = {k: v.copy() for k, v in arrays.items()}
    edit(doc, arrays)
    with pytest.raises(ValueError, match=match):
        PromptPredictor.from_state(doc, arrays)


def test_candidates_over_the_size_budget_are_skipped(trace):
    small = trace.subset(np.arange(60))
    # float32 idf and mean, half-float table and basis
    size = lambda bits, rank: (4 + 2 * rank) * ((1 << bits) + L * E)  # noqa: E731
    budget = size(10, 8)
    p = PromptPredictor(bits=(10, 12), ranks=(4, 8), alphas=(0.1,),
                        max_bytes=budget).fit(small)
    assert {(g["bits"], g["rank"]) for g in p.grid_} == {(10, 4), (10, 8)}
    assert p.nbytes <= budget
    with pytest.raises(ValueError, match="no candidate fits max_bytes"):
        PromptPredictor(bits=(12,), ranks=(8,), max_bytes=1000).fit(small)


def test_fit_refuses_what_it_cannot_use(trace):
    from dataclasses import replace

    with pytest.raises(ValueError, match="no prompt_token_ids"):
        PromptPredictor().fit(replace(trace, prompt_token_ids=None))
    with pytest.raises(ValueError, match="at least 6 requests"):
        PromptPredictor().fit(trace.subset(np.arange(5)))
    with pytest.raises(ValueError, match="hold token id"):
        PromptPredictor(**SMALL).fit(trace.subset(np.arange(30)), vocab_size=3)
    with pytest.raises(ValueError, match="not fitted"):
        PromptPredictor().predict([1, 2])
    for bad in ({"bits": (4,)}, {"ranks": ()}, {"alphas": (0,)}, {"folds": 1},
                {"weightings": ("bm25",)}, {"max_bytes": 0}):
        with pytest.raises(ValueError):
            PromptPredictor(**bad)


def test_fits_are_deterministic(trace):
    small = trace.subset(np.arange(60))
    a = PromptPredictor(**SMALL).fit(small)
    b = PromptPredictor(**SMALL).fit(small)
    np.testing.assert_array_equal(a.weights_, b.weights_)
    np.testing.assert_array_equal(a.predict(small.prompt_tokens(0)),
                                  b.predict(small.prompt_tokens(0)))


# -- in the routing artifact -------------------------------------------------------------------
@pytest.fixture(scope="module")
def art(trace):
    return fit_artifact(trace, worker_ids=["w0", "w1", "w2"], n_init=1, prompt_options=SMALL)


def test_the_artifact_fits_saves_and_loads_the_predictor(art, trace, tmp_path):
    assert art.prompt_predictor is not None
    assert art.fit_stats["prompt_predictor"]["cv_r2"] == pytest.approx(
        art.prompt_predictor.cv_r2_, abs=1e-6)
    out = artifact.save(art, tmp_path / "art")
    assert sorted(p.name for p in out.iterdir()) == ["arrays.npz", "artifact.json",
                                                     "prompt.npz"]
    back = artifact.load(out)
    ids = trace.prompt_tokens(7)
    np.testing.assert_array_equal(back.prompt_predictor.predict(ids),
                                  art.prompt_predictor.predict(ids))
    s, p = back.route_inputs_from_prompt(ids)
    s0, p0 = art.route_inputs_from_prompt(ids)
    np.testing.assert_array_equal(s, s0)
    np.testing.assert_array_equal(p, p0)
    artifact.save(back, out)  # an artifact directory with prompt.npz is replaced


def test_route_inputs_from_prompt_are_what_route_request_takes(art, trace):
    ids = trace.prompt_tokens(11)
    sig, prof = art.route_inputs_from_prompt(ids)
    assert sig.dtype == np.float32 and sig.shape == (art.layers.size * E,)
    assert np.linalg.norm(sig) == pytest.approx(1.0, rel=1e-5)
    assert prof.dtype == np.float32 and prof.shape == (L, E)
    pre = art.prompt_predictor.predict(ids)
    # the signature is the encoder on the predicted profile; the profile its shrinkage
    np.testing.assert_array_equal(sig, art.encoder.transform(pre))
    np.testing.assert_array_equal(prof, art.predict_profile(pre, 1))
    # the predicted signature picks the same worker as the real one for most prompts
    same = 0
    for r in range(trace.num_requests):
        real = art.encoder.transform(trace.prefill_counts[r])
        pred, _ = art.route_inputs_from_prompt(trace.prompt_tokens(r))
        same += int((art.centroids @ real).argmax() == (art.centroids @ pred).argmax())
    assert same >= 0.9 * trace.num_requests
    with pytest.raises(ValueError, match="empty prompt"):
        art.route_inputs_from_prompt([])
    with pytest.raises(ValueError, match="unknown token id -1"):
        art.route_inputs_from_prompt([3, -1])
    # fitted without a tokenizer: an id beyond the calibration's is hashed, not refused
    assert art.prompt_predictor.vocab_source == "calibration"
    art.route_inputs_from_prompt([VOCAB + 5])
    # a predictor of unknown tokenizer ("") accepts any fingerprint
    art.route_inputs_from_prompt(ids, tokenizer_fingerprint="ff" * 32)


def test_without_prompt_ids_or_when_turned_off_there_is_no_predictor(trace):
    from dataclasses import replace

    synthetic = replace(trace, meta=replace(trace.meta, source="synthetic:test"))
    forced = fit_artifact(synthetic, worker_ids=["a", "b"], n_init=1, prompt_predictor=True,
                          prompt_options=SMALL)
    assert forced.prompt_predictor is not None
    with pytest.raises(ValueError, match="no prompt_token_ids"):
        fit_artifact(replace(trace, prompt_token_ids=None), worker_ids=["a", "b"], n_init=1,
                     prompt_predictor=True)
    for a in (fit_artifact(replace(trace, prompt_token_ids=None), worker_ids=["a", "b"],
                           n_init=1),
              fit_artifact(synthetic, worker_ids=["a", "b"], n_init=1),
              fit_artifact(trace, worker_ids=["a", "b"], n_init=1, prompt_predictor=False)):
        assert a.prompt_predictor is None
        assert a.fit_stats["prompt_predictor"] is None
        with pytest.raises(ValueError, match="no prompt predictor"):
            a.route_inputs_from_prompt([1, 2])


def test_without_a_vocabulary_ids_beyond_the_calibration_are_hashed_not_refused(trace):
    """The defect: fitted without a tokenizer, the predictor took 1 + the largest
    calibration id as its vocabulary and refused a later prompt's larger id."""
    small = trace.subset(np.arange(60))
    p = PromptPredictor(**SMALL).fit(small)
    seen = int(small.prompt_token_ids.max()) + 1
    assert (p.vocab_size, p.vocab_source) == (seen, "calibration")
    later = np.array([3, seen, seen + 4093, 2**31 - 1])
    y = p.predict(later)
    assert y.shape == (L, E) and np.isfinite(y).all()
    np.testing.assert_allclose(y.sum(axis=1), K_TOP, rtol=1e-5)
    assert np.abs(p.predict(later, kernel="numpy") - y).max() <= 1e-6  # both kernels
    # a larger id is one more hashed n-gram: it changes the prediction
    assert not np.allclose(p.predict([3, 4]), p.predict([3, seen + 7]))
    for bad, match in (([3, -1], "unknown token id -1"),
                       ([3, 2**31], "unknown token id 2147483648: outside .*hash's range")):
        with pytest.raises(ValueError, match=match):
            p.predict(bad)
    # a fingerprint without a vocabulary size is still the calibration's
    assert PromptPredictor(**SMALL).fit(small, tokenizer_fingerprint="ab").vocab_source == \
        "tokenizer"


def test_a_model_config_gives_the_vocabulary_and_ids_outside_it_are_refused(trace, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB + 10}))
    a = fit_artifact(trace, worker_ids=["a", "b"], n_init=1, model_config=tmp_path,
                     prompt_options=SMALL)
    p = a.prompt_predictor
    assert (p.vocab_size, p.vocab_source, p.tokenizer_fingerprint) == (VOCAB + 10, "config",
                                                                        "")
    p.predict([VOCAB + 9])  # in that vocabulary, unseen in the trace
    with pytest.raises(ValueError, match=r"outside \[0, 58\) of the model's vocabulary"):
        p.predict([1, VOCAB + 10])
    # a tokenizer wins over the config: its vocabulary is the one refused beyond
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps(
        {"model": {"vocab": {f"t{i}": i for i in range(VOCAB + 2)}}}))
    b = fit_artifact(trace, worker_ids=["a", "b"], n_init=1, model_config=tmp_path,
                     tokenizer=tok, prompt_options=SMALL).prompt_predictor
    assert (b.vocab_size, b.vocab_source) == (VOCAB + 2, "tokenizer")
    with pytest.raises(ValueError, match="of this predictor's tokenizer"):
        b.predict([VOCAB + 2])
    # a config smaller than the trace's ids belongs to another model
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    with pytest.raises(ValueError, match="hold token id"):
        fit_artifact(trace, worker_ids=["a", "b"], n_init=1, model_config=tmp_path,
                     prompt_options=SMALL)
    with pytest.raises(ValueError, match="needs that vocabulary's vocab_size"):
        PromptPredictor(**SMALL).fit(trace, vocab_source="config")
    with pytest.raises(ValueError, match="vocab_source must be one of"):
        PromptPredictor(**SMALL).fit(trace, vocab_size=VOCAB, vocab_source="guess")


def test_the_vocabulary_source_is_saved_and_old_artifacts_load(trace, tmp_path):
    """An artifact written before vocab_source existed loads: with a tokenizer's
    fingerprint its vocabulary is the tokenizer's (refused beyond), without one it was the
    calibration's (hashed beyond)."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(VOCAB)}}}))
    with_tok = fit_artifact(trace, worker_ids=["a", "b"], n_init=1, tokenizer=tok,
                            prompt_options=SMALL)
    without = fit_artifact(trace, worker_ids=["a", "b"], n_init=1, prompt_options=SMALL)
    for art, source in ((with_tok, "tokenizer"), (without, "calibration")):
        out = artifact.save(art, tmp_path / source)
        doc = json.loads((out / "artifact.json").read_text())
        assert doc["prompt_predictor"]["vocab_source"] == source
        assert artifact.load(out).prompt_predictor.vocab_source == source
        del doc["prompt_predictor"]["vocab_source"]  # as an older eldr wrote it
        (out / "artifact.json").write_text(json.dumps(doc))
        back = artifact.load(out).prompt_predictor
        assert back.vocab_source == source
        ids = trace.prompt_tokens(5)
        np.testing.assert_array_equal(back.predict(ids), art.prompt_predictor.predict(ids))
    back = artifact.load(tmp_path / "calibration").prompt_predictor
    back.predict([VOCAB + 100])
    with pytest.raises(ValueError, match="unknown token id 48"):
        artifact.load(tmp_path / "tokenizer").prompt_predictor.predict([VOCAB])
    doc, arrays = without.prompt_predictor.state()
    with pytest.raises(ValueError, match="vocab_source must be one of"):
        PromptPredictor.from_state({**doc, "vocab_source": "guess"}, arrays)


def test_load_refuses_a_predictor_for_another_tokenizer(trace, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {f"t{i}": i for i in range(VOCAB + 10)}
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    a = fit_artifact(trace, worker_ids=["a", "b"], n_init=1, tokenizer=tok,
                     prompt_options=SMALL)
    fp = tokenizer_fingerprint(tok)
    assert a.prompt_predictor.tokenizer_fingerprint == fp
    assert a.prompt_predictor.vocab_size == VOCAB + 10
    a.prompt_predictor.predict([VOCAB + 9])  # in that vocabulary, unseen in the trace
    out = artifact.save(a, tmp_path / "art")
    assert artifact.load(out, expect_tokenizer=fp).prompt_predictor is not None
    with pytest.raises(ValueError, match="another model or vocabulary"):
        artifact.load(out, expect_tokenizer="0" * 64)
    with pytest.raises(ValueError, match="another model or vocabulary"):
        a.route_inputs_from_prompt([1, 2], tokenizer_fingerprint="0" * 64)
    a.route_inputs_from_prompt([1, 2], tokenizer_fingerprint=fp)


def test_a_damaged_prompt_file_is_refused_in_one_line(art, tmp_path):
    out = artifact.save(art, tmp_path / "art")
    (out / "prompt.npz").unlink()
    with pytest.raises(ValueError, match=r"missing prompt\.npz"):
        artifact.load(out)
    out = artifact.save(art, tmp_path / "art2")
    doc, arrays = art.prompt_predictor.state()
    arrays = dict(arrays, weights=arrays["weights"][:, :1].copy())
    with open(out / "prompt.npz", "wb") as fh:
        np.savez(fh, **arrays)
    with pytest.raises(ValueError, match="weights has shape"):
        artifact.load(out)
    out = artifact.save(art, tmp_path / "art3")
    with open(out / "prompt.npz", "wb") as fh:
        np.savez(fh, **dict(art.prompt_predictor.state()[1], extra=np.zeros(1)))
    with pytest.raises(ValueError, match=r"prompt\.npz holds"):
        artifact.load(out)
    out = artifact.save(art, tmp_path / "art4")
    doc = json.loads((out / "artifact.json").read_text())
    doc["prompt_predictor"]["num_experts"] = E * 2
    (out / "artifact.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="prompt_predictor is for"):
        artifact.load(out)


def test_eldr_fit_fits_the_predictor_with_its_tokenizer(trace, tmp_path, capsys):
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(VOCAB)}}}))
    base = ["fit", str(path), "-K", "2", "--n-init", "1", "--prompt-bits", "10",
            "--prompt-ranks", "4", "8"]
    assert main([*base, "--tokenizer", str(tok), "-o", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "prompt predictor: 2**10 buckets" in out and "vocabulary 48" in out
    a = artifact.load(tmp_path / "a", expect_tokenizer=tokenizer_fingerprint(tok))
    assert a.prompt_predictor.bits_ == 10 and a.prompt_predictor.rank_ <= 8
    assert "vocabulary 48 (tokenizer)" in out
    assert main([*base, "--model-config", "tiny", "-o", str(tmp_path / "m")]) == 0
    assert "(config)" in capsys.readouterr().out
    assert artifact.load(tmp_path / "m").prompt_predictor.vocab_source == "config"
    assert main([*base, "--no-prompt-predictor", "-o", str(tmp_path / "b")]) == 0
    assert artifact.load(tmp_path / "b").prompt_predictor is None
    assert main([*base, "--tokenizer", str(tmp_path / "none"), "-o",
                 str(tmp_path / "c")]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_the_token_model_learns_each_tokens_experts_from_prefill_topk():
    """Each token id fixes its experts here: with every token as a sample, the unigram
    table is exact and beats the prompt-level ridge; it survives the state round trip."""
    tr = token_trace(60, with_topk=True)
    fit, held = tr.subset(np.arange(30)), tr.subset(np.arange(30, 60))
    p = PromptPredictor(bits=(12,), ranks=(8, 16), alphas=(0.001, 0.1)).fit(fit)
    assert p.weighting_ == "token"
    assert {g["weighting"] for g in p.grid_} == {"tfidf", "tf", "token"}
    truth = _profiles(held)
    mean = _profiles(fit).mean(axis=0)
    pred = p.predict_trace(held)
    r2 = 1 - ((pred - truth) ** 2).sum() / ((truth - mean) ** 2).sum()
    assert r2 > 0.95
    doc, arrays = p.state()
    back = PromptPredictor.from_state(json.loads(json.dumps(doc)), arrays)
    np.testing.assert_array_equal(back.predict(held.prompt_tokens(0)), pred[0])
    # without per-token experts the token model is skipped, or refused when it is all
    ridge = PromptPredictor(bits=(12,), ranks=(8,)).fit(token_trace(30))
    assert ridge.weighting_ != "token"
    with pytest.raises(ValueError, match="needs each prompt token's experts"):
        PromptPredictor(weightings=("token",)).fit(token_trace(30))


def test_fit_hashes_on_sorted_bags_is_fit_prompts(trace):
    """The learner keeps each prompt's sorted bag of n-gram hashes, not its ids: the
    tfidf / tf models read only bucket counts, so the fit is the same."""
    small = trace.subset(np.arange(60))
    prompts = [small.prompt_tokens(r) for r in range(60)]
    profiles = _profiles(small)
    opts = {**SMALL, "weightings": ("tfidf", "tf")}
    a = PromptPredictor(**opts).fit_prompts(prompts, profiles, top_k=K_TOP, vocab_size=VOCAB)
    bags = [np.sort(ngram_hashes(p)) for p in prompts]
    b = PromptPredictor(**opts).fit_hashes(bags, profiles, top_k=K_TOP, vocab_size=VOCAB,
                                           tokenizer_fingerprint="ab")
    assert (a.bits_, a.weighting_, a.rank_, a.alpha_) == (b.bits_, b.weighting_, b.rank_,
                                                          b.alpha_)
    np.testing.assert_allclose(b.weights_, a.weights_, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b.predict(prompts[3]), a.predict(prompts[3]), rtol=1e-5,
                               atol=1e-7)
    assert b.vocab_size == VOCAB and b.tokenizer_fingerprint == "ab"
    with pytest.raises(ValueError, match="needs each prompt token's experts"):
        PromptPredictor(weightings=("token",)).fit_hashes(bags, profiles, top_k=K_TOP,
                                                          vocab_size=VOCAB)
    with pytest.raises(ValueError, match="non-empty 1-D uint64"):
        PromptPredictor().fit_hashes([*bags[:-1], np.array([], np.uint64)], profiles,
                                     top_k=K_TOP, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="vocab_size must be an integer"):
        PromptPredictor().fit_hashes(bags, profiles, top_k=K_TOP, vocab_size=None)
