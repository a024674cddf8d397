"""The compiled prompt-prediction kernel (eldr.fit.prompt_kernel) against the numpy path."""

import logging

import numpy as np
import pytest

from _prompt_data import VOCAB, token_trace
from eldr.fit import prompt as prompt_mod
from eldr.fit.prompt import KERNELS, PromptPredictor, compiled_kernels

numba = pytest.importorskip("numba")


def _random_predictor(bits, rank, L, E, k, vocab, weighting, seed=0):
    rng = np.random.default_rng(seed)
    doc = {"hash": prompt_mod.HASH_NAME, "num_layers": L, "num_experts": E, "top_k": k,
           "vocab_size": vocab, "vocab_source": "config", "tokenizer_fingerprint": "",
           "bits": bits, "weighting": weighting, "rank": rank, "alpha": 0.1}
    mean = rng.dirichlet(np.ones(E), size=L).astype(np.float32) * k
    basis = rng.standard_normal((rank, L, E)).astype(np.float32)
    basis -= basis.mean(axis=2, keepdims=True)
    arrays = {"idf": (1 + rng.random(1 << bits)).astype(np.float32),
              "weights": (0.01 * rng.standard_normal((1 << bits, rank))).astype(np.float32),
              "basis": basis.reshape(rank, L * E), "mean": mean.reshape(-1)}
    return PromptPredictor.from_state(doc, arrays)


def _prompts(vocab, rng):
    """Lengths 1 to 2,048 (8 to 11: 15 to 21 n-grams, around where the kernels stop
    prefetching rows and counts ``_AHEAD`` = 16 n-grams ahead), a prompt of few distinct ids
    (repeated n-grams: the tfidf counts), one at both ends of the vocabulary."""
    out = [rng.integers(0, vocab, n) for n in (1, 2, 3, 5, 8, 9, 10, 11, 17, 256, 2048)]
    out.append(rng.integers(0, 6, 700))
    out.append(np.array([0, vocab - 1, 0, vocab - 1, 1]))
    return out


def test_the_kernel_loads():
    assert compiled_kernels() is not None


@pytest.mark.parametrize("weighting", ["token", "tfidf"])
def test_one_compiled_version_serves_every_caller(weighting):
    """Read-only ids (what a tokenizer process's bytes give), writable ids of any integer
    type and a fitted predictor's own arrays all run the ONE version compiled at import: a
    request never compiles (seconds, past its prompt timeout: the stock-vLLM e2e's first
    text prompt was routed by load on a fresh clone), and one version per function is what
    keeps numba's on-disk cache consistent across processes."""
    kernels = compiled_kernels()
    p = _random_predictor(10, 7, 6, 16, 2, 1000, weighting)
    ids = np.arange(40, dtype=np.int64)
    read_only = np.frombuffer(ids.tobytes(), dtype=np.int64)
    assert not read_only.flags.writeable
    want = p.predict(ids, kernel="numpy")
    for x in (read_only, ids, ids.astype(np.int32), list(ids), ids[::-1][::-1]):
        got = p.predict(x, kernel="compiled")
        assert np.abs(got - want).max() <= 1e-6 and got.flags.writeable
    for fn in (kernels.predict_bag, kernels.predict_tfidf):
        assert len(fn.signatures) == 1
    scale = np.float32(p.weights_scale_)
    with pytest.raises(TypeError):  # another type is refused, not compiled
        kernels.predict_bag(ids.astype(np.float64), p._row_bits, scale, 54, 1000, False,
                            p._basis_bits, p.mean_, 6, 2)
    with pytest.raises(TypeError):  # so is a float32 table: it reads half floats' bits
        kernels.predict_bag(ids, p._rows.astype(np.float32), scale, 54, 1000, False,
                            p._basis_bits, p.mean_, 6, 2)
    assert len(kernels.predict_bag.signatures) == 1


@pytest.mark.parametrize("weighting", ["token", "tf", "tfidf"])
@pytest.mark.parametrize("bits,rank", [(16, 32), (12, 7), (10, 46)])
def test_both_kernels_agree_on_every_profile_entry(weighting, bits, rank):
    """Rank 32 is the benchmark's, 7 leaves a basis tail of three rows (not a multiple of
    four), 46 pads each weight row to 48 columns."""
    p = _random_predictor(bits, rank, 48, 128, 8, 151_936, weighting)
    for ids in _prompts(151_936, np.random.default_rng(bits + rank)):
        a, b = p.predict(ids, kernel="numpy"), p.predict(ids, kernel="compiled")
        assert b.shape == a.shape == (48, 128) and b.dtype == np.float32
        assert np.abs(a - b).max() <= 1e-6
        np.testing.assert_allclose(b.sum(axis=1), 8, rtol=1e-5)


@pytest.mark.parametrize("weighting", ["tfidf", "tf", "token"])
def test_both_kernels_agree_on_a_fitted_predictor(weighting):
    trace = token_trace(90, with_topk=True)
    p = PromptPredictor(bits=(10,), ranks=(4,), alphas=(0.1,), weightings=(weighting,)).fit(
        trace, vocab_size=VOCAB)
    for r in range(trace.num_requests):
        ids = trace.prompt_tokens(r)
        assert np.abs(p.predict(ids, kernel="numpy") - p.predict(ids)).max() <= 1e-6


def test_the_tfidf_scratch_is_zero_again_after_every_prompt():
    """The compiled tfidf kernel counts n-grams in its thread's scratch: a count left
    behind would weigh that bucket in the next prompt of that thread."""
    p = _random_predictor(12, 7, 6, 16, 2, 151_936, "tfidf")
    prompts = [*_prompts(151_936, np.random.default_rng(3)), np.array([3, 151_936])]
    for ids in prompts:
        try:
            p.predict(ids, kernel="compiled")
        except ValueError:  # the bad id: refused before anything is counted
            pass
        assert not prompt_mod._bucket_counts(12).any()
    first = [p.predict(ids, kernel="compiled") for ids in prompts[:-1]]
    again = [p.predict(ids, kernel="compiled") for ids in prompts[:-1]]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_tfidf_predictions_on_concurrent_threads_each_count_in_their_own_scratch():
    """The router predicts on a thread pool with the GIL released: prompts predicted on
    four threads at once give the profiles they give one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    p = _random_predictor(12, 7, 6, 16, 2, 151_936, "tfidf")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 50 + 40 * i, 1500) for i in range(32)]  # many repeats
    want = [p.predict(ids, kernel="compiled") for ids in prompts]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda x: p.predict(x, kernel="compiled"), prompts))
            for a, b in zip(want, got, strict=True):
                np.testing.assert_array_equal(a, b)


def test_a_count_past_the_uint16_scratch_is_counted_exactly():
    """A prompt that repeats one id 70,000 times (its unigram's count is past the
    scratch's 65,535) beside a few others: the same profile as numpy's exact counts."""
    from eldr.fit.prompt_kernel import COUNT_MAX

    p = _random_predictor(10, 4, 3, 8, 2, 100, "tfidf")
    ids = np.concatenate([np.full(COUNT_MAX + 4465, 7), np.arange(20, 60)])
    a, b = p.predict(ids, kernel="numpy"), p.predict(ids, kernel="compiled")
    assert np.abs(a - b).max() <= 1e-6
    assert not prompt_mod._bucket_counts(10).any()


def test_a_layer_clipped_to_zero_becomes_uniform_in_both():
    p = _random_predictor(10, 4, 3, 8, 2, 100, "token")
    p.mean_ = np.full(24, -1.0, dtype=np.float32)  # every entry clipped away
    ids = np.arange(10)
    for kernel in ("numpy", "compiled"):
        np.testing.assert_array_equal(p.predict(ids, kernel=kernel), np.full((3, 8), 0.25))


@pytest.mark.parametrize("ids,match", [
    ([], "empty"), ([[1, 2]], "1-D"), ([1.5, 2.0], "integers"), ([3, -1], "unknown token id -1"),
    ([3, 151_936], "unknown token id 151936"),
    (np.array([3, 2**63 + 5], dtype=np.uint64), "unknown token id")])
def test_bad_prompts_are_refused_by_the_compiled_path_as_by_numpy(ids, match):
    p = _random_predictor(10, 4, 3, 8, 2, 151_936, "tfidf")
    for weighting in ("tfidf", "token"):
        p.weighting_ = weighting
        for kernel in KERNELS:
            with pytest.raises(ValueError, match=match):
                p.predict(ids, kernel=kernel)


def test_any_integer_sequence_is_one_prompt():
    p = _random_predictor(10, 4, 3, 8, 2, 1000, "token")
    want = p.predict(np.array([5, 6, 7, 999]), kernel="numpy")
    for ids in ([5, 6, 7, 999], np.array([5, 6, 7, 999], dtype=np.int32),
                np.array([5, 0, 6, 0, 7, 0, 999])[::2], np.array([5, 6, 7, 999], np.uint16)):
        assert np.abs(p.predict(ids) - want).max() <= 1e-6


def test_an_unknown_kernel_name_is_refused():
    p = _random_predictor(10, 4, 3, 8, 2, 100, "token")
    with pytest.raises(ValueError, match="kernel must be one of"):
        p.predict([1, 2], kernel="fast")


def test_without_numba_predictions_use_numpy_and_say_so_once(monkeypatch, caplog):
    p = _random_predictor(10, 4, 3, 8, 2, 100, "tfidf")
    want = p.predict([1, 2, 3], kernel="numpy")
    monkeypatch.setattr(prompt_mod, "_compiled", [])
    import builtins

    real_import = builtins.__import__

    def no_kernel(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "eldr.fit" and fromlist and "prompt_kernel" in fromlist:
            raise ImportError("No module named 'numba'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_kernel)
    with caplog.at_level(logging.INFO, logger="eldr.fit.prompt"):
        for _ in range(3):
            np.testing.assert_array_equal(p.predict([1, 2, 3]), want)
    assert sum("numpy path" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="not available"):
        p.predict([1, 2, 3], kernel="compiled")


def test_a_kernel_that_fails_to_build_falls_back_with_a_warning(monkeypatch, caplog):
    from eldr.fit import prompt_kernel

    def broken(*args):
        raise RuntimeError("no LLVM today")

    monkeypatch.setattr(prompt_mod, "_compiled", [])
    monkeypatch.setattr(prompt_kernel, "predict_bag", broken)
    with caplog.at_level(logging.WARNING, logger="eldr.fit.prompt"):
        assert compiled_kernels() is None
    assert "failed to build (RuntimeError: no LLVM today)" in caplog.text
    p = _random_predictor(10, 4, 3, 8, 2, 100, "token")
    np.testing.assert_array_equal(p.predict([1, 2]), p.predict([1, 2], kernel="numpy"))
