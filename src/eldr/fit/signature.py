"""Expert signatures and their quality objective ρ (docs/method.md#expert-signature).

A request's signature is built from its prefill expert activations: per MoE layer ``l`` in
a layer mask ``S``, a length-``E`` feature row (counts, counts·IDF, ...), concatenated and
L2-normalised. Requests whose signatures are close should have close DECODE expert
patterns: that is what lets the router co-locate them. ρ (Eq. 1) measures exactly that, as
the Spearman correlation between pairwise cosine distances of signatures and of decode
patterns, and every offline choice (representation, IDF, layer mask) is made by ρ.

Empty requests. A request with no prefill selections (an empty prompt), or whose selected
experts all carry zero IDF weight, has an all-zero feature vector. Its signature is the
all-zero row, never NaN: its cosine similarity to every centroid is 0 and its cosine
distance to every other request is 1. Routers treat it like any other signature; the
locality band then usually contains every worker (pure load balancing).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eldr.fit.rows import unit_rows
from eldr.traces.trace import Trace

__all__ = ["REPRESENTATIONS", "SignatureEncoder", "pairwise_cosine_distance", "rho"]

REPRESENTATIONS = ("count", "count_idf", "sqrt_count", "binary", "gate_prob", "gate_logit")
_GATE_INPUT = {"gate_prob": "prefill_gate_prob", "gate_logit": "prefill_gate_logit"}


# -- ρ ------------------------------------------------------------------------------------
def _pairs(n: int, max_pairs: int | None, random_state) -> tuple[np.ndarray, np.ndarray]:
    """Pair index arrays (i < j): all pairs, or a seeded uniform sample of ``max_pairs``."""
    total = n * (n - 1) // 2
    if max_pairs is None or max_pairs >= total:
        return np.triu_indices(n, k=1)
    if max_pairs < 2:
        raise ValueError(f"max_pairs must be >= 2, got {max_pairs}")
    rng = np.random.default_rng(random_state)
    flat = np.sort(rng.choice(total, size=max_pairs, replace=False))
    # Invert the row-major enumeration of the strict upper triangle.
    i = (n - 2 - np.floor(np.sqrt(-8.0 * flat + 4.0 * n * (n - 1) - 7) / 2.0 - 0.5)).astype(
        np.int64
    )
    j = flat + i + 1 - n * (n - 1) // 2 + (n - i) * ((n - i) - 1) // 2
    return i, j.astype(np.int64)


def pairwise_cosine_distance(x: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Cosine distances ``1 - cos(x[i], x[j])`` (P,) float64 for rows of x (N, d).

    All-zero rows have cosine 0 with everything (distance 1), by convention.
    """
    u = unit_rows(x)
    n = u.shape[0]
    if i.size * 4 >= n * n:  # dense enough: one Gram matrix (BLAS) beats gathering rows
        return 1.0 - (u @ u.T)[i, j]
    out = np.empty(i.size)
    # Gather a few hundred KB of rows at a time: they stay in cache for the einsum (chunks
    # of 128 MB went out to memory and back: commit 168cdce timed both); every pair's dot
    # is the same.
    step = max(1, (1 << 15) // max(u.shape[1], 1))
    for start in range(0, i.size, step):
        sl = slice(start, start + step)
        out[sl] = 1.0 - np.einsum("pd,pd->p", u[i[sl]], u[j[sl]])
    return out


def _rankdata(x: np.ndarray) -> np.ndarray:
    """Average ranks (1-based, ties share their mean rank), like scipy's ``rankdata``."""
    n = x.shape[0]
    order = np.argsort(x)  # any sort order works: tied values share their average rank
    xs = x[order]
    is_new = np.empty(n, dtype=bool)
    is_new[:1] = True
    np.not_equal(xs[1:], xs[:-1], out=is_new[1:])
    group = np.cumsum(is_new) - 1
    starts = np.flatnonzero(is_new)
    sizes = np.diff(np.append(starts, n))
    avg = starts + (sizes + 1) / 2.0
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = avg[group]
    return ranks


def _pearson(a: np.ndarray, b_centered: np.ndarray, b_norm: float) -> float:
    # einsum, not BLAS dot: a multi-threaded BLAS on a busy machine hands each large dot
    # between its threads, waiting for cores; einsum stays on this thread.
    a = a - a.mean()
    den = np.sqrt(np.einsum("i,i->", a, a)) * b_norm
    return float(np.einsum("i,i->", a, b_centered) / den) if den > 0 else float("nan")


def rho(
    signatures: np.ndarray,
    decode_counts: np.ndarray,
    *,
    max_pairs: int | None = None,
    random_state=None,
) -> float:
    """ρ (docs/method.md Eq. 1): Spearman(cosdist(s_i, s_j), cosdist(p_i, p_j)) over pairs i < j.

    signatures: (R, d) any real rows (re-normalised here). decode_counts: (R, L, E) or
    (R, L*E) decode expert counts over ALL layers. Exact on all R(R-1)/2 pairs by default;
    ``max_pairs`` draws a seeded uniform sample of pairs for large R. Ties get average ranks,
    so the value equals ``scipy.stats.spearmanr`` on the same pair lists. NaN when either
    distance list is constant (no ranking information).
    """
    s = np.asarray(signatures)
    p = np.asarray(decode_counts)
    if s.ndim != 2:
        raise ValueError(f"rho: signatures must be 2-D (R, d), got shape {s.shape}")
    p = p.reshape(p.shape[0], -1) if p.ndim >= 2 else p
    if p.ndim != 2 or p.shape[0] != s.shape[0]:
        raise ValueError(
            f"rho: decode_counts must have R={s.shape[0]} rows, got shape {np.shape(decode_counts)}"
        )
    if s.shape[0] < 3:
        raise ValueError(f"rho needs at least 3 requests, got {s.shape[0]}")
    for name, arr in (("signatures", s), ("decode_counts", p)):
        if not np.isfinite(arr).all():
            raise ValueError(f"rho: {name} contains NaN or Inf")
    i, j = _pairs(s.shape[0], max_pairs, random_state)
    rb = _rankdata(pairwise_cosine_distance(p, i, j))
    rb -= rb.mean()
    ra = _rankdata(pairwise_cosine_distance(s, i, j))
    return _pearson(ra, rb, float(np.sqrt(np.einsum("i,i->", rb, rb))))


# -- the encoder --------------------------------------------------------------------------
class SignatureEncoder:
    """Prefill expert activations → unit signature rows (scikit-learn contract).

    Parameters
    ----------
    representation: one of ``REPRESENTATIONS``; ``count_idf`` (default) weights counts by
        the IDF of each (layer, expert) over the calibration set, ``gate_prob``/``gate_logit``
        use the summed gate outputs stored in the trace.
    layers: the layer mask S to use; ``None`` selects it greedily by ρ in ``fit``.
    max_pairs: pairs used for the reported ``rho_`` (``None``: all pairs, exact).
    selection_max_pairs: pairs used while searching the layer mask. The greedy search
        evaluates ρ for every remaining layer at every step (hundreds of evaluations), so by
        default it ranks a seeded sample of 20,000 pairs (against all pairs on a calibrated
        Qwen3-30B trace: docs/fit-and-routing.md, "Signatures and ρ"); ``None`` uses all
        pairs.
    min_gain: a layer joins the mask only if it raises ρ by more than this. "Stop when no
        layer raises ρ" taken literally keeps adding layers whose gain is sampling noise
        (a noise layer moves ρ by ±1e-4); 1e-3 is well below any real layer's gain.
    random_state: seed for pair sampling.

    Fitted attributes: ``idf_`` (L, E) float64 with w = log((N+1)/(df+1)); ``layers_``
    (|S|,) int64 sorted; ``rho_`` (ρ of the fitted encoder on the fit set);
    ``rho_curve_`` list of (layer, ρ) in the order layers were added (empty when ``layers``
    was given); ``num_layers_``, ``num_experts_``, ``n_features_out_`` = |S|·E.
    """

    def __init__(
        self,
        *,
        representation: str = "count_idf",
        layers: Sequence[int] | None = None,
        max_pairs: int | None = None,
        selection_max_pairs: int | None = 20_000,
        min_gain: float = 1e-3,
        random_state=None,
    ) -> None:
        self.representation = representation
        self.layers = layers
        self.max_pairs = max_pairs
        self.selection_max_pairs = selection_max_pairs
        self.min_gain = min_gain
        self.random_state = random_state

    # -- sklearn-ish plumbing ------------------------------------------------------------
    def get_params(self) -> dict:
        return {
            "representation": self.representation,
            "layers": self.layers,
            "max_pairs": self.max_pairs,
            "selection_max_pairs": self.selection_max_pairs,
            "min_gain": self.min_gain,
            "random_state": self.random_state,
        }

    def _check_fitted(self) -> None:
        if not hasattr(self, "idf_"):
            raise ValueError("SignatureEncoder is not fitted: call fit(trace) first")

    def _raw(self, trace: Trace) -> np.ndarray:
        """(R, L, E) float64 raw input of the representation from a trace."""
        trace.require_prefill("a prefill signature")
        name = _GATE_INPUT.get(self.representation)
        if name is None:
            return trace.prefill_counts.astype(np.float64)
        arr = getattr(trace, name)
        if arr is None:
            raise ValueError(
                f"representation {self.representation!r} needs trace field {name!r}, "
                f"which this trace ({trace.meta.source}) does not have"
            )
        return arr.astype(np.float64)

    def _features(self, raw: np.ndarray, idf: np.ndarray) -> np.ndarray:
        """Representation transform of raw (R, L, E) input, before masking/normalising."""
        rep = self.representation
        if rep == "count_idf":
            return raw * idf
        if rep == "sqrt_count":
            return np.sqrt(raw)
        if rep == "binary":
            return (raw > 0).astype(np.float64)
        return raw  # count, gate_prob, gate_logit

    # -- fit / transform -----------------------------------------------------------------
    def fit(self, trace: Trace, y=None) -> SignatureEncoder:
        """Learn IDF weights and (unless given) the layer mask by greedy forward ρ search."""
        if self.representation not in REPRESENTATIONS:
            raise ValueError(
                f"unknown representation {self.representation!r}; "
                f"choose one of {', '.join(REPRESENTATIONS)}"
            )
        if not isinstance(trace, Trace):
            raise ValueError(f"fit expects an eldr Trace, got {type(trace).__name__}")
        trace.require_prefill("the signature encoder (IDF, layer mask by rho)")
        R, L, E = trace.prefill_counts.shape
        if R < 3:
            raise ValueError(f"fit needs at least 3 requests, got {R}")
        df = (trace.prefill_counts > 0).sum(axis=0)
        self.idf_ = np.log((R + 1.0) / (df + 1.0))
        self.num_layers_, self.num_experts_ = L, E
        feats = self._features(self._raw(trace), self.idf_)
        if self.layers is not None:
            layers = np.unique(np.asarray(self.layers, dtype=np.int64))
            if layers.size == 0 or layers.min() < 0 or layers.max() >= L:
                raise ValueError(
                    f"layers must be a non-empty subset of [0, {L}), got {self.layers}"
                )
            self.layers_ = layers
            self.rho_curve_: list[tuple[int, float]] = []
        else:
            self.layers_, self.rho_curve_ = _greedy_layers(
                feats, trace.decode_counts, self.selection_max_pairs, self.random_state,
                self.min_gain,
            )
        self.n_features_out_ = int(self.layers_.size * E)
        self.rho_ = rho(
            self._normalise(feats), trace.decode_counts,
            max_pairs=self.max_pairs, random_state=self.random_state,
        )
        return self

    def _normalise(self, feats: np.ndarray) -> np.ndarray:
        x = feats[:, self.layers_, :].reshape(feats.shape[0], -1)
        return unit_rows(x).astype(np.float32)

    def transform(self, X) -> np.ndarray:
        """Signatures: float32 unit rows (R, |S|·E), or (|S|·E,) for a single (L, E) input.

        X is a Trace, or the representation's raw input as an array: prefill counts for the
        count-based representations, summed gate outputs for ``gate_prob``/``gate_logit``.
        """
        self._check_fitted()
        if isinstance(X, Trace):
            raw = self._raw(X)
        else:
            raw = np.asarray(X, dtype=np.float64)
        single = raw.ndim == 2
        if single:
            raw = raw[None]
        if raw.ndim != 3 or raw.shape[1:] != (self.num_layers_, self.num_experts_):
            raise ValueError(
                f"encoder was fitted for (L, E) = ({self.num_layers_}, {self.num_experts_}); "
                f"got input of shape {np.shape(X) if not isinstance(X, Trace) else raw.shape}"
            )
        if not np.isfinite(raw).all():
            raise ValueError("signature input contains NaN or Inf")
        if self.representation not in _GATE_INPUT and (raw < 0).any():
            raise ValueError("signature input contains negative counts")
        out = self._normalise(self._features(raw, self.idf_))
        return out[0] if single else out

    def transform_one(self, counts: np.ndarray) -> np.ndarray:
        """(|S|·E,) float32 signature of one request's (L, E) counts: ``transform(counts)``,
        bit for bit, at a fifth of its cost — the router encodes every prompt with it.

        Counts of a count representation, integer or float (a prompt prediction's
        expected profile), take a direct path: only the mask's layers are transformed (the
        representations are elementwise, the norm is taken over the mask), in the same
        float64 arithmetic as :meth:`transform` (the same einsum for the norm), without
        its generic copies (docs/fit-and-routing.md has the cost). Anything else (the gate
        representations, a wrong shape, not an array) goes through :meth:`transform`, and
        so do its errors: negative counts, NaN or Inf anywhere raise ``ValueError`` either
        way.
        """
        direct = self._direct_path()
        kind = counts.dtype.kind if type(counts) is np.ndarray else None
        if kind not in ("i", "u", "f") or direct is None or counts.shape != direct[2]:
            return self.transform(counts)
        layers, idf, _, _ = direct
        if kind == "f":  # a predicted profile: transform's checks, over every layer
            if not np.isfinite(counts).all():
                raise ValueError("signature input contains NaN or Inf")
            if (counts < 0).any():
                raise ValueError("signature input contains negative counts")
            x = counts[layers].astype(np.float64)
        else:
            if kind == "i" and counts.min() < 0:
                raise ValueError("signature input contains negative counts")
            x = counts[layers]
        rep = self.representation
        if rep == "count_idf":
            feats = x * idf
        elif rep == "sqrt_count":
            feats = np.sqrt(x, dtype=np.float64)
        elif rep == "binary":
            feats = (x > 0).astype(np.float64)
        else:
            feats = x.astype(np.float64)
        flat = feats.reshape(1, -1)
        norm = np.sqrt(np.einsum("ij,ij->i", flat, flat))[0]
        if not norm > 0:
            return np.zeros(flat.shape[1], dtype=np.float32)
        return (flat[0] / norm).astype(np.float32)

    def _direct_path(self) -> tuple | None:
        """(layers (|S|,) intp, idf[layers] (|S|, E) float64, (L, E), the state it was made
        from) for :meth:`transform_one`, or None for a gate representation. Made once per
        fitted state: a refit or :meth:`from_state` replaces ``idf_`` and ``layers_``, and
        the identity check below notices it."""
        cached = self.__dict__.get("_direct")
        if cached is not None and cached[3][0] is self.idf_ and cached[3][1] is self.layers_ \
                and cached[3][2] == self.representation:
            return cached
        self._check_fitted()
        if self.representation in _GATE_INPUT:
            return None
        layers = np.asarray(self.layers_, dtype=np.intp)
        idf = np.asarray(self.idf_, dtype=np.float64)[layers]
        self._direct = (layers, idf, (int(self.num_layers_), int(self.num_experts_)),
                        (self.idf_, self.layers_, self.representation))
        return self._direct

    def fit_transform(self, trace: Trace, y=None) -> np.ndarray:
        return self.fit(trace).transform(trace)

    # -- persistence ---------------------------------------------------------------------
    def state(self) -> dict:
        """JSON-able scalars plus numpy arrays: everything needed to rebuild the encoder."""
        self._check_fitted()
        return {
            "representation": self.representation,
            "num_layers": int(self.num_layers_),
            "num_experts": int(self.num_experts_),
            "layers": self.layers_.copy(),
            "idf": self.idf_.copy(),
            "rho": float(self.rho_),
            "rho_curve": [[int(layer), float(r)] for layer, r in self.rho_curve_],
        }

    @classmethod
    def from_state(cls, state: dict) -> SignatureEncoder:
        """Rebuild a fitted encoder from :meth:`state`, validating every field."""
        try:
            rep = state["representation"]
            L, E = int(state["num_layers"]), int(state["num_experts"])
            layers = np.asarray(state["layers"], dtype=np.int64)
            idf = np.asarray(state["idf"], dtype=np.float64)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"encoder state is incomplete or malformed: {exc!r}") from exc
        if rep not in REPRESENTATIONS:
            raise ValueError(f"encoder state: unknown representation {rep!r}")
        if idf.shape != (L, E):
            raise ValueError(f"encoder state: idf has shape {idf.shape}, expected ({L}, {E})")
        if not np.isfinite(idf).all() or (idf < 0).any():
            raise ValueError("encoder state: idf must be finite and non-negative")
        if layers.ndim != 1 or layers.size == 0 or layers.min() < 0 or layers.max() >= L:
            raise ValueError(f"encoder state: layers must be a non-empty subset of [0, {L})")
        if (np.diff(layers) <= 0).any():
            raise ValueError("encoder state: layers must be sorted and unique")
        enc = cls(representation=rep, layers=layers.tolist())
        enc.idf_, enc.layers_ = idf, layers
        enc.num_layers_, enc.num_experts_ = L, E
        enc.n_features_out_ = int(layers.size * E)
        enc.rho_ = float(state.get("rho", float("nan")))
        enc.rho_curve_ = [(int(a), float(b)) for a, b in state.get("rho_curve", [])]
        return enc


def _greedy_layers(
    feats: np.ndarray, decode_counts: np.ndarray, max_pairs: int | None, random_state,
    min_gain: float = 0.0,
) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """Greedy forward selection of layers by ρ; stop when no layer raises it.

    Incremental: the cosine of a pair under mask S ∪ {l} needs only the per-layer pair dot
    products and per-layer squared norms, so each candidate costs O(P) plus one ranking.
    feats (R, L, E) float64; decode_counts (R, L, E).
    """
    R, L, _ = feats.shape
    i, j = _pairs(R, max_pairs, random_state)
    rb = _rankdata(pairwise_cosine_distance(decode_counts.reshape(R, -1), i, j))
    rb -= rb.mean()
    rb_norm = float(np.sqrt(np.einsum("i,i->", rb, rb)))
    sq_norms = np.einsum("rle,rle->lr", feats, feats)  # (L, R)
    pair_dots = np.empty((L, i.size))
    for layer in range(L):
        x = feats[:, layer, :]
        pair_dots[layer] = (x @ x.T)[i, j] if i.size > 2 * R else np.einsum(
            "pe,pe->p", x[i], x[j]
        )
    chosen: list[int] = []
    curve: list[tuple[int, float]] = []
    dot_s = np.zeros(i.size)
    norm_s = np.zeros(R)
    best_rho = -np.inf
    while len(chosen) < L:
        best_layer, best_val = None, best_rho + (min_gain if chosen else 0.0)
        for layer in range(L):
            if layer in chosen:
                continue
            norm = norm_s + sq_norms[layer]
            den = np.sqrt(norm[i] * norm[j])
            cos = np.divide(dot_s + pair_dots[layer], den, out=np.zeros_like(den), where=den > 0)
            val = _pearson(_rankdata(1.0 - cos), rb, rb_norm)
            if val > best_val:  # strict: ties keep the lower layer index
                best_layer, best_val = layer, val
        if best_layer is None:
            break
        chosen.append(best_layer)
        curve.append((best_layer, best_val))
        dot_s += pair_dots[best_layer]
        norm_s += sq_norms[best_layer]
        best_rho = best_val
    if not chosen:  # every single layer gave NaN ρ (e.g. constant distances): keep all
        return np.arange(L, dtype=np.int64), curve
    return np.array(sorted(chosen), dtype=np.int64), curve
