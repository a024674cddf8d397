"""Samplers behind :mod:`eldr.traces.synth`: per-token top-k routing and its aggregate shortcut.

The token model. A segment of ``n`` tokens (a request's user prompt, a shared system
prompt, or a request's decode tokens) has one logit vector ``z`` (E,) per layer. Token
``t`` gets router logits ``h_t = z + G_t`` with ``G_t`` i.i.d. standard Gumbel noise
(the token-to-token variation of a real router's input), and selects the top-k experts
of ``h_t``. This is Gumbel-top-k, i.e. Plackett-Luce sampling of k distinct experts from
``softmax(z)``. The router's softmax ``p_t = softmax(h_t)`` and the logits ``h_t`` are the
token's gate outputs; they are consistent with the selection by construction (the
selected experts are exactly the k largest logits and the k largest probabilities).

Two ways to produce a trace from it:

* token path (:func:`token_topk`): draws ``h_t`` for every token, keeps the top-k ids;
  counts and gate sums are exact sums over tokens; its cost grows with tokens x layers.
* count path (:func:`aggregate_counts`, :func:`approx_gate_sums`): draws per-segment
  aggregates directly. Counts: each expert's inclusion probability ``π_e`` in the top-k is
  approximated by the exponential-clock (Poisson) formula ``π_e = 1 - exp(-λ w_e)`` with λ
  set so that ``Σ π = k``; counts are ``Binomial(n, π_e)`` with a small multinomial
  fix-up so every layer sums to ``k n`` exactly and no count exceeds ``n``. The mean and
  per-expert variance match the token path to first order (tests check the means). Gate
  sums use the mean softmax and its per-token variance (:func:`approx_gate_sums`). Use the
  token path when exact gate sums or per-token ids matter; the count path is much faster
  (docs/synth.md, "Speed", has both paths timed).
"""

from __future__ import annotations

import numpy as np

__all__ = ["aggregate_counts", "approx_gate_sums", "inclusion_probs", "token_topk"]


def _softmax(z: np.ndarray) -> np.ndarray:
    w = np.exp(z - z.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return w


def inclusion_probs(z: np.ndarray, k: int) -> np.ndarray:
    """(N, E) float64 probabilities that each expert is in a token's top-k.

    Exponential-clock approximation of Plackett-Luce inclusion: ``π = 1 - exp(-λ w)``,
    ``w = softmax(z)``, with λ per row solved by Newton so that every row sums to k.
    """
    w = _softmax(z.astype(np.float64))
    lam = np.full((w.shape[0], 1), float(k))
    for _ in range(30):
        e = np.exp(-lam * w)
        f = (1.0 - e).sum(axis=1, keepdims=True) - k
        fp = (w * e).sum(axis=1, keepdims=True)
        step = f / fp
        lam = np.maximum(lam - step, lam * 0.5)  # Newton, never more than halving λ
        if np.abs(f).max() < 1e-9:
            break
    return -np.expm1(-lam * w)


def _multinomial_rows(rng: np.random.Generator, weights: np.ndarray,
                      amounts: np.ndarray) -> np.ndarray:
    """(N, E) int64: row i is Multinomial(amounts[i], weights[i] / weights[i].sum()).

    Inverse-CDF on one flattened, row-offset cumulative array: cost grows with
    ``amounts.sum()``, not with N x E (numpy's multinomial walks every category).
    """
    N, E = weights.shape
    cum = np.cumsum(weights, axis=1)
    tot = cum[:, -1:].copy()
    tot[tot <= 0] = 1.0
    cum = cum / tot + np.arange(N)[:, None]
    cum[:, -1] = np.arange(1, N + 1)  # exact row ends despite rounding
    rows = np.repeat(np.arange(N), amounts)
    hit = np.searchsorted(cum.ravel(), rows + rng.random(rows.size), side="right")
    hit = np.minimum(hit, rows * E + E - 1)  # stay inside the row
    return np.bincount(hit, minlength=N * E).reshape(N, E)


def aggregate_counts(
    rng: np.random.Generator, pi: np.ndarray, n: np.ndarray, k: int
) -> np.ndarray:
    """(N, E) int32 counts of ``n`` tokens' top-k selections, rows summing to ``k n``.

    pi: (N, E) inclusion probabilities (rows sum to k); n: (N,) token counts.
    Binomial(n, π) per expert, then the row deficit/surplus is added/removed by a
    multinomial spread over the experts' remaining room (capped at n) or current counts.
    """
    n = np.asarray(n, dtype=np.int64)
    c = rng.binomial(n[:, None], pi)
    target = k * n
    room_w = pi * (1.0 - pi) + 1e-12
    for _ in range(20):
        delta = target - c.sum(axis=1)
        if not delta.any():
            break
        add = delta > 0
        if add.any():
            w = room_w[add] * (n[add, None] - c[add] > 0)
            c[add] = np.minimum(c[add] + _multinomial_rows(rng, w, delta[add]), n[add, None])
        rem = delta < 0
        if rem.any():
            w = c[rem] * room_w[rem]
            c[rem] = np.maximum(c[rem] - _multinomial_rows(rng, w, -delta[rem]), 0)
    delta = target - c.sum(axis=1)
    for i in np.flatnonzero(delta):  # rare leftovers: settle deterministically
        for e in np.argsort(-pi[i]):
            if delta[i] == 0:
                break
            move = min(n[i] - c[i, e], delta[i]) if delta[i] > 0 else -min(c[i, e], -delta[i])
            c[i, e] += move
            delta[i] -= move
    return c.astype(np.int32)


def token_topk(
    rng: np.random.Generator, z: np.ndarray, k: int, *, with_gates: bool,
    gate_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Route tokens whose logit rows are ``z`` (T, E): Gumbel-top-k per token.

    Returns ``topk`` (T, k) int16 expert ids in descending logit order, and when
    ``with_gates`` the per-token router logits ``gate_scale * h`` (T, E) float32 and
    probabilities ``softmax(gate_scale * h)`` (T, E) float32 (else None, None). A positive
    scale leaves the top-k unchanged and sets how peaked the router's softmax is.
    """
    # -log(Exp(1)) is standard Gumbel; drawn in float32, the token path's main cost
    # (docs/synth.md, "Speed", times the path)
    h = z.astype(np.float32, copy=True)
    x = rng.standard_exponential(size=h.shape, dtype=np.float32)
    np.maximum(x, np.float32(1e-30), out=x)
    h -= np.log(x)
    E = h.shape[1]
    top = np.argpartition(h, E - k, axis=1)[:, E - k:]
    order = np.argsort(-np.take_along_axis(h, top, axis=1), axis=1)
    top = np.take_along_axis(top, order, axis=1).astype(np.int16)
    if not with_gates:
        return top, None, None
    if gate_scale != 1.0:
        h *= np.float32(gate_scale)
    return top, h, _softmax(h)


def approx_gate_sums(
    rng: np.random.Generator,
    z: np.ndarray,
    n: np.ndarray,
    *,
    gate_scale: float,
    probe_rows: int = 64,
    probe_tokens: int = 32,
    values: bool = True,
) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """Approximate summed gate probabilities and logits (N, E) float32 for the count path.

    For a segment of ``n`` tokens with logits ``z`` and router logits ``c (z + G_t)``
    (``c = gate_scale``):

    * probabilities: the softmax denominator is a sum over E experts and concentrates, so
      ``E[softmax(c (z + G))] ≈ softmax(c z)`` (within a few % for c <= 0.5, checked in
      the tests); the sum over tokens is ``n softmax(c z)`` plus Gaussian noise of
      variance ``n v m_e²``, with ``v`` the per-token relative variance measured on
      ``probe_rows`` rows x ``probe_tokens`` tokens of the token model;
    * logits: ``c (n (z + γ) + sqrt(n π²/6) N(0, 1))``, the exact mean and variance of
      the sum of n Gumbel-perturbed logits.

    The coupling between a token's gate outputs and its own top-k selection is not
    reproduced; the sums are nearly deterministic in ``z`` anyway (a relative spread of a
    few % for a 200-token prompt). Refused for ``gate_scale > 0.5``, where the softmax is
    dominated by single tokens and the mean approximation fails: use the token path.

    ``values=False`` returns ``(None, None)`` after taking exactly the same draws from
    ``rng`` (the probe's exponentials and the two normal arrays), without the arithmetic:
    a caller that drops the sums leaves every later draw of the stream, and so every other
    array of its trace, unchanged, at a tenth of the cost.
    """
    if not 0.0 < gate_scale <= 0.5:
        raise ValueError(f"count-path gate sums need 0 < gate_scale <= 0.5, got {gate_scale}; "
                         "generate with keep_topk=True for sharper gates")
    N, E = z.shape
    c = float(gate_scale)
    rows = rng.choice(N, size=min(N, probe_rows), replace=False)
    if not values:  # the draws of token_topk's Gumbel noise and of the two noise terms
        rng.standard_exponential(size=(rows.size * probe_tokens, E), dtype=np.float32)
        rng.standard_normal((N, E))
        rng.standard_normal((N, E))
        return None, None
    zp = np.repeat(z[rows], probe_tokens, axis=0)
    _, _, pp = token_topk(rng, zp, 1, with_gates=True, gate_scale=c)
    pp = pp.reshape(rows.size, probe_tokens, E).astype(np.float64)
    v = float(np.median(pp.var(axis=1) / np.maximum(pp.mean(axis=1), 1e-30) ** 2))
    nn = np.asarray(n, dtype=np.float64)[:, None]
    m = _softmax(c * z.astype(np.float64))
    prob = nn * m + np.sqrt(nn * v) * m * rng.standard_normal((N, E))
    prob = np.maximum(prob, 0.0)
    logit = c * (nn * (z + np.euler_gamma)
                 + np.sqrt(nn * np.pi**2 / 6.0) * rng.standard_normal((N, E)))
    return prob.astype(np.float32), logit.astype(np.float32)
