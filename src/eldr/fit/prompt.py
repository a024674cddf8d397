"""Predict a request's prefill expert profile from its prompt alone (docs/fit-and-routing.md).

ELDR's signature exists only after prefill; a router that picks the decoder before (or
while) prefill runs needs it earlier. The prompt itself predicts its experts: the prefill
profile ``counts / prompt_len`` (L, E) is the mean over the prompt's tokens of each
token's expert choices, and a token's choices depend mostly on the token and its
neighbours. :class:`PromptPredictor` learns that map from a captured trace (prompt token
ids + prefill counts):

- features: unigrams and bigrams of token ids, hashed into ``2**bits`` buckets, weighted
  ``log(1 + tf) · idf`` and L2-normalised (TF-IDF) or by relative frequency (``tf``)
  (:mod:`eldr.fit.prompt_features`);
- model: ridge regression onto the centred profiles in a reduced target basis (the top
  ``rank`` right singular vectors of the training profiles), solved in the dual and stored
  in the primal: ``weights_`` (2**bits, rank), so a prediction gathers one row per
  distinct n-gram of the prompt (:mod:`eldr.fit.prompt_ridge`); with a trace's per-token
  experts (``prefill_topk``) a third candidate, the ``token`` model, learns each n-gram's
  experts from every prompt token instead of from whole prompts, and predicts as cheaply
  as ``tf`` (:mod:`eldr.fit.prompt_token`);
- output: ``mean_ + (x @ weights_) @ basis_``, negative entries clipped to 0 and each
  layer's row rescaled to sum to ``top_k``, as a real profile's rows do. Before clipping
  the rows already sum to ``top_k``: every basis row lies in the span of centred
  profiles, whose layer rows sum to 0 (up to the half-float rounding below).
- storage: the table and the basis are kept as IEEE half floats (the table times a power
  of two, ``weights_scale_``, that puts its largest entry in [2**13, 2**14)), the fit and
  every sum in float32 or float64. A prediction is bound by the bytes it reads (one table
  row per n-gram, at random, and the whole basis): half floats halve them and the
  artifact, and move a profile entry by ~1e-4 at most (relative rounding 2**-11 of each
  stored value; docs/fit-and-routing.md, "what bounds a prediction").

This module is the estimator: the search (``bits``, the model, ``rank`` and ``alpha``
chosen by k-fold cross-validated R² of the profile on the calibration requests, the kernel
computed once per feature set for all folds, candidates whose stored arrays would exceed
``max_bytes`` skipped, then the model refitted on every request), the prediction (numpy,
or the compiled kernel of :mod:`eldr.fit.prompt_kernel` when numba loads) and the stored
state.

A predictor belongs to one tokenizer (:mod:`eldr.fit.prompt_vocab`): it carries the
SHA-256 of its ``tokenizer.json`` (:func:`tokenizer_fingerprint`, "" when unknown), its
vocabulary size and where that size came from (``vocab_source``, :data:`VOCAB_SOURCES`):
the tokenizer's vocabulary or the model's ``config.json`` is a real vocabulary, and token
ids outside ``[0, vocab_size)`` are refused; without either, ``vocab_size`` is only 1 + the
largest id the calibration held, and a later prompt's larger id is hashed like any other
(an id is refused only when negative or beyond the hash's ``2**31``).
:meth:`PromptPredictor.check_tokenizer` refuses another tokenizer's fingerprint.
Synthetic traces draw their token ids uniformly: a predictor fitted on one carries no
information (evaluate on captured traces only). The names of those modules that callers
use (:func:`ngram_hashes`, :data:`HASH_NAME`, the tokenizer functions) are importable
from here too.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from eldr.fit.prompt_features import (
    HASH_NAME,
    check_token_ids,
    feature_row,
    ngram_hashes,
    tfidf_features,
)
from eldr.fit.prompt_ridge import Design, ridge, ridge_fold_predictions
from eldr.fit.prompt_token import TokenData, dense_table, token_fold_predictions
from eldr.fit.prompt_vocab import (
    MAX_TOKEN_ID,
    VOCAB_SOURCES,
    config_vocab_size,
    resolve_vocab_source,
    tokenizer_fingerprint,
    tokenizer_vocab_size,
)
from eldr.traces.trace import Trace

__all__ = ["HASH_NAME", "KERNELS", "VOCAB_SOURCES", "WEIGHTINGS", "PromptPredictor",
           "compiled_kernels", "config_vocab_size", "ngram_hashes", "tokenizer_fingerprint",
           "tokenizer_vocab_size"]

WEIGHTINGS = ("tfidf", "tf", "token")  # feature weightings / models (module docstring)
_MAX_BITS = 24
KERNELS = ("auto", "numpy", "compiled")  # PromptPredictor.predict(kernel=...)
_log = logging.getLogger(__name__)


# -- the compiled kernel (optional) -------------------------------------------------------
_compiled: list = []  # [module | None] once tried
_compiled_lock = threading.Lock()


def compiled_kernels():
    """:mod:`eldr.fit.prompt_kernel` (numba), compiled on the first call (or read from
    numba's on-disk cache) and tried once on a tiny predictor; None when numba is missing
    or the kernels fail to build, said once in the log: predictions then use numpy."""
    if not _compiled:
        with _compiled_lock:
            if not _compiled:
                _compiled.append(_load_compiled())
    return _compiled[0]


def _load_compiled():
    try:
        from eldr.fit import prompt_kernel
    except ImportError as exc:
        _log.info("prompt predictions use the numpy path (%s; pip install -e '.[serve]' "
                  "adds numba, the compiled one)", exc)
        return None
    try:  # compile every kernel now, not on a request
        ids = np.arange(3, dtype=np.int64)
        rows = np.zeros((1 << 8, 16), dtype=np.uint16)  # half floats' bits
        basis = np.full((5, 8), 0x3C00, dtype=np.uint16)  # 1.0
        mean, one = np.ones(8, dtype=np.float32), np.float32(1.0)
        for per_token in (False, True):
            prompt_kernel.predict_bag(ids, rows, one, 56, 1 << 20, per_token, basis, mean,
                                      2, 1)
        prompt_kernel.predict_tfidf(ids, rows, one, np.ones(1 << 8, dtype=np.float32), 56,
                                    1 << 20, basis, mean, 2, 1, _bucket_counts(8))
    except Exception as exc:  # numba's own error types: the numpy path is always there
        _log.warning("the compiled prompt-prediction kernel failed to build (%s: %s): "
                     "predictions use the numpy path", type(exc).__name__, exc)
        return None
    return prompt_kernel


_COUNTS = threading.local()  # per thread: the compiled tfidf kernel's bucket counts


def _bucket_counts(bits: int) -> np.ndarray:
    """(≥ 2**bits,) uint16 zeros: this thread's scratch for the compiled tfidf kernel, which
    counts each n-gram at its bucket's index and leaves the array zero again. One per
    thread (predictions run on a pool, concurrently), grown to the largest table it served:
    2 bytes per bucket, 1/rank of the table's own half floats (128 KiB for 2**16)."""
    counts = getattr(_COUNTS, "array", None)
    if counts is None or counts.size < 1 << bits:
        counts = _COUNTS.array = np.zeros(1 << bits, dtype=np.uint16)
    return counts


_ONES = np.ones(1 << 12, dtype=np.float32)  # read-only, grown by _ones for longer prompts
_ONES.flags.writeable = False


def _ones(n: int) -> np.ndarray:
    """(n,) float32 ones, a view of a shared read-only array (allocating and filling a
    fresh one cost a few µs of a prediction)."""
    global _ONES
    if _ONES.size < n:
        grown = np.ones(max(n, 2 * _ONES.size), dtype=np.float32)
        grown.flags.writeable = False
        _ONES = grown
    return _ONES[:n]


_LINE = 64  # bytes of a cache line
_HALF = np.dtype("<f2")  # the stored table and basis (module docstring, "storage")
_HALF_TOP = 13  # the stored table's largest |entry| is in [2**13, 2**14) (float16 max 65504)


def _half_scale(table: np.ndarray) -> float:
    """The power of two s that puts max|table| / s in [2**13, 2**14) (1.0 for an all-zero
    or empty table): exact to divide by, far from float16's overflow, and as far from its
    subnormals (below 2**-14, where relative precision falls) as the range allows."""
    top = float(np.max(np.abs(table))) if table.size else 0.0
    if not np.isfinite(top):
        raise ValueError("prompt predictor weights contain NaN or Inf")
    return 1.0 if top == 0.0 else float(2.0 ** (np.floor(np.log2(top)) - _HALF_TOP))


def _aligned_rows(weights: np.ndarray) -> np.ndarray:
    """(N, r') copy of the (N, r) table ``weights`` (its dtype kept), 64-byte aligned, its
    rows zero-padded to whole cache lines (r' = r rounded up to a line's worth of entries:
    32 half floats) when that adds at most a quarter to them, else r' = r.

    A prediction gathers one row per n-gram of the prompt, and the gather's cost is the
    cache lines it touches: numpy's allocator puts a large array 16 bytes past a line, so
    each 128-byte row (rank 32) straddles three lines instead of two; a 184-byte row (rank
    46) touches about 3.8 instead of 3 (the gather timed both ways: docs/fit-and-routing.md,
    "Layout choices, each alone")."""
    n, r = weights.shape
    size = weights.dtype.itemsize
    per_line = _LINE // size
    padded = -(-r // per_line) * per_line
    width = padded if padded - r <= r // 4 else r
    buf = np.zeros(n * width * size + _LINE, dtype=np.uint8)
    start = (-buf.ctypes.data) % _LINE
    out = buf[start:start + n * width * size].view(weights.dtype).reshape(n, width)
    out[:, :r] = weights
    return out

def _finish(y: np.ndarray, top_k: int) -> np.ndarray:
    """(..., L, E) in place: clip at 0, rescale each layer row to sum to ``top_k`` (an
    all-zero row becomes uniform)."""
    np.maximum(y, 0, out=y)
    sums = (y @ _ones(y.shape[-1]))[..., None]  # a BLAS row sum: faster than .sum(-1)
    if sums.min() <= 0:
        zero = sums <= 0
        y[np.broadcast_to(zero, y.shape)] = 1.0
        sums = np.where(zero, y.shape[-1], sums)
    y *= np.float32(top_k) / sums
    return y


def _target_basis(yc: np.ndarray, max_rank: int, seed: int = 0) -> np.ndarray:
    """(r, L·E) orthonormal rows: the top right singular vectors of the centred targets
    ``yc`` (R, L·E), r ≤ ``max_rank``, with non-negligible singular values only (the rest
    are arbitrary directions outside the targets' span: they would break the zero layer
    sums of the basis).

    Exact (eigenvectors of the R × R Gram matrix) for few requests; else a seeded
    randomized range finder (two power iterations, ``max_rank`` + 10 columns), whose top
    ``max_rank`` directions match the exact ones to far below the noise of a fit, at a
    fraction of a full SVD's cost (both timed: docs/fit-and-routing.md, "Layout choices,
    each alone")."""
    R, n = yc.shape
    width = max_rank + 10
    if R <= 2 * width:  # few requests: eigenvectors of the R × R Gram matrix
        w, u = np.linalg.eigh(yc @ yc.T)
        w, u = w[::-1], u[:, ::-1]
        sv = np.sqrt(np.maximum(w, 0.0))
        ok = sv > 1e-5 * sv[0] if sv.size and sv[0] > 0 else np.zeros(sv.size, dtype=bool)
        sv, vt = sv[ok], (u[:, ok].T @ yc) / sv[ok, None]
    else:
        rng = np.random.default_rng(seed)
        q = np.linalg.qr(yc @ rng.standard_normal((n, width)))[0]  # (R, width)
        for _ in range(2):
            q = np.linalg.qr(yc @ (yc.T @ q))[0]
        _, sv, vt = np.linalg.svd(q.T @ yc, full_matrices=False)
    sv, vt = sv[:max_rank], vt[:max_rank]
    keep = sv > 1e-6 * sv[0] if sv.size and sv[0] > 0 else np.zeros(sv.size, dtype=bool)
    if not keep.any():  # every target the same: a zero direction, predictions = the mean
        return np.zeros((1, n))
    return vt[keep]


# -- the estimator --------------------------------------------------------------------------
class PromptPredictor:
    """Prompt token ids → (L, E) expected per-token prefill profile (module docstring).

    Parameters (settings only; scikit-learn contract):
    bits: candidate bucket counts 2**bits of the hashed n-grams.
    ranks: candidate ranks of the target basis.
    alphas: candidate ridge penalties, relative to the mean squared norm of the centred
        feature rows (so one grid serves both weightings).
    weightings: candidate feature weightings, ``tfidf`` and/or ``tf`` (:data:`WEIGHTINGS`).
    folds: cross-validation folds for the choice (≥ 2).
    max_bytes: candidates whose stored arrays exceed this are skipped (the artifact's
        budget for the predictor: 24 MiB of half floats; with the float32 tables it
        replaced the budget was 48 MiB, and for a 48 × 128 model both admit the same
        default candidates).
    tolerance: the cheapest candidate (fewest buckets, then lowest rank, then largest α)
        whose cross-validated R² is within this of the best is chosen.
    random_state: seed of the fold assignment.

    Fitted: ``num_layers``, ``num_experts``, ``top_k``, ``vocab_size``, ``vocab_source``
    (:data:`VOCAB_SOURCES`), ``tokenizer_fingerprint`` (the interface names), ``bits_``,
    ``weighting_``, ``rank_``, ``alpha_``,
    ``idf_`` (2**bits,) float32, ``weights_`` (2**bits, rank) float32 (made on each read from
    the stored half floats and ``weights_scale_``), ``basis_`` (rank, L·E) float16,
    ``mean_`` (L·E,) float32, ``cv_r2_`` (the chosen candidate's cross-validated R², before
    the half-float rounding), ``grid_`` [{bits, rank, alpha, r2}], ``num_requests_``,
    ``fit_seconds_``.
    """

    def __init__(self, *, bits: Sequence[int] = (15, 16, 17, 18),
                 ranks: Sequence[int] = (8, 16, 32, 64),
                 alphas: Sequence[float] = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),
                 weightings: Sequence[str] = WEIGHTINGS, folds: int = 3,
                 max_bytes: int = 24 << 20, tolerance: float = 0.002,
                 random_state: int | None = 0) -> None:
        self.bits = tuple(int(b) for b in bits)
        self.ranks = tuple(int(r) for r in ranks)
        self.alphas = tuple(float(a) for a in alphas)
        if not self.bits or any(not 8 <= b <= _MAX_BITS for b in self.bits):
            raise ValueError(f"bits must be non-empty values in [8, {_MAX_BITS}], got {bits}")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ValueError(f"ranks must be non-empty positive integers, got {ranks}")
        if not self.alphas or any(not (np.isfinite(a) and a > 0) for a in self.alphas):
            raise ValueError(f"alphas must be non-empty positive numbers, got {alphas}")
        self.weightings = tuple(str(w) for w in weightings)
        if not self.weightings or any(w not in WEIGHTINGS for w in self.weightings):
            raise ValueError(f"weightings must be non-empty, from {WEIGHTINGS}, got {weightings}")
        if int(folds) < 2:
            raise ValueError(f"folds must be >= 2, got {folds}")
        if int(max_bytes) <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if not (np.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"tolerance must be finite and >= 0, got {tolerance}")
        self.folds = int(folds)
        self.max_bytes = int(max_bytes)
        self.tolerance = float(tolerance)
        self.random_state = random_state

    # -- interface attributes ---------------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        self._check_fitted()
        return 1 << self.bits_

    @property
    def weights_(self) -> np.ndarray:
        """(2**bits, rank) float32 fitted table as predictions use it: ``weights_scale_``
        times the stored half floats (exact in float32), a new array on each read."""
        self._check_fitted()
        return self._half_weights.astype(np.float32) * np.float32(self.weights_scale_)

    def _store(self, weights: np.ndarray, basis: np.ndarray) -> None:
        """Keep a fitted (2**bits, rank) table and (rank, L·E) basis as half floats (module
        docstring, "storage"): the table over its power-of-two scale (:func:`_half_scale`)."""
        w = np.asarray(weights, dtype=np.float32)
        scale = _half_scale(w)
        b = np.asarray(basis, dtype=np.float32)
        if not np.isfinite(b).all() or (b.size and np.abs(b).max() >= 2.0 ** 15):
            raise ValueError("prompt predictor basis must be finite, |entries| < 2**15 "
                             "(half floats)")
        self._store_half((w / np.float32(scale)).astype(_HALF), scale, b.astype(_HALF))

    def _store_half(self, weights: np.ndarray, scale: float, basis: np.ndarray) -> None:
        """Keep the half-float table (2**bits, rank) and basis (rank, L·E) as stored: the
        table's rows aligned for the gather (:func:`_aligned_rows`), both also as their
        uint16 bits (what the compiled kernel reads)."""
        self._rows = _aligned_rows(weights)
        self._numpy = None  # the numpy path's float32 copies, made when first needed
        self._half_weights = self._rows[:, :weights.shape[1]]
        self._row_bits = self._rows.view(np.uint16)
        self.weights_scale_ = float(scale)
        self.basis_ = np.ascontiguousarray(basis, dtype=_HALF)
        self._basis_bits = self.basis_.view(np.uint16)

    def _numpy_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """((2**bits, r') rows times ``weights_scale_``, aligned like the stored ones;
        (rank, L·E) basis), float32 (exact), made at the numpy path's first prediction and
        kept. numpy casts half floats element by element: widening each prediction's
        gathered rows cost 5× the rest of the prediction. Only a predictor used without
        the compiled kernel pays the 4 bytes per entry."""
        arrays = self._numpy
        if arrays is None:  # two threads may both make them: the same arrays, either kept
            arrays = (_aligned_rows(self._rows.astype(np.float32)
                                    * np.float32(self.weights_scale_)),
                      self.basis_.astype(np.float32))
            self._numpy = arrays
        return arrays

    @property
    def nbytes(self) -> int:
        """Bytes of the fitted arrays (what the artifact stores)."""
        self._check_fitted()
        return int(self.idf_.nbytes + self._half_weights.nbytes + self.basis_.nbytes
                   + self.mean_.nbytes)

    @property
    def id_limit(self) -> int:
        """Token ids a prediction takes are below this: ``vocab_size`` when it is a real
        vocabulary (a tokenizer's or a model config's), else the hash's ``2**31`` (a
        vocabulary seen in calibration only: a larger id is hashed like any other)."""
        if getattr(self, "vocab_source", "calibration") == "calibration":
            return MAX_TOKEN_ID
        return self.vocab_size

    def _id_limit_named(self) -> str:
        """What :attr:`id_limit` is, for a refusal's message."""
        return {"tokenizer": "of this predictor's tokenizer",
                "config": "of the model's vocabulary (its config.json)"}.get(
            getattr(self, "vocab_source", "calibration"), "the feature hash's range")

    def _check_fitted(self) -> None:
        if not hasattr(self, "_half_weights"):
            raise ValueError("PromptPredictor is not fitted: call fit(trace) first")

    def _size(self, bits: int, rank: int, num_targets: int) -> int:
        """Stored bytes: float32 idf and mean, half-float table and basis."""
        return 4 * ((1 << bits) + num_targets) + 2 * rank * ((1 << bits) + num_targets)

    # -- fit ----------------------------------------------------------------------------------
    def fit(self, trace: Trace, *, vocab_size: int | None = None,
            tokenizer_fingerprint: str = "", vocab_source: str | None = None
            ) -> PromptPredictor:
        """Fit on a trace with ``prompt_token_ids`` (requests with empty prompts are
        skipped). ``vocab_size``: the tokenizer's or the model config's (default: 1 + the
        largest id seen); ``tokenizer_fingerprint``: :func:`tokenizer_fingerprint` of the
        tokenizer that made the ids ("" = unknown, never refused); ``vocab_source``: where
        ``vocab_size`` comes from (:data:`VOCAB_SOURCES`; default ``tokenizer`` with a
        fingerprint, else ``calibration``): with ``tokenizer`` or ``config`` a later id
        outside ``[0, vocab_size)`` is refused, with ``calibration`` it is hashed."""
        if not isinstance(trace, Trace):
            raise ValueError(f"fit expects an eldr Trace, got {type(trace).__name__}")
        if trace.prompt_token_ids is None:
            raise ValueError(f"trace ({trace.meta.source}) has no prompt_token_ids: a prompt "
                             "predictor needs a capture that kept them")
        keep = np.flatnonzero(trace.prompt_lens > 0)
        prompts = [trace.prompt_tokens(int(r)) for r in keep]
        counts = trace.prefill_counts[keep].astype(np.float64)
        profiles = counts / trace.prompt_lens[keep].astype(np.float64)[:, None, None]
        experts = None
        if trace.prefill_topk is not None:
            off = trace.prefill_offsets
            experts = [trace.prefill_topk[off[r]:off[r + 1]] for r in keep]
        return self.fit_prompts(prompts, profiles, top_k=trace.meta.top_k,
                                vocab_size=vocab_size,
                                tokenizer_fingerprint=tokenizer_fingerprint,
                                vocab_source=vocab_source, token_experts=experts)

    def fit_prompts(self, prompts: Sequence[np.ndarray], profiles: np.ndarray, *, top_k: int,
                    vocab_size: int | None = None, tokenizer_fingerprint: str = "",
                    vocab_source: str | None = None,
                    token_experts: Sequence[np.ndarray] | None = None) -> PromptPredictor:
        """Fit on R prompts (token id arrays) and their (R, L, E) per-token prefill
        profiles (each layer row summing to ``top_k``). ``vocab_size``,
        ``tokenizer_fingerprint``, ``vocab_source``: as in :meth:`fit`. ``token_experts``
        (optional, one (P_i, L, k) int array of expert ids per prompt token, a trace's
        ``prefill_topk``) enables the ``token`` model."""
        t0 = time.perf_counter()
        y = self._check_targets(profiles, len(prompts), tokenizer_fingerprint)
        R, L, E = y.shape
        ids = [check_token_ids(p, None) for p in prompts]
        seen = max(int(p.max()) for p in ids) + 1
        vocab = seen if vocab_size is None else int(vocab_size)
        if vocab < seen:
            raise ValueError(f"vocab_size={vocab} but the prompts hold token id {seen - 1}")
        if vocab > MAX_TOKEN_ID:
            raise ValueError(f"vocab_size {vocab} is beyond 2**31")
        source = resolve_vocab_source(vocab_source, vocab_size, tokenizer_fingerprint)
        hashes = [ngram_hashes(p) for p in ids]
        tokens = None
        if token_experts is not None:
            if len(token_experts) != R or any(np.shape(t) != (p.size, L, top_k)
                                              for t, p in zip(token_experts, ids, strict=True)):
                raise ValueError(f"token_experts must hold one (P, {L}, {top_k}) array per "
                                 "prompt")
            sample = np.random.default_rng(self.random_state)
            tokens = TokenData(ids, hashes, token_experts, E, sample)
        return self._fit(hashes, y, top_k, (vocab, source), tokenizer_fingerprint, tokens, t0)

    def fit_hashes(self, bags: Sequence[np.ndarray], profiles: np.ndarray, *, top_k: int,
                   vocab_size: int, tokenizer_fingerprint: str = "",
                   vocab_source: str | None = None) -> PromptPredictor:
        """Fit from each prompt's bag of n-gram hashes (:func:`ngram_hashes` of its ids, in
        any order: what the live learner keeps instead of the prompt) and its (R, L, E)
        prefill profile. The same ``tfidf`` / ``tf`` models as :meth:`fit_prompts` (a bag
        holds everything they read); not the ``token`` model, which needs each token's
        experts. ``vocab_size``: the tokenizer's, or 1 + the largest id of the prompts (the
        bags cannot tell it); ``vocab_source`` as in :meth:`fit`."""
        t0 = time.perf_counter()
        y = self._check_targets(profiles, len(bags), tokenizer_fingerprint)
        hashes = []
        for i, bag in enumerate(bags):
            h = np.asarray(bag)
            if h.ndim != 1 or h.size == 0 or h.dtype != np.uint64:
                raise ValueError(f"bag {i} must be a non-empty 1-D uint64 array of n-gram "
                                 f"hashes, got {h.dtype} {h.shape}")
            hashes.append(h)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) \
                or not 0 < vocab_size <= 1 << 31:
            raise ValueError(f"vocab_size must be an integer in [1, 2**31], got {vocab_size!r}")
        source = resolve_vocab_source(vocab_source, vocab_size, tokenizer_fingerprint)
        return self._fit(hashes, y, top_k, (int(vocab_size), source), tokenizer_fingerprint,
                         None, t0)

    def _check_targets(self, profiles, num_prompts: int, tokenizer_fingerprint) -> np.ndarray:
        """(R, L, E) float64 profiles, checked against the prompt count and the folds."""
        y = np.asarray(profiles, dtype=np.float64)
        if y.ndim != 3 or y.shape[0] != num_prompts:
            raise ValueError(f"profiles must be (R, L, E) with R = {num_prompts} prompts, "
                             f"got shape {y.shape}")
        if not np.isfinite(y).all() or (y < 0).any():
            raise ValueError("profiles must be finite and non-negative")
        min_requests = 2 * self.folds
        if y.shape[0] < min_requests:
            raise ValueError(f"a prompt predictor needs at least {min_requests} requests with "
                             f"a prompt, got {y.shape[0]}")
        if not isinstance(tokenizer_fingerprint, str):
            raise ValueError("tokenizer_fingerprint must be a string")
        return y

    def _fit(self, hashes: list[np.ndarray], y: np.ndarray, top_k: int,
             vocab: tuple[int, str], tokenizer_fingerprint: str, tokens: TokenData | None,
             t0: float) -> PromptPredictor:
        """The fit proper (module docstring) on checked inputs: cross-validate the grid,
        choose a candidate, refit it on every request, store it. ``vocab``: (vocab_size,
        vocab_source)."""
        R, L, E = y.shape
        target = y.reshape(R, L * E)
        weightings = self.weightings
        if tokens is None:
            weightings = tuple(w for w in weightings if w != "token")
            if not weightings:
                raise ValueError("the token model needs each prompt token's experts "
                                 "(a trace with prefill_topk)")
        grid, features = self._cross_validate(hashes, target, weightings, tokens)
        best = self._choose(grid)
        basis, weights, intercept, idf = self._refit(best, target, features, tokens)

        self.num_layers, self.num_experts, self.top_k = L, E, int(top_k)
        self.vocab_size, self.vocab_source = vocab
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.bits_, self.rank_, self.alpha_ = best["bits"], int(basis.shape[0]), best["alpha"]
        self.weighting_ = best["weighting"]
        self.idf_ = idf.astype(np.float32)
        self._store(weights, basis)
        self.mean_ = intercept.astype(np.float32)
        self.cv_r2_ = float(best["r2"])
        self.grid_ = grid
        self.num_requests_ = R
        self.fit_seconds_ = time.perf_counter() - t0
        return self

    def _cross_validate(self, hashes: list[np.ndarray], target: np.ndarray,
                        weightings: tuple[str, ...], tokens: TokenData | None
                        ) -> tuple[list[dict], dict]:
        """(grid, features): the k-fold cross-validated R² of every candidate (bits,
        weighting, rank, alpha) within ``max_bytes``, and the linear models' feature rows
        {(bits, weighting): (idf, rows)}, kept for the refit. ``target`` (R, L·E) float64.

        A linear candidate's kernel is computed once for all its folds, ranks and alphas."""
        R, num_targets = target.shape
        rng = np.random.default_rng(self.random_state)
        fold = rng.permutation(R) % self.folds
        grid, features, bases = [], {}, {}
        for bits, weighting in ((b, w) for b in self.bits for w in weightings):
            ranks = [r for r in self.ranks
                     if self._size(bits, r, num_targets) <= self.max_bytes]
            if not ranks:
                continue
            if weighting == "token":
                predict = functools.partial(token_fold_predictions, tokens, bits,
                                            self.alphas)
            else:
                idf, rows = tfidf_features(hashes, bits, weighting)
                k = Design(rows, 1 << bits).gram()
                features[bits, weighting] = (idf, rows)
                predict = functools.partial(ridge_fold_predictions, k, target, self.alphas)
            sse, sst = self._fold_errors(target, fold, bases, ranks, predict)
            for (r, a), err in sse.items():
                grid.append({"bits": bits, "weighting": weighting, "rank": r, "alpha": a,
                             "r2": float(1.0 - err / sst) if sst > 0 else 0.0})
        return grid, features

    def _fold_errors(self, target: np.ndarray, fold: np.ndarray, bases: dict,
                     ranks: list[int], predict) -> tuple[dict, float]:
        """({(rank, alpha): held-out squared error summed over the folds}, their total sum
        of squares) of one (bits, weighting). ``fold`` (R,) each request's fold;
        ``bases`` caches each fold's (mean, basis) of its training targets (they do not
        depend on the features); ``predict(train, held_out, mean, basis)`` yields (alpha,
        (R_v, rank_max) predicted coordinates in the basis) per alpha.

        The basis rows are orthonormal: the error of a rank-r linear prediction is the
        residual outside the first r directions plus the error inside them, computed in
        the reduced space (selection is by the prediction before clipping, which changes
        little and would cost an (R, L·E) pass per candidate; the reported held-out
        figures clip)."""
        sse = {(r, a): 0.0 for r in ranks for a in self.alphas}
        sst = 0.0
        for f in range(self.folds):
            tr, va = np.flatnonzero(fold != f), np.flatnonzero(fold == f)
            if f not in bases:
                m = target[tr].mean(axis=0)
                bases[f] = (m, _target_basis(target[tr] - m, max(self.ranks)))
            mean, basis = bases[f]
            yv = target[va] - mean
            proj = yv @ basis.T  # (R_v, rank_max)
            total = float((yv ** 2).sum())
            inside = np.cumsum((proj ** 2).sum(axis=0))
            sst += total
            for a, z in predict(tr, va, mean, basis):
                err = np.cumsum(((proj - z) ** 2).sum(axis=0))
                for r in ranks:
                    rr = min(r, basis.shape[0])
                    sse[(r, a)] += total - inside[rr - 1] + err[rr - 1]
        return sse, sst

    def _choose(self, grid: list[dict]) -> dict:
        """The cheapest candidate (fewest buckets, lowest rank, most regularised) within
        ``tolerance`` of the best R²: a bigger predictor must earn its bytes and its µs."""
        if not grid:
            raise ValueError(f"no candidate fits max_bytes={self.max_bytes} (bits "
                             f"{self.bits}, ranks {self.ranks})")
        top = max(g["r2"] for g in grid)
        return min((g for g in grid if g["r2"] >= top - self.tolerance),
                   key=lambda g: (g["bits"], g["rank"], -g["alpha"], -g["r2"]))

    def _refit(self, best: dict, target: np.ndarray, features: dict,
               tokens: TokenData | None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The chosen candidate fitted on every request, float64: (basis (r, L·E), weights
        (2**bits, r), intercept (L·E,), idf (2**bits,))."""
        bits, rank, alpha = best["bits"], best["rank"], best["alpha"]
        mean = target.mean(axis=0)
        yc = target - mean
        basis = _target_basis(yc, rank)
        if best["weighting"] == "token":
            everyone = np.arange(target.shape[0])
            weights = dense_table(tokens.tables(everyone, bits, basis, mean, alpha),
                                   1 << bits)
            return basis, weights, mean, np.ones(1 << bits)
        weights, intercept, idf = ridge(features[bits, best["weighting"]], bits, yc,
                                              basis, mean, alpha)
        return basis, weights, intercept, idf

    # -- predict ------------------------------------------------------------------------------
    def check_tokenizer(self, fingerprint: str | None) -> None:
        """Refuse another tokenizer: ValueError when both fingerprints are known and
        differ (an unknown one, "" or None, on either side is accepted)."""
        self._check_fitted()
        if fingerprint and self.tokenizer_fingerprint and fingerprint != \
                self.tokenizer_fingerprint:
            raise ValueError(
                f"prompt predictor was fitted for tokenizer {self.tokenizer_fingerprint[:12]}…, "
                f"not {fingerprint[:12]}… (another model or vocabulary): refit it")

    def predict(self, token_ids, *, kernel: str = "auto") -> np.ndarray:
        """(P,) int token ids -> (L, E) float32 expected per-token prefill profile (each
        layer's row sums to ``top_k``). ValueError on an empty prompt, ids outside
        ``[0, id_limit)`` (:attr:`id_limit`), non-integer input.

        ``kernel``: ``auto`` the compiled kernel (:func:`compiled_kernels`) when it
        loads, else numpy; ``numpy``; ``compiled`` (ValueError when it does not load).
        Both give the same profile up to float32 summation order."""
        self._check_fitted()
        if kernel != "numpy":
            if kernel not in KERNELS:
                raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
            compiled = compiled_kernels()
            if compiled is not None:
                y = self._predict_compiled(compiled, token_ids)
                if y is not None:
                    return y
            elif kernel == "compiled":
                raise ValueError("the compiled prompt-prediction kernel is not available "
                                 "(numba missing or failing: see the log)")
        ids = check_token_ids(token_ids, self.id_limit, self._id_limit_named())
        hashes = ngram_hashes(ids)
        table, basis = self._numpy_arrays()
        if self.weighting_ == "tfidf":  # repeated n-grams aggregated first (a sort)
            rows, w = feature_row(hashes, self.bits_, self.idf_, self.weighting_)
            z = w @ np.take(table, rows, axis=0)
        else:  # tf, token: Σ_b (count_b / n) W[b] = (Σ W[b]) / n over the n-grams (tf) or
            # the P tokens (token): no aggregation. np.take and a BLAS dot, not fancy
            # indexing and .sum(0) (docs/fit-and-routing.md, "Layout choices, each alone")
            hashes >>= np.uint64(64 - self.bits_)  # buckets < 2**24: exact as int64
            rows = hashes.view(np.int64)
            z = _ones(rows.size) @ np.take(table, rows, axis=0, mode="clip")
            z *= np.float32(1.0 / (rows.size if self.weighting_ == "tf" else ids.size))
        y = z[:self.rank_] @ basis  # (rank,) of the padded row's (rank') sums
        y += self.mean_
        return _finish(y.reshape(self.num_layers, self.num_experts), self.top_k)

    def _predict_compiled(self, compiled, token_ids) -> np.ndarray | None:
        """:meth:`predict` by the compiled kernels; None for input numpy's checks must
        name (not a 1-D integer array, empty, an id outside the vocabulary)."""
        ids = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            return None
        if ids.dtype != np.int64 or not ids.flags.c_contiguous:
            if ids.dtype == np.uint64 and ids.size and int(ids.max()) >= 1 << 62:
                return None
            ids = np.ascontiguousarray(ids, dtype=np.int64)
        shift = 64 - self.bits_
        vocab = self.id_limit
        scale = np.float32(self.weights_scale_)
        if self.weighting_ == "tfidf":
            y, ok = compiled.predict_tfidf(ids, self._row_bits, scale, self.idf_, shift,
                                           vocab, self._basis_bits, self.mean_,
                                           self.num_layers, self.top_k,
                                           _bucket_counts(self.bits_))
        else:
            y, ok = compiled.predict_bag(ids, self._row_bits, scale, shift, vocab,
                                         self.weighting_ == "token", self._basis_bits,
                                         self.mean_, self.num_layers, self.top_k)
        if not ok:
            return None
        return y.reshape(self.num_layers, self.num_experts)

    def predict_many(self, prompts: Sequence) -> np.ndarray:
        """(R, L, E) float32: :meth:`predict` of each prompt."""
        self._check_fitted()
        out = np.empty((len(prompts), self.num_layers, self.num_experts), dtype=np.float32)
        for i, p in enumerate(prompts):
            out[i] = self.predict(p)
        return out

    def predict_trace(self, trace: Trace) -> np.ndarray:
        """(R, L, E) float32 predicted profiles of a trace's prompts (needs
        ``prompt_token_ids``; an empty prompt is refused like :meth:`predict`)."""
        if trace.prompt_token_ids is None:
            raise ValueError("trace has no prompt_token_ids")
        return self.predict_many([trace.prompt_tokens(r) for r in range(trace.num_requests)])

    # -- persistence ------------------------------------------------------------------------
    def summary(self) -> dict:
        """JSON-able: the choice, its cross-validated R², the grid, size and fit time."""
        self._check_fitted()
        return {"bits": self.bits_, "weighting": self.weighting_, "rank": self.rank_,
                "alpha": self.alpha_, "cv_r2": round(self.cv_r2_, 6),
                "num_requests": self.num_requests_,
                "bytes": self.nbytes, "fit_seconds": round(self.fit_seconds_, 4),
                "grid": [{**g, "r2": round(g["r2"], 6)} for g in self.grid_]}

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON-able document, arrays): everything :meth:`from_state` rebuilds it from."""
        self._check_fitted()
        doc = {"hash": HASH_NAME, "num_layers": self.num_layers,
               "num_experts": self.num_experts, "top_k": self.top_k,
               "vocab_size": self.vocab_size, "vocab_source": self.vocab_source,
               "tokenizer_fingerprint": self.tokenizer_fingerprint,
               "bits": self.bits_, "weighting": self.weighting_, "rank": self.rank_,
               "alpha": self.alpha_, "weights_scale": self.weights_scale_,
               "fit": {k: v for k, v in self.summary().items() if k != "grid"}}
        arrays = {"idf": self.idf_, "weights": np.ascontiguousarray(self._half_weights),
                  "basis": self.basis_, "mean": self.mean_}
        return doc, arrays

    @staticmethod
    def array_shapes(doc: dict) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """name -> (shape, dtype) the arrays of a validated :meth:`state` document have:
        the table and the basis half floats, or float32 in a document without
        ``weights_scale`` (written by an older eldr; rounded to half floats on load)."""
        b, r, n = 1 << doc["bits"], doc["rank"], doc["num_layers"] * doc["num_experts"]
        f4 = np.dtype("<f4")
        big = _HALF if "weights_scale" in doc else f4
        return {"idf": ((b,), f4), "weights": ((b, r), big), "basis": ((r, n), big),
                "mean": ((n,), f4)}

    @staticmethod
    def check_document(doc) -> dict:
        """The :meth:`state` document validated (types and ranges), or ValueError."""
        if not isinstance(doc, dict):
            raise ValueError("prompt_predictor must be an object")
        if doc.get("hash") != HASH_NAME:
            raise ValueError(f"prompt_predictor.hash {doc.get('hash')!r} is not "
                             f"{HASH_NAME!r} (made by another eldr)")
        for name in ("num_layers", "num_experts", "top_k", "vocab_size", "bits", "rank"):
            v = doc.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"prompt_predictor.{name} must be a positive integer, "
                                 f"got {v!r}")
        if not 8 <= doc["bits"] <= _MAX_BITS:
            raise ValueError(f"prompt_predictor.bits must be in [8, {_MAX_BITS}], got "
                             f"{doc['bits']}")
        if doc["vocab_size"] > 1 << 31 or doc["top_k"] > doc["num_experts"]:
            raise ValueError("prompt_predictor: implausible vocab_size or top_k")
        if doc["rank"] > 4096 or doc["num_layers"] * doc["num_experts"] > 1 << 22:
            raise ValueError("prompt_predictor: implausibly large rank or model")
        if doc.get("weighting") not in WEIGHTINGS:
            raise ValueError(f"prompt_predictor.weighting must be one of {WEIGHTINGS}, got "
                             f"{doc.get('weighting')!r}")
        fp = doc.get("tokenizer_fingerprint")
        if not isinstance(fp, str) or len(fp) > 128:
            raise ValueError("prompt_predictor.tokenizer_fingerprint must be a short string")
        if doc.get("vocab_source", "calibration") not in VOCAB_SOURCES:
            raise ValueError(f"prompt_predictor.vocab_source must be one of {VOCAB_SOURCES}, "
                             f"got {doc.get('vocab_source')!r}")
        a = doc.get("alpha")
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (
                np.isfinite(a) and a > 0):
            raise ValueError(f"prompt_predictor.alpha must be a positive number, got {a!r}")
        if "weights_scale" in doc:
            s = doc["weights_scale"]
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not (
                    np.isfinite(s) and s > 0 and np.frexp(s)[0] == 0.5):
                raise ValueError(f"prompt_predictor.weights_scale must be a positive power "
                                 f"of two, got {s!r}")
        return doc

    @classmethod
    def from_state(cls, doc: dict, arrays: dict[str, np.ndarray]) -> PromptPredictor:
        """Rebuild a fitted predictor, validating the document and every array."""
        doc = cls.check_document(doc)
        shapes = cls.array_shapes(doc)
        for name, (shape, dtype) in shapes.items():
            arr = arrays.get(name)
            if arr is None or arr.shape != shape or arr.dtype != dtype:
                got = None if arr is None else (arr.shape, str(arr.dtype))
                raise ValueError(f"prompt predictor array {name}: expected {shape} {dtype}, "
                                 f"got {got}")
            if not np.isfinite(arr).all():
                raise ValueError(f"prompt predictor array {name} contains NaN or Inf")
        if (arrays["idf"] < 0).any():
            raise ValueError("prompt predictor idf must be non-negative")
        p = cls(bits=(doc["bits"],), ranks=(doc["rank"],), alphas=(float(doc["alpha"]),),
                weightings=(doc["weighting"],))
        p.num_layers, p.num_experts, p.top_k = doc["num_layers"], doc["num_experts"], \
            doc["top_k"]
        p.vocab_size, p.tokenizer_fingerprint = doc["vocab_size"], doc["tokenizer_fingerprint"]
        # written before vocab_source was (an older eldr): a vocabulary came with its
        # tokenizer's fingerprint, or else from the calibration's largest id
        p.vocab_source = doc.get("vocab_source") or (
            "tokenizer" if p.tokenizer_fingerprint else "calibration")
        p.bits_, p.rank_, p.alpha_ = doc["bits"], doc["rank"], float(doc["alpha"])
        p.weighting_ = doc["weighting"]
        p.idf_, p.mean_ = arrays["idf"], arrays["mean"]
        if "weights_scale" in doc:
            p._store_half(arrays["weights"], float(doc["weights_scale"]), arrays["basis"])
        else:  # float32, from an older eldr
            p._store(arrays["weights"], arrays["basis"])
        fit = doc.get("fit") if isinstance(doc.get("fit"), dict) else {}
        cv = fit.get("cv_r2")
        p.cv_r2_ = float(cv) if isinstance(cv, (int, float)) and not isinstance(cv, bool) \
            else float("nan")
        p.grid_ = fit.get("grid", []) if isinstance(fit.get("grid"), list) else []
        n = fit.get("num_requests")
        p.num_requests_ = n if isinstance(n, int) and not isinstance(n, bool) else 0
        secs = fit.get("fit_seconds")
        p.fit_seconds_ = float(secs) if isinstance(secs, (int, float)) else float("nan")
        return p
