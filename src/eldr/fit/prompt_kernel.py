"""The prompt predictor's prediction, compiled (numba), with numpy as the fallback.

:meth:`eldr.fit.prompt.PromptPredictor.predict` is three passes over memory: hash the
prompt's 2P − 1 n-grams, gather and sum one weight row per n-gram, multiply the rank-r sum
by the (r, L·E) basis and clip / rescale each layer's row. In numpy each pass is a few
calls over arrays the size of the prompt (the gather alone materialises a (2P − 1, r) float32
copy of the rows it reads); here the first two are one loop that never stores the hashes
nor the gathered rows, and the last is one loop over the output, so a prediction reads the
rows and the basis once and writes only its (L, E) answer. The kernels release the GIL
(``nogil``): predictions on a thread pool run beside the event loop.

The rows and the basis are IEEE half floats (the predictor stores them so:
:class:`eldr.fit.prompt.PromptPredictor`), passed as their uint16 bits and widened to
float32 as they are read (:func:`_f32`, one ``vcvtph2ps`` per eight values on an x86 CPU
with F16C); every sum is float32. A prediction is bound by the bytes it reads (the gather
touches one row per n-gram at random, the product streams the whole basis), and half
floats halve them (docs/fit-and-routing.md, "what bounds a prediction"); the random reads
are asked for :data:`_AHEAD` n-grams before their use (:func:`_prefetch`), since no
hardware prefetcher can guess them.

numba is an optional extra (``pip install -e '.[serve]'``); this module imports it, and
:func:`eldr.fit.prompt.compiled_kernels` imports this one: without numba, or when the
kernels fail to compile, predictions stay on numpy (said once in the log). Both paths
compute the same float32 arithmetic up to summation order: they agree within 1e-6
absolute on every profile entry (tests/test_prompt_kernel.py). The feature hash is
:func:`eldr.fit.prompt.ngram_hashes`' (same constants, same keys).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["COUNT_MAX", "predict_bag", "predict_tfidf"]

u64 = np.uint64
_M1, _M2, _S32, _ONE = u64(0x9E3779B97F4A7C15), u64(0xC2B2AE3D27D4EB4F), u64(32), u64(1)
# reassociation lets LLVM vectorise the row sums (the float32 results differ from numpy's
# in the last bits only); nogil: a prediction on a worker thread leaves the loop running
# log1p of the small counts an n-gram has in one prompt, as numpy's float32 log1p gives
# them (a libm call per distinct bucket cost more than the rest of the tfidf path)
_LOG1P = np.log1p(np.arange(256, dtype=np.float32))
_jit = numba.njit(nogil=True, fastmath={"reassoc", "contract"})


def _ro(dtype, ndim: int):
    """A read-only C-contiguous array type: writable arrays convert to it, so ids from
    ``np.frombuffer`` (read-only) and a fitted predictor's own arrays meet ONE compiled
    version."""
    return numba.types.Array(dtype, ndim, "C", readonly=True)


_i64, _f32, _u16 = numba.types.int64, numba.types.float32, numba.types.uint16
# The entry points are compiled for exactly these argument types when this module is
# imported (read from numba's on-disk cache after the first time) and never again: a call
# with other types converts to them or is refused (TypeError), it never compiles on a
# request. And a single version per function is what makes the on-disk cache safe across
# processes: numba's cache numbers each function's versions as processes save them,
# without a lock, so two processes that compiled DIFFERENT versions at once could leave one
# version's entry naming the other's machine code (this module had several versions: one
# read-only ids array compiled anew, seconds, on a router's first text prompt). With one
# version every process writes the same file with the same code.
_BAG = (_ro(_i64, 1), _ro(_u16, 2), _f32, _i64, _i64, numba.types.boolean, _ro(_u16, 2),
        _ro(_f32, 1), _i64, _i64)
_TFIDF = (_ro(_i64, 1), _ro(_u16, 2), _f32, _ro(_f32, 1), _i64, _i64, _ro(_u16, 2),
          _ro(_f32, 1), _i64, _i64, numba.types.Array(_u16, 1, "C"))
_AHEAD = 16
"""How many n-grams ahead of its use a row or a count is prefetched (:func:`_prefetch`):
the rows and counts an n-gram reads lie at random, so the CPU's own prefetchers cannot
guess them, and its reorder window holds only a few rows' loads at once. 8, 16 and 32 gave
the same speed-up on this project's 2-core EPYC (docs/fit-and-routing.md)."""
COUNT_MAX = 65535
"""The largest count the tfidf kernel's uint16 scratch holds: a bucket seen more often (a
prompt of over 32k tokens that repeats one n-gram throughout) is counted again exactly."""


@intrinsic
def _f32(typingctx, bits):
    """float32 value of the IEEE half float whose bits are ``bits`` (uint16): a bit cast
    to LLVM's ``half`` and an exact widening (numba has no float16 type of its own)."""
    sig = numba.types.float32(numba.types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _prefetch(typingctx, arr, i):
    """Ask the CPU to bring ``arr[i]`` (a 2-D array: the row ``arr[i]``'s first line) into
    its caches and go on (LLVM's ``prefetch``, a read kept in every cache level): a hint
    that never faults and changes no value. ``i`` must lie in the array's first axis."""
    sig = numba.types.void(arr, i)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = ir.Constant(ir.IntType(64), 0)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary,
                                       [args[1]] + [zero] * (aryty.ndim - 1))
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0),
                          ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@_jit
def _mix(key):
    """A 64-bit key's hash, as :func:`eldr.fit.prompt.ngram_hashes` mixes it."""
    k = key * _M1
    k ^= k >> _S32
    return k * _M2


@_jit
def _buckets(ids, shift, vocab):
    """(2P − 1,) int64 buckets (hash >> ``shift``) of the P unigrams then P − 1 bigrams of
    ``ids`` (P,) int64, and False when an id is outside [0, ``vocab``) (a negative id
    wraps beyond any vocabulary)."""
    n = ids.size
    out = np.empty(2 * n - 1, dtype=np.int64)
    sh = u64(shift)
    lim = u64(vocab)
    prev = u64(0)
    for i in range(n):
        t = u64(ids[i])
        if t >= lim:
            return out, False
        out[i] = np.int64(_mix(t) >> sh)
        if i > 0:
            out[n + i - 1] = np.int64(_mix(((prev + _ONE) << _S32) | t) >> sh)
        prev = t
    return out, True


@_jit
def _sum_rows(rows, buckets, weights, num):
    """(r',) float32 Σ_i weights[i] · rows[buckets[i]] over i < ``num`` (``weights`` None:
    plain sum); ``rows`` half floats' bits. Four rows per step: the accumulator's chain of
    dependent adds, not the loads, bounds a one-row loop."""
    width = rows.shape[1]
    z = np.zeros(width, dtype=np.float32)
    i = 0
    while i + 4 <= num:
        if i + _AHEAD + 4 <= num:
            _prefetch(rows, buckets[i + _AHEAD])
            _prefetch(rows, buckets[i + _AHEAD + 1])
            _prefetch(rows, buckets[i + _AHEAD + 2])
            _prefetch(rows, buckets[i + _AHEAD + 3])
        r0, r1 = rows[buckets[i]], rows[buckets[i + 1]]
        r2, r3 = rows[buckets[i + 2]], rows[buckets[i + 3]]
        if weights is None:
            for j in range(width):
                z[j] += (_f32(r0[j]) + _f32(r1[j])) + (_f32(r2[j]) + _f32(r3[j]))
        else:
            w0, w1, w2, w3 = weights[i], weights[i + 1], weights[i + 2], weights[i + 3]
            for j in range(width):
                z[j] += (w0 * _f32(r0[j]) + w1 * _f32(r1[j])) \
                    + (w2 * _f32(r2[j]) + w3 * _f32(r3[j]))
        i += 4
    while i < num:
        r0 = rows[buckets[i]]
        w0 = np.float32(1.0) if weights is None else weights[i]
        for j in range(width):
            z[j] += w0 * _f32(r0[j])
        i += 1
    return z


@_jit
def _finish(z, scale, basis, mean, num_layers, top_k):
    """(L·E,) float32 ``mean + scale · z[:rank] @ basis``, clipped at 0, each of the
    ``num_layers`` rows rescaled to sum to ``top_k`` (an all-zero row uniform); ``basis``
    (rank, L·E) half floats' bits. Four basis rows per pass over y: one row per pass made
    y's loads and stores, not the basis stream, the bound."""
    rank, n = basis.shape
    y = mean.copy()
    r = 0
    while r + 4 <= rank:
        z0, z1, z2, z3 = scale * z[r], scale * z[r + 1], scale * z[r + 2], scale * z[r + 3]
        b0, b1, b2, b3 = basis[r], basis[r + 1], basis[r + 2], basis[r + 3]
        for j in range(n):
            y[j] += (z0 * _f32(b0[j]) + z1 * _f32(b1[j])) \
                + (z2 * _f32(b2[j]) + z3 * _f32(b3[j]))
        r += 4
    while r < rank:
        z0, b0 = scale * z[r], basis[r]
        for j in range(n):
            y[j] += z0 * _f32(b0[j])
        r += 1
    E = n // num_layers
    k = np.float32(top_k)
    for ell in range(num_layers):
        seg = y[ell * E:(ell + 1) * E]
        total = np.float32(0.0)
        for j in range(E):
            v = max(seg[j], np.float32(0.0))
            seg[j] = v
            total += v
        if total <= 0:
            for j in range(E):
                seg[j] = k / np.float32(E)
        else:
            f = k / total
            for j in range(E):
                seg[j] *= f
    return y


@numba.njit([_BAG], nogil=True, cache=True, fastmath={"reassoc", "contract"})
def predict_bag(ids, rows, row_scale, shift, vocab, per_token, basis, mean, num_layers,
                top_k):
    """(L·E,) float32 profile of the ``tf`` / ``token`` models: the mean of ``row_scale``
    · ``rows`` (2**bits, r') over the buckets of the prompt's P unigrams and P − 1 bigrams
    (divided by P when ``per_token``, the token model, else by 2P − 1), through
    :func:`_finish`; and
    False when an id of ``ids`` (P,) int64 is outside [0, ``vocab``) (the profile is then
    meaningless: the caller refuses the prompt)."""
    b, ok = _buckets(ids, shift, vocab)
    if not ok:
        return mean.copy(), False  # the same (writable) type as a profile
    z = _sum_rows(rows, b, None, b.size)
    scale = row_scale * np.float32(1.0 / (ids.size if per_token else b.size))
    return _finish(z, scale, basis, mean, num_layers, top_k), True


@_jit
def _count_buckets(b, counts):
    """Count the buckets ``b`` (n,) in ``counts`` (zero on entry) and write the distinct
    ones over the head of ``b``, in order of first use: (how many are distinct, whether a
    count stopped at :data:`COUNT_MAX`). ``b[used]`` is written only after ``b[i]`` was
    read, with ``used <= i``. Fewer n-grams than COUNT_MAX cannot fill a count: the test
    of the bound is loop-invariant then, and LLVM takes it out of the loop."""
    used = 0
    full = False
    bounded = b.size >= COUNT_MAX
    n = b.size
    for i in range(n):
        if i + _AHEAD < n:  # b[i + _AHEAD] is not overwritten yet: used <= i
            _prefetch(counts, b[i + _AHEAD])
        bi = b[i]
        c = counts[bi]
        if c == 0:
            b[used] = bi
            used += 1
        if bounded and c >= COUNT_MAX:
            full = True
        else:
            counts[bi] = c + 1
    return used, full


@_jit
def _exact_count(ids, shift, vocab, bucket):
    """How many of the prompt's n-grams fall in ``bucket`` (the slow path of a count that
    reached :data:`COUNT_MAX`)."""
    b, _ = _buckets(ids, shift, vocab)
    return np.int64(np.count_nonzero(b == bucket))


@numba.njit([_TFIDF], nogil=True, cache=True, fastmath={"reassoc", "contract"})
def predict_tfidf(ids, rows, row_scale, idf, shift, vocab, basis, mean, num_layers, top_k,
                  counts):
    """(L·E,) float32 profile of the ``tfidf`` model: Σ_b w_b · ``row_scale`` · rows[b]
    over the distinct buckets b of the prompt's n-grams, w_b = log1p(count_b) · idf[b] /
    ||w||, through :func:`_finish` (the norm folded into its scale); False for a bad id.

    ``counts`` (≥ 2**bits,) uint16: the calling thread's scratch, all zero on entry and
    again on return (:func:`eldr.fit.prompt._bucket_counts`). Each n-gram's count is one
    increment at its bucket's index: an open-addressing table rebuilt per prompt cost 28
    µs of the 2,048-token prompt's 60 (its probes' branches mispredict on every new
    prompt), this 14."""
    b, ok = _buckets(ids, shift, vocab)
    if not ok:
        return mean.copy(), False  # the same (writable) type as a profile
    used, full = _count_buckets(b, counts)
    w = np.empty(used, dtype=np.float32)
    norm2 = np.float32(0.0)
    for u in range(used):
        bu = b[u]
        c = counts[bu]
        counts[bu] = 0  # the scratch is zero again once every distinct bucket is read
        if c < _LOG1P.size:
            lg = _LOG1P[c]
        elif full and c == COUNT_MAX:
            lg = np.float32(np.log1p(np.float32(_exact_count(ids, shift, vocab, bu))))
        else:
            lg = np.float32(np.log1p(np.float32(c)))
        wu = lg * idf[bu]
        w[u] = wu
        norm2 += wu * wu
    scale = row_scale
    if norm2 > 0:
        scale = row_scale / np.float32(np.sqrt(norm2))
    z = _sum_rows(rows, b, w, used)
    return _finish(z, scale, basis, mean, num_layers, top_k), True
