"""Routing by marginal expert cost (docs/fit-and-routing.md, "the cost policy").

A decode step of decoder d costs ``t_fixed + Σ_l (a + b·D_l) + κ_s·Σ ctx`` (the step-time
model of docs/simulator.md): ``D_l`` distinct experts at layer l, ``ctx`` the context
tokens whose KV each request reads. Sending request x to d changes every step while x
runs there: x itself waits for d's whole batch, and each of d's ``n_d`` requests waits
for the experts and KV x adds. In units of ``b`` (one expert streamed once), the sum of
per-token latencies x adds to the cluster is

    J_d(x) = D_d + (n_d + 1)·ΔD_d(x) + κ·(C_d + n_d·ctx_x)        (+ terms equal for all d)

with, for a per-token expert-inclusion profile ``p_r (L, E)`` per request,

    S_d    = Π_{r on d} (1 − p_r)          kept as Σ log(1 − p_r), moved at dispatch/release
    D_d    = Σ_{l,e} (1 − S_d)             expected distinct experts of one step of d's batch
    ΔD_d(x)= Σ_{l,e} S_d · p_x             experts x is expected to add
    C_d    = Σ_{r on d} ctx_r ,  κ = (seconds per context token per step) / b

Over x's lifetime about ``n_d`` more requests join d (Little's law: as many arrive during
a stay as are in the batch), and under this policy they resemble what d was recently sent.
So ``memory`` > 0 adds their share, ``w · n_d · ΔD̄_d(x)``, where ``ΔD̄_d`` is what x adds
to a batch of ``n_d`` of d's usual requests: ``S̄_d = exp(n_d · m_d)`` with ``m_d`` a
decayed mean of ``log(1 − p)`` over the requests d was sent (half-life ``memory``
dispatches). Measured in the simulator (docs/fit-and-routing.md): half-life 4 with
``w = 0.5`` cut task p99 further without giving up language's tail; ``w = 1`` packed
harder and lost language p99 at 100 req/s. The memory is history, not in-flight state: it
does not return to zero when the decoder empties (its in-flight sums do).

Near saturation (the busiest decoder's expected union above ``saturation`` = 75% of all
experts) a batch selects nearly every expert whatever the routing: there is no locality
left to win, only a slowest decoder to lose, so loads are bounded as a balancer bounds
them: no decoder above the mean load + 1 (``saturated_slack`` 0,
:func:`eldr.routing.filters.bounded_load`); the + 1 leaves the cost a choice among the
decoders at or near the mean. Summing latencies, the cost accepts decoders that run at
different speeds (a few light, fast ones; the rest heavier and slower than a balancer's),
and the p99 is the slowest one's. Measured (docs/simulator.md, "The 14 cells, with
intervals"; 4 seeds): language, 8 decoders, 100 req/s went from +11.2% / +15.0% (median
/ p99 vs JSQ, one seed, no bound) to −0.5% / +1.7% with the first bound (0.1 × the mean
above it) and to −0.8% / +0.6% with this one; Azure 8 decoders 80 req/s from −4.6% /
+2.3% to −3.0% / +0.4%. Where nothing is saturated the policy is bit-identical to the
unbounded one.

The argmin over healthy decoders with a free batch slot (``capacity``; a full decoder
makes x queue, which no locality repays) is the policy. Every decoder empty → every
``J_d`` equals ``Σ p_x``: ties → lowest load → lowest index, i.e. JSQ's choice. Under load
it packs requests whose experts overlap, and only as far as the shared experts pay for the
longer batch.

With several router replicas, each holds only its own share of a decoder's requests; a
decode engine's own reading of its footprint (:mod:`eldr.routing.engine_rows`,
:meth:`CostPolicy.observe_engine`) joins as ``S_d = min(S_own, 1 − f_engine)`` until it
expires; with the online memory it also replaces the memory term, ``S̄_d = 1 − f``.
With no engine reading the policy is exactly the one above.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from eldr.routing import filters, pickers, scorers
from eldr.routing._common import _check, _check_num_workers
from eldr.routing.engine_rows import EngineRows
from eldr.routing.protocol import Decision, Outcome, PolicyBase, RouteRequest

__all__ = ["CostPolicy", "ExpertFootprint", "check_layer_stride", "prefill_profile"]

_P_MAX = 1.0 - 1e-6  # log(1 − p) stays finite for an expert every token selects
_P_MAX32 = np.float32(_P_MAX)  # what numpy's minimum casts it to for a float32 profile
_TYPICAL_CACHE = 32  # fitted exp(n · m_d) rows kept per decoder (a count walks by ±1)
_ONE = np.float32(1.0)
_LISTED = 16
"""Decoders up to which :meth:`CostPolicy.decide` adds up ``J`` in Python floats, not
numpy: µs per ``J`` (48 × 128, fitted profiles) numpy against lists, 2026-12-07 on the
2-core development machine: 2 decoders 5.3 against 3.6, 8: 6.9 against 5.8, 16: 10.3
against 9.9, 32: 21.6 against 22.9 (the matrix-vector products are most of it there)."""


def _log1m(p: np.ndarray) -> np.ndarray:
    """(n,) float32 ``log(1 − p)`` for float32 ``p`` in [0, 1): numpy's vectorised float32
    ``log`` of the rounded ``1 − p``: within 1e-7 absolute plus two float32 ulp of the
    exact value (the rounding of ``1 − p``, ≤ 2**-25, is what it adds to ``log1p``'s
    error; tests/test_routing_cost.py). What a row feeds, ``S_d = exp(Σ log(1 − p_r))`` in
    float32, carries as much rounding of its own. numpy's float32 ``log1p`` calls libm per
    element: 37 µs for a 48 × 128 profile, against 14 µs here, at every dispatch of the
    router's request path."""
    return np.log(_ONE - p)


def _mask(ok: np.ndarray | None, num_workers: int) -> np.ndarray:
    """The candidates ``ok`` (K,) bool, or every decoder where none was built (None)."""
    return np.ones(num_workers, dtype=bool) if ok is None else ok


def check_layer_stride(stride: object, what: str = "layer_stride") -> int:
    """``stride`` as the cost policy's layer stride (an integer >= 1), else ValueError
    naming ``what``: the one check of the policy, ``eldr serve --cost-layer-stride`` and
    the Ray app's setting."""
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {stride!r}")
    return int(stride)


def prefill_profile(counts: np.ndarray, num_tokens: int, top_k: int | None = None, *,
                    max_count: int | None = None) -> np.ndarray:
    """(L, E) float32 per-token inclusion probabilities from prefill counts (L, E).

    ``counts / num_tokens``: the share of prompt tokens whose top-k held each expert, the
    calibration-free estimate of how often a decode token selects it. A prompt with no
    tokens gives the uniform profile ``top_k / E`` (nothing is known), or zeros without
    ``top_k``. A count above ``num_tokens`` is capped at probability 1; ``max_count``, a
    bound on every count that the caller has checked (a decoded payload's), spares the
    look for one when it is at most ``num_tokens``.
    """
    c = counts if isinstance(counts, np.ndarray) and counts.dtype.kind in "biuf" \
        else np.asarray(counts, dtype=np.float32)
    if c.ndim != 2:
        raise ValueError(f"counts must be (L, E), got shape {c.shape}")
    if num_tokens <= 0:
        return np.full(c.shape, (top_k or 0) / c.shape[1], dtype=np.float32)
    # cast and divide in one call: the bits of a float32 copy divided (integers and
    # floats round to float32 alike either way)
    p = np.divide(c, np.float32(num_tokens), dtype=np.float32)
    if max_count is not None and max_count <= num_tokens:
        return p  # counts ≤ tokens: every float32 quotient is ≤ 1 (rounding is monotone)
    # capped only if a count exceeds the tokens (the same bits either way; numpy's minimum
    # with a scalar costs 2.5 µs on 48 × 128 cells, their max 1 µs)
    return p if p.size == 0 or p.max() <= 1 else np.minimum(p, np.float32(1.0))


class ExpertFootprint:
    """Per-decoder expected expert footprint of the requests in flight.

    ``miss`` (K, L·E) float32 = ``S_d`` (probability that no request on d selects the
    expert at a step), ``distinct`` (K,) = ``D_d``, ``context`` (K,) = ``C_d``. Rows are
    recomputed from the float64 log sums only for the decoders events touched, when next
    read (a decision reads them once after any number of dispatches and releases: the
    float64 ``exp`` over L·E cells was most of a dispatch's and a release's cost); a decoder
    left with no request is reset to exactly zero (no float drift accumulates). ``engine``:
    the engines' own readings (:class:`~eldr.routing.engine_rows.EngineRows`), created by
    the first :meth:`observe_engine`; a live row caps ``miss`` (the union of both views).

    With fitted profiles ``typical`` never changes, so ``typical_miss[d] = exp(n_d · m_d)``
    depends on the count alone: it is kept per (decoder, count), at most ``_TYPICAL_CACHE``
    counts each, and copied back bit for bit (pinned by a test against the plain
    computation). The float64 ``exp`` over all L·E cells is what an event costs; the
    online memory changes every cell at each dispatch, so there it is recomputed.
    """

    def __init__(self, num_workers: int, num_cells: int, *, memory: float = 0.0,
                 typical: np.ndarray | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_workers = _check_num_workers(num_workers)
        if num_cells <= 0:
            raise ValueError(f"num_cells must be > 0, got {num_cells}")
        if not np.isfinite(memory) or memory < 0:
            raise ValueError(f"memory must be finite and >= 0, got {memory}")
        K = self.num_workers
        self.num_cells = num_cells
        self.log_miss = np.zeros((K, num_cells), dtype=np.float64)  # Σ log(1 − p_r)
        self._miss = np.ones((K, num_cells), dtype=np.float32)  # S_d
        self._distinct = np.zeros(K, dtype=np.float64)  # D_d
        self.context = np.zeros(K, dtype=np.float64)  # C_d
        self.count = np.zeros(K, dtype=np.int64)  # requests held per decoder
        self._held: dict[str, tuple[int, np.ndarray | None, float]] = {}
        # the decoder's "type": a decayed mean of log(1 − p) over the requests it was sent
        # (half-life ``memory`` dispatches), and S̄_d = exp(n_d · mean), the footprint of a
        # batch of its usual requests as large as its current one
        self.memory = float(memory)
        self._keep = 0.5 ** (1.0 / memory) if memory > 0 else 0.0
        self.typical = np.zeros((K, num_cells), dtype=np.float64) if memory > 0 else None
        if typical is not None:  # fitted: each decoder's cluster, fixed (no online update)
            t = np.asarray(typical, dtype=np.float64).reshape(K, -1)
            if t.shape != (K, num_cells) or not np.isfinite(t).all() or (t > 0).any():
                raise ValueError(f"typical must be ({K}, {num_cells}) finite mean "
                                 f"log(1 - p) values <= 0, got shape {t.shape}")
            self.typical, self._keep = t.copy(), 1.0
        self._typical_miss = np.ones((K, num_cells), dtype=np.float32) \
            if self.typical is not None else None
        self._typical_distinct = np.zeros(K, dtype=np.float64)
        # fitted only: per decoder, count → (exp(n · m_d) row (n,) float32, its D̄_d)
        self._typical_rows: list[dict[int, tuple[np.ndarray, float]]] = \
            [{} for _ in range(K)]
        self._scratch = np.empty(num_cells, dtype=np.float64)  # n · m_d, before its exp
        self._scratch32 = np.empty(num_cells, dtype=np.float32)  # (1 − keep) · row
        self.engine: EngineRows | None = None
        self._clock = clock
        # decoders whose rows an event changed: recomputed when next read (a decision reads
        # them once, however many dispatches and releases came in between)
        self._stale: set[int] = set()

    # -- the derived rows, brought up to date when read ------------------------------------
    def _sync(self) -> None:
        if self._stale:
            for d in sorted(self._stale):
                self._refresh(d)
            self._stale.clear()

    @property
    def miss(self) -> np.ndarray:
        self._sync()
        return self._miss

    @property
    def distinct(self) -> np.ndarray:
        self._sync()
        return self._distinct

    @property
    def typical_miss(self) -> np.ndarray | None:
        self._sync()
        return self._typical_miss

    @property
    def typical_distinct(self) -> np.ndarray:
        self._sync()
        return self._typical_distinct

    def __len__(self) -> int:
        return len(self._held)

    def __getstate__(self) -> dict:
        """The fitted ``exp(n · m_d)`` rows are a cache: not pickled (up to
        ``_TYPICAL_CACHE`` rows of ``num_cells`` float32 per decoder)."""
        self._sync()
        state = self.__dict__.copy()
        state["_typical_rows"] = [{} for _ in self._typical_rows]
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled state is private and writable: a parallel runner (joblib) may hand
        large arrays back as read-only shared memory maps, and this state changes at every
        dispatch."""
        for name in ("miss", "distinct", "typical_miss", "typical_distinct"):
            if name in state:  # pickled before the rows were kept up to date lazily
                state["_" + name] = state.pop(name)
        state.setdefault("_stale", set())
        self.__dict__.update(state)
        for name, value in state.items():
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                setattr(self, name, np.array(value))

    def _refresh(self, d: int) -> None:
        """Recompute decoder ``d``'s derived rows from its log sums and count."""
        live = self.engine is not None and self.engine.live[d]
        if self.count[d] == 0:
            self.log_miss[d] = 0.0
            self.context[d] = 0.0
            if not live:
                self._miss[d] = 1.0
                self._distinct[d] = 0.0
                return
            self._miss[d] = self.engine.miss[d]
        else:  # float32 exp of the rounded sums, in place (vectorised; float64 exp is libm
            # per element); one call: the ufunc casts as np.copyto did, bit for bit
            np.exp(self.log_miss[d], out=self._miss[d], dtype=np.float32,
                   casting="same_kind")
            if live:
                np.minimum(self._miss[d], self.engine.miss[d], out=self._miss[d])
        self._distinct[d] = self.num_cells - float(self._miss[d].sum(dtype=np.float64))
        if self.typical is not None and self.count[d]:
            self._refresh_typical(d)

    def _refresh_typical(self, d: int) -> None:
        """``typical_miss[d] = exp(n_d · m_d)`` and its ``D̄_d`` (n_d > 0)."""
        n = int(self.count[d])
        rows = self._typical_rows[d] if self._keep == 1.0 else None
        kept = rows.get(n) if rows is not None else None
        if kept is not None:
            self._typical_miss[d] = kept[0]
            self._typical_distinct[d] = kept[1]
            return
        np.multiply(self.typical[d], float(n), out=self._scratch)
        np.copyto(self._typical_miss[d], self._scratch, casting="same_kind")
        np.exp(self._typical_miss[d], out=self._typical_miss[d])
        self._typical_distinct[d] = self.num_cells - float(
            self._typical_miss[d].sum(dtype=np.float64))
        if rows is not None:
            if len(rows) >= _TYPICAL_CACHE:
                del rows[next(iter(rows))]  # the oldest count
            rows[n] = (self._typical_miss[d].copy(), float(self._typical_distinct[d]))

    def add(self, request_id: str, worker: int, profile: np.ndarray | None,
            context_tokens: float = 0.0) -> None:
        """Hold ``profile`` (L·E,) on ``worker`` until :meth:`remove` (None: count only)."""
        if request_id in self._held:  # dispatched twice: the last placement holds
            self.remove(request_id)
        row = None
        if profile is not None:
            p = profile.reshape(-1)
            # clipped only if a cell needs it: numpy's minimum with a scalar costs 2.5 µs
            # on 48 × 128 cells, their max 1 µs; the row is the same bits either way
            if p.dtype != np.float32 or not p.max() <= _P_MAX32:
                p = np.minimum(p, _P_MAX, dtype=np.float32)
            row = _log1m(p)
            self.log_miss[worker] += row
            if self.typical is not None and self._keep < 1.0:
                self.typical[worker] *= self._keep
                np.multiply(row, 1.0 - self._keep, out=self._scratch32)  # float32, as before
                self.typical[worker] += self._scratch32
        self._held[request_id] = (worker, row, float(context_tokens))
        self.count[worker] += 1
        self.context[worker] += context_tokens
        self._stale.add(worker)

    def remove(self, request_id: str) -> bool:
        """Drop a held request; False when it is not held (already released)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        d, row, ctx = held
        if row is not None:
            self.log_miss[d] -= row
        self.count[d] -= 1
        self.context[d] -= ctx
        if self.count[d] == 0:  # exactly zero again, before any later add (no drift)
            self.log_miss[d] = 0.0
            self.context[d] = 0.0
        self._stale.add(d)
        return True

    def observe_engine(self, worker: int, freq: np.ndarray, age_s: float,
                       max_age_s: float) -> bool:
        """Decoder ``worker``'s engine reading (:meth:`EngineRows.observe`); False when it
        was refused (nothing changed)."""
        if self.engine is None:
            self.engine = EngineRows(self.num_workers, self.num_cells, self._clock)
        if not self.engine.observe(worker, freq, age_s, max_age_s):
            return False
        self._stale.add(worker)
        return True

    def expire(self) -> None:
        """Drop engine readings whose time is up (their decoders fall back to own rows)."""
        if self.engine is not None:
            self._stale.update(self.engine.expire())

    def add_worker(self, like: int | None = None) -> None:
        """A new, empty decoder row; its fitted "type" is a copy of ``like``'s (or, with
        the online memory, starts empty)."""
        self._sync()
        K, n = self.num_workers, self.num_cells
        self.log_miss = np.vstack([self.log_miss, np.zeros((1, n))])
        self._miss = np.vstack([self._miss, np.ones((1, n), dtype=np.float32)])
        self._distinct = np.append(self._distinct, 0.0)
        self.context = np.append(self.context, 0.0)
        self.count = np.append(self.count, np.int64(0))
        if self.typical is not None:
            row = self.typical[like:like + 1] if like is not None and self._keep == 1.0 \
                else np.zeros((1, n))
            self.typical = np.vstack([self.typical, row])
            self._typical_miss = np.vstack([self._typical_miss,
                                           np.ones((1, n), dtype=np.float32)])
        self._typical_distinct = np.append(self._typical_distinct, 0.0)
        self._typical_rows.append(dict(self._typical_rows[like])
                                  if like is not None and self._keep == 1.0 else {})
        if self.engine is not None:
            self.engine.add_worker()
        self.num_workers = K + 1

    def remove_worker(self, worker: int) -> None:
        """Drop decoder ``worker``'s row; requests still held there are forgotten (a
        drained decoder holds none), those of higher decoders move down one index."""
        self._sync()
        for rid in [r for r, (d, _, _) in self._held.items() if d == worker]:
            del self._held[rid]
        self._held = {r: (d - 1 if d > worker else d, row, ctx)
                      for r, (d, row, ctx) in self._held.items()}
        del self._typical_rows[worker]
        for name in ("log_miss", "_miss", "_distinct", "context", "count", "typical",
                     "_typical_miss", "_typical_distinct"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, np.delete(value, worker, axis=0))
        if self.engine is not None:
            self.engine.remove_worker(worker)
        self.num_workers -= 1

    def added(self, profile: np.ndarray) -> np.ndarray:
        """(K,) ``ΔD_d``: expected experts ``profile`` (L·E,) adds to each decoder."""
        return self.miss @ profile.reshape(-1)

    def added_typical(self, profile: np.ndarray) -> np.ndarray:
        """(K,) experts ``profile`` adds to a batch of d's usual requests (memory > 0); a
        live engine row replaces the online memory (:meth:`EngineRows.added_typical`)."""
        own = self.typical_miss @ profile.reshape(-1)
        if self.engine is None or self._keep == 1.0:  # no readings, or fitted profiles
            return own
        return self.engine.added_typical(own, profile)


class CostPolicy(PolicyBase):
    """Marginal expert cost (module docstring); needs ``RouteRequest.profile`` (L, E).

    ``decoder_profiles`` (K, L, E): the mean ``log(1 − p)`` of the calibration requests of
    each decoder's cluster (``eldr.fit.predictor.decoder_profiles``; in the artifact). Given,
    they are what joins d in the future term, fixed, with ``memory_weight`` 1 by default;
    without them the online memory (half-life ``memory`` dispatches) stands in, weight 0.5.

    ``context_weight`` = κ, decode-step seconds per context token divided by seconds per
    distinct expert (0 ignores KV reads); ``capacity`` = a decoder's batch limit (None:
    unlimited). ``clock``: the time engine readings expire on (tests inject one).

    ``layer_stride`` s: price every s-th layer only (rows 0, s, 2s, ...; 1: all). Profiles,
    decoder profiles and engine footprints still come in as (L, E) and are cut to those
    rows (a profile may also come already cut, (L', E): a router that asked the engine
    for those layers only), and κ is scaled by L'/L (fewer priced layers, fewer experts
    per step in ``J``). In the simulator a third or a sixth of the layers routed as well
    as all of them (docs/fit-and-routing.md, "The cost policy on a subset of layers");
    the decision costs a third less at s = 3 on 48 × 128.
    """

    def __init__(self, num_workers: int, *, num_layers: int, num_experts: int,
                 context_weight: float = 0.0, capacity: float | None = None,
                 memory: float = 4.0, memory_weight: float | None = None,
                 decoder_profiles: np.ndarray | None = None,
                 load_slack: float | None = None, saturation: float | None = 0.75,
                 saturated_slack: float = 0.0, layer_stride: int = 1,
                 name: str = "eldr_cost", clock: Callable[[], float] | None = None) -> None:
        self.name = name
        self.num_workers = _check_num_workers(num_workers)
        self.num_fallbacks = 0
        self.inputs = frozenset({"profile"})
        if num_layers <= 0 or num_experts <= 0:
            raise ValueError(f"{name}: num_layers and num_experts must be > 0, "
                             f"got {num_layers}, {num_experts}")
        if not np.isfinite(context_weight) or context_weight < 0:
            raise ValueError(f"{name}: context_weight must be finite and >= 0, "
                             f"got {context_weight}")
        if capacity is not None and not capacity >= 1:
            raise ValueError(f"{name}: capacity must be >= 1 or None, got {capacity}")
        self.layer_stride = check_layer_stride(layer_stride, f"{name}: layer_stride")
        self.shape = (int(num_layers), int(num_experts))
        # the priced rows; None: every layer (no cut anywhere)
        self.priced_layers: np.ndarray | None = (
            None if self.layer_stride == 1 or self.shape[0] == 1
            else np.arange(0, self.shape[0], self.layer_stride))
        self.priced_shape = (self.shape[0] if self.priced_layers is None
                             else len(self.priced_layers), self.shape[1])
        # the share first: 1.0 exactly at stride 1, so κ is the one given, bit for bit
        self.context_weight = float(context_weight) * (self.priced_shape[0] / self.shape[0])
        self.capacity = capacity
        typical = None
        if decoder_profiles is not None:
            dp = np.asarray(decoder_profiles, dtype=np.float32)
            if dp.shape != (self.num_workers, *self.shape):
                raise ValueError(f"{name}: decoder_profiles have shape {dp.shape}, expected "
                                 f"({self.num_workers}, {self.shape[0]}, {self.shape[1]})")
            typical = dp if self.priced_layers is None else dp[:, self.priced_layers]
        self.footprint = ExpertFootprint(self.num_workers,
                                         self.priced_shape[0] * self.priced_shape[1],
                                         memory=memory, typical=typical,
                                         clock=clock or time.monotonic)
        if memory_weight is None:
            memory_weight = 0.5 if typical is None else 1.0
        if not np.isfinite(memory_weight) or memory_weight < 0:
            raise ValueError(f"{name}: memory_weight must be finite and >= 0, "
                             f"got {memory_weight}")
        self.memory_weight = float(memory_weight)
        if load_slack is not None and not (np.isfinite(load_slack) and load_slack >= 0):
            raise ValueError(f"{name}: load_slack must be finite and >= 0 or None, "
                             f"got {load_slack}")
        self.load_slack = load_slack
        if saturation is not None and not 0.0 < saturation <= 1.0:
            raise ValueError(f"{name}: saturation must be in (0, 1] or None, got {saturation}")
        if not (np.isfinite(saturated_slack) and saturated_slack >= 0):
            raise ValueError(f"{name}: saturated_slack must be finite and >= 0, "
                             f"got {saturated_slack}")
        self.saturation = saturation
        self.saturated_slack = float(saturated_slack)

    def _slack(self) -> float | None:
        """The load bound in force: ``load_slack`` if set; else ``saturated_slack`` while
        the busiest decoder's expected union exceeds ``saturation`` of all experts (no
        locality left to win there, only the tail to lose); else none."""
        if self.load_slack is not None or self.saturation is None:
            return self.load_slack
        fp = self.footprint
        # numpy's max of K floats costs a microsecond: Python's, and a look for NaN
        # (numpy's max would be NaN, which passes no threshold) only when one passes
        if max(fp.distinct.tolist()) > self.saturation * fp.num_cells \
                and not np.isnan(fp.distinct).any():
            return self.saturated_slack
        return None

    def _priced(self, profile: np.ndarray) -> np.ndarray | None:
        """``profile`` on the priced rows: (L, E) cut to them, (L', E) as it is; None for
        any other shape."""
        shape = profile.shape
        if shape == self.priced_shape:
            return profile
        if shape == self.shape:  # priced_layers is not None here (else the shapes agree)
            return profile[self.priced_layers]
        return None

    def costs(self, profile: np.ndarray, loads: np.ndarray, context_tokens: float = 0.0
              ) -> np.ndarray:
        """(K,) float64 ``J_d(x)`` for a profile (L, E), or (L', E) on the priced layers
        only, and the live loads (K,)."""
        return np.asarray(self._costs(self._profile_row(profile), loads, context_tokens),
                          dtype=np.float64)

    def _profile_row(self, profile: np.ndarray) -> np.ndarray:
        """(L'·E,) the profile's priced rows, flat; ValueError for another shape."""
        priced = self._priced(profile)
        if priced is None:
            expected = self.shape if self.priced_layers is None else \
                f"{self.shape} or {self.priced_shape} (its priced layers)"
            raise ValueError(f"{self.name}: profile has shape {profile.shape}, "
                             f"expected {expected}")
        return priced.reshape(-1)

    def _costs(self, p: np.ndarray, loads: np.ndarray, context_tokens: float
               ) -> np.ndarray | list[float]:
        """``J`` for a flat priced profile ``p``: a list of Python floats up to
        ``_LISTED`` decoders, else (K,) float64. The two are the same numbers bit for bit:
        each J_d is the same float64 operations in the same order (float32 terms widen
        exactly either way; tests/test_routing_cost.py compares them)."""
        fp = self.footprint
        fp._sync()  # once: the rows below are read as they stand
        delta, typical = fp._miss @ p, None  # ΔD_d (fp.added, its sync done above)
        if fp.typical is not None:
            # the requests that join d while x runs (≈ n_d, Little's law) are d's usual ones
            typical = fp._typical_miss @ p if fp.engine is None else fp.added_typical(p)
        if self.num_workers > _LISTED:
            J = fp._distinct + (loads + 1.0) * delta.astype(np.float64)
            if typical is not None:
                J += self.memory_weight * loads * typical
            if self.context_weight:
                J += self.context_weight * (fp.context + loads * context_tokens)
            return J
        n, dist, dd = loads.tolist(), fp._distinct.tolist(), delta.tolist()
        J = [dist[d] + (n[d] + 1.0) * dd[d] for d in range(len(n))]
        if typical is not None:
            w, tt = self.memory_weight, typical.tolist()
            J = [J[d] + (w * n[d]) * tt[d] for d in range(len(n))]
        if self.context_weight:
            k, ctx = self.context_weight, fp.context.tolist()
            J = [J[d] + k * (ctx[d] + n[d] * context_tokens) for d in range(len(n))]
        return J

    def decide(self, request: RouteRequest, loads: np.ndarray,
               healthy: np.ndarray | None = None) -> Decision:
        _check(self.name, self.num_workers, loads, healthy)
        ok = None  # every decoder (no mask built: the common case)
        if healthy is not None or self.capacity is not None:
            ok = filters.with_capacity(filters.healthy(self.name, self.num_workers, healthy),
                                       loads, self.capacity)
        self.footprint.expire()
        slack = self._slack()
        if slack is not None:
            ok = filters.bounded_load(_mask(ok, self.num_workers), loads, slack)
        if request.profile is None:
            self.num_fallbacks += 1
            return Decision(pickers.lowest(_mask(ok, self.num_workers), scorers.load(loads)),
                            fallback=True)
        J = self._costs(self._profile_row(request.profile), loads, request.context_tokens)
        k = None
        if isinstance(J, list):
            k = pickers.lowest_listed(None if ok is None else ok.tolist(), J, loads.tolist())
        if k is None:  # many decoders, or a cost that is not finite
            J = np.asarray(J, dtype=np.float64)
            k = pickers.lowest(_mask(ok, self.num_workers), J, tiebreak=scorers.load(loads))
        return Decision(k, cost=float(J[k]))

    def on_dispatch(self, request: RouteRequest, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"{self.name}: worker {worker} out of range")
        p = request.profile
        if p is not None:  # a malformed profile (None here) never enters the state (decide
            p = self._priced(p)  # refused it too)
        self.footprint.add(request.request_id, worker, p, request.context_tokens)

    def on_release(self, request_id: str, outcome: Outcome) -> None:
        self.footprint.remove(request_id)

    @property
    def engine_footprint_shape(self) -> tuple[int, int]:
        """(L, E): the engine footprints :meth:`observe_engine` takes (all layers; cut to the
        priced ones here)."""
        return self.shape

    def observe_engine(self, worker: int, freq: np.ndarray, age_s: float,
                       max_age_s: float) -> bool:
        """Decoder ``worker``'s engine footprint ``freq`` (L, E) in [0, 1] (the share of its
        last decode steps that selected each expert), ``age_s`` old, good for ``max_age_s``
        after it was taken: blended as ``min(S_own, 1 − freq)`` while it holds. False:
        refused (shape, values, age), nothing changed."""
        self._index(worker)
        if np.shape(freq) != self.shape:
            return False
        if self.priced_layers is not None:
            freq = np.asarray(freq)[self.priced_layers]
        return self.footprint.observe_engine(worker, freq, age_s, max_age_s)

    def add_worker(self, *, like: int | None = None) -> int:
        """A new decoder with an empty footprint: needs no centroid, takes requests at once
        (its ``D_d`` is 0, the cheapest place for anything). With fitted cluster profiles
        it copies ``like``'s for the future term until a refit."""
        k = super().add_worker(like=like)
        self.footprint.add_worker(like)
        return k

    def remove_worker(self, worker: int) -> None:
        super().remove_worker(worker)
        self.footprint.remove_worker(worker)
