"""Decode-side capture: each request's decode-token expert counts and the distinct experts
per layer of the batches it decoded in (issue 13, items 2 and 6). Numpy only.

Three pieces, wired into vLLM by :mod:`eldr.capture.vllm_plugin`:

- worker (model runner), per step: :func:`decode_step` takes the step's (T, L, k) top-k
  rows and which of them are decode tokens (positions past the prompt) and returns a
  :class:`DecodeStep`: those rows' ids (compact dtype), the request each belongs to, and
  the step's distinct experts per layer over all its decode rows (L,). It ships to the
  engine core with the step's output (the plugin's ``eldr_decode`` attribute).
- engine core: :class:`DecodeTally` accumulates per request the (L, E) counts, the decode
  tokens, Σ over its steps of the batch's distinct experts per layer and the step count;
  :class:`Footprint` keeps the engine-wide ring of the last W steps' per-layer expert use
  (the live footprint every router replica can read, item 6), and per (layer, expert) in
  how many of those steps the batch selected it (:func:`encode_engine_footprint`).
- engine core, step timings: :class:`StepRing` keeps the last 4,096 timed decode steps
  (wall time, tokens B, Σ_l D_l, mixed with prompt rows) and lifetime totals; served as
  ``GET /eldr/steps`` (:func:`decode_step_ring` reads it) for ``eldr calibrate``.
- wire format: :func:`encode_decode_payload` / :func:`decode_decode_payload`, the
  version-2 count payload of :mod:`eldr.capture.payload` plus two keys::

      {"v": 2, "shape": [L, E], "tokens": D, "enc": ..., "w": ..., "data": ...,
       "steps": S,                # decode steps the request took part in
       "distinct": [d_0, ...],    # (L,) Σ over those steps of the batch's distinct experts
       "step_s": 0.0123,          # optional: Σ wall seconds of those steps (engine-timed)
       "own": 1}                  # optional: the plugin created kv_transfer_params

  The mean distinct experts per layer per step of the request's batches is
  ``distinct / steps``. It travels under :data:`DECODE_KEY` of the decode response's
  ``kv_transfer_params`` (JSON) or as one extra SSE event before ``[DONE]`` (streams);
  the router strips both (:mod:`eldr.proxy.request.decodepayload`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from eldr.capture.digits import INVALID, decode_digits, encode_digits, width_for
from eldr.capture.payload import decode_payload, encode_payload

__all__ = ["DECODE_KEY", "REPORT_KEY", "STEP_BUCKETS", "DecodeReport", "DecodeStep",
           "DecodeTally", "EngineFootprint", "Footprint", "StepColumns", "StepRing",
           "decode_decode_payload", "decode_engine_footprint", "decode_step",
           "decode_step_ring", "distinct_per_layer", "encode_decode_payload",
           "encode_engine_footprint", "is_decode_leg"]

DECODE_KEY = "eldr_decode"  # key in kv_transfer_params (JSON) and of the SSE event
# set by the router in a decode leg's kv_transfer_params: "report this request's decode"
# (connectors such as vLLM's ExampleConnector send the decode leg no other mark)
REPORT_KEY = "eldr_report"


class DecodeStep(NamedTuple):
    """One engine step's decode rows, worker → engine core (pickled)."""

    req_ids: tuple  # (R,) request ids, in the order of ``owner``'s indices
    owner: np.ndarray  # (T,) int32 index into req_ids of each decode row
    ids: np.ndarray  # (T, L, k) int16/int32 top-k expert ids of the decode rows
    distinct: np.ndarray  # (L,) int32 distinct experts per layer over all T rows
    # the whole step, for its timing (StepRing): rows scheduled (decode + prompt, B) and
    # Σ over layers of the distinct experts of ALL those rows (= distinct.sum() unless mixed)
    num_tokens: int = 0
    distinct_sum: int = 0
    # seconds the model runner spent on the step (execute_model + sample_tokens, the
    # plugin's own work left out; docs/capture.md#step-timings); None: not timed
    wall_s: float | None = None

    @property
    def is_mixed(self) -> bool:
        """The step also ran prompt rows (a prefill chunk mixed into the decode batch)."""
        return self.num_tokens > len(self.owner)


def is_decode_leg(params: object) -> bool:
    """A request's ``kv_transfer_params`` mark it as the decode leg of a PD pair: the
    router's :data:`REPORT_KEY`, or ``do_remote_prefill`` named (True as sent; connectors
    such as NIXL set it to False once the KV is pulled, so the key, not its value, is the
    mark), and it is not a prefill leg."""
    return (isinstance(params, dict) and not params.get("do_remote_decode")
            and (bool(params.get(REPORT_KEY)) or "do_remote_prefill" in params))


def _compact(ids: np.ndarray, num_experts: int) -> np.ndarray:
    return ids.astype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)


def distinct_per_layer(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """(L,) int32 number of distinct experts per layer among (T, L, k) ids (0 when T=0)."""
    T, L, _ = ids.shape
    if T == 0:
        return np.zeros(L, np.int32)
    seen = np.zeros((L, num_experts), bool)
    seen[np.arange(L)[None, :, None], ids] = True
    return seen.sum(axis=1).astype(np.int32)


def decode_step(rows: np.ndarray, spans: list, num_experts: int) -> DecodeStep | None:
    """The step's decode rows. ``rows``: (T_all, L, k) ids of the whole step; ``spans``:
    (req_id, first_row, num_rows) of each request's decode positions. None: no decode row."""
    spans = [s for s in spans if s[2] > 0]
    if not spans:
        return None
    pick = np.concatenate([np.arange(a, a + n) for _, a, n in spans])
    ids = rows[pick]
    owner = np.repeat(np.arange(len(spans), dtype=np.int32), [n for _, _, n in spans])
    distinct = distinct_per_layer(ids, num_experts)
    whole = distinct if len(pick) == len(rows) else distinct_per_layer(rows, num_experts)
    return DecodeStep(tuple(r for r, _, _ in spans), owner, _compact(ids, num_experts),
                      distinct, num_tokens=len(rows), distinct_sum=int(whole.sum()))


class DecodeTally:
    """One request's decode counts so far (engine core)."""

    __slots__ = ("counts", "distinct", "step_s", "steps", "tokens")

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.counts = np.zeros((num_layers, num_experts), np.int32)  # (L, E)
        self.tokens = 0  # decode tokens counted
        self.distinct = np.zeros(num_layers, np.int64)  # (L,) Σ per-step batch distinct
        self.steps = 0  # steps it decoded in
        self.step_s = 0.0  # Σ wall seconds of those steps that were timed

    def add(self, ids: np.ndarray, distinct: np.ndarray, wall_s: float | None = None) -> None:
        """Add this request's (t, L, k) decode rows of one step whose batch had
        ``distinct`` (L,) experts per layer and took ``wall_s`` seconds. Top-k ids of one
        token are distinct, so a plain fancy-index add is exact."""
        L = self.counts.shape[0]
        layer = np.arange(L)[:, None]
        for tok in ids:
            self.counts[layer, tok] += 1
        self.tokens += len(ids)
        self.distinct += distinct
        self.steps += 1
        if wall_s is not None:
            self.step_s += wall_s


class Footprint:
    """The engine's live footprint: per layer, the experts used by its decode batches over
    the last ``window`` steps (a ring of (W, L, E) booleans)."""

    def __init__(self, window: int, num_layers: int, num_experts: int) -> None:
        if type(window) is not int or window <= 0:
            raise ValueError(f"footprint window must be a positive integer, got {window!r}")
        self.used = np.zeros((window, num_layers, num_experts), bool)
        self.distinct = np.zeros(window, np.float64)  # mean over layers of each step
        self.filled = 0
        self.pos = 0

    def push(self, ids: np.ndarray) -> None:
        """One decode step's (T, L, k) ids."""
        W, L, _ = self.used.shape
        slot = self.used[self.pos]
        slot[:] = False
        slot[np.arange(L)[None, :, None], ids] = True
        self.distinct[self.pos] = slot.sum() / L
        self.pos = (self.pos + 1) % W
        self.filled = min(self.filled + 1, W)

    def counts(self) -> np.ndarray:
        """(L, E) int32: in how many of the last ``filled`` steps each expert was used."""
        n = self.filled
        if n == 0:
            return np.zeros(self.used.shape[1:], np.int32)
        idx = [(self.pos - 1 - i) % self.used.shape[0] for i in range(n)]
        return self.used[idx].sum(axis=0, dtype=np.int32)

    def snapshot(self) -> dict:
        """JSON-able: ``experts`` (L,) experts used over the window per layer,
        ``step_distinct_mean`` the mean distinct experts per layer per step, ``steps``."""
        n = self.filled
        if n == 0:
            return {"steps": 0, "experts": [0] * self.used.shape[1], "step_distinct_mean": 0.0}
        idx = [(self.pos - 1 - i) % self.used.shape[0] for i in range(n)]
        experts = self.used[idx].any(axis=0).sum(axis=1)
        return {"steps": n, "experts": [int(x) for x in experts],
                "step_distinct_mean": float(self.distinct[idx].mean())}


def encode_engine_footprint(fp: Footprint, at: float) -> dict:
    """The engine's per-cell footprint, JSON-able and compact (one base-91 digit per cell
    while the window is under 91 steps: 6,144 characters for 48 x 128)::

        {"v": 1, "shape": [L, E], "window": W, "steps": S, "time": at,
         "w": width, "data": <L·E counts in [0, S], base 91>}

    The route that serves it adds ``"age"``: seconds since ``time`` on the same clock.

    ``data`` / ``steps`` is the fraction of the last ``S`` decode steps whose batch selected
    each expert (≈ 1 − the probability that a step's batch misses it); ``time`` (epoch
    seconds, the engine's clock) is when it was taken, so a reader can tell an idle
    engine's last busy footprint from a live one."""
    counts = fp.counts()
    width = width_for(max(int(fp.filled), 1))
    return {"v": 1, "shape": [int(x) for x in counts.shape], "window": int(fp.used.shape[0]),
            "steps": int(fp.filled), "time": float(at), "w": width,
            "data": encode_digits(counts, width)}


class EngineFootprint(NamedTuple):
    """What a router read of one engine's footprint (:func:`decode_engine_footprint`)."""

    freq: np.ndarray  # (L, E) float32 in [0, 1]: share of the last steps selecting it
    steps: int  # decode steps it covers (0: none yet, all-zero freq)
    age: float  # seconds between its ``time`` and ``now`` (>= 0)


def decode_engine_footprint(obj: object, num_layers: int, num_experts: int, *,
                            now: float) -> EngineFootprint:
    """Validate and read an engine footprint document; ``ValueError`` naming the problem
    (wrong version or shape, counts above ``steps``, foreign characters...). The age is
    the document's ``age`` (seconds, added by the serving route from the engine's own
    clock: no skew between machines), else ``now - time`` with ``now`` the reader's epoch
    time, clipped at 0 (a time more than 5 s ahead is refused)."""
    if not isinstance(obj, dict):
        raise ValueError(f"eldr footprint: must be a JSON object, got {type(obj).__name__}")
    if obj.get("v") != 1:
        raise ValueError(f"eldr footprint: version {obj.get('v')!r}, expected 1")
    shape = obj.get("shape")
    if shape != [num_layers, num_experts]:
        raise ValueError(f"eldr footprint: shape {shape!r}, expected "
                         f"[{num_layers}, {num_experts}]")
    steps, width, data, at = obj.get("steps"), obj.get("w"), obj.get("data"), obj.get("time")
    if type(steps) is not int or not 0 <= steps < INVALID:
        raise ValueError(f"eldr footprint: steps must be a non-negative integer, got {steps!r}")
    if type(width) is not int or width not in (1, 2, 3):
        raise ValueError(f"eldr footprint: w must be 1, 2 or 3, got {width!r}")
    if not isinstance(data, str) or len(data) != num_layers * num_experts * width:
        raise ValueError(f"eldr footprint: data must be {num_layers * num_experts * width} "
                         f"characters")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not np.isfinite(at):
        raise ValueError(f"eldr footprint: time must be a finite number, got {at!r}")
    age = obj.get("age")
    if age is None:  # no age from the server: the two clocks' difference, skew included
        if at > now + 5.0:
            raise ValueError(f"eldr footprint: time {at} is {at - now:.1f} s in the future")
        age = max(0.0, float(now) - float(at))
    elif isinstance(age, bool) or not isinstance(age, (int, float)) \
            or not (np.isfinite(age) and age >= 0):
        raise ValueError(f"eldr footprint: age must be a finite number >= 0, got {age!r}")
    counts = decode_digits(data, width)
    if counts.size and int(counts.max()) > steps:
        raise ValueError(f"eldr footprint: a count exceeds steps={steps} (or a character "
                         f"is outside the alphabet)")
    freq = counts.reshape(num_layers, num_experts).astype(np.float32)
    if steps:
        freq /= np.float32(steps)
    return EngineFootprint(freq, steps, float(age))


STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Upper bounds (seconds) of the ``eldr_engine_step_seconds`` histogram's buckets."""


class StepRing:
    """The engine's timed decode steps: a ring of the last ``capacity`` steps' (wall µs,
    B, Σ_l D_l, mixed) for fitting the step model (:mod:`eldr.sim.stepfit`), and lifetime
    totals for ``/metrics`` (a histogram of step seconds, token and distinct-expert sums).
    Microseconds as integers: exact enough for steps of 0.1 ms and up, and a quarter of the
    JSON of floats."""

    def __init__(self, capacity: int = 4096) -> None:
        if type(capacity) is not int or capacity <= 0:
            raise ValueError(f"step ring capacity must be a positive integer, got "
                             f"{capacity!r}")
        self.wall_us = np.zeros(capacity, np.int64)  # (C,) model-runner µs of the step
        self.tokens = np.zeros(capacity, np.int32)  # (C,) rows scheduled, B
        self.distinct_sum = np.zeros(capacity, np.int32)  # (C,) Σ_l D_l over all its rows
        self.mixed = np.zeros(capacity, bool)  # (C,) prompt rows ran in the same step
        self.pos = 0  # next slot
        self.filled = 0  # slots holding a step
        self.count = 0  # lifetime: timed steps
        self.sum_s = 0.0  # lifetime: their seconds
        self.sum_tokens = 0  # lifetime: Σ B
        self.sum_distinct = 0  # lifetime: Σ Σ_l D_l
        self.num_mixed = 0  # lifetime: mixed steps
        self.buckets = np.zeros(len(STEP_BUCKETS) + 1, np.int64)  # per bucket, last +Inf

    def push(self, wall_s: float, tokens: int, distinct_sum: int, mixed: bool) -> None:
        i = self.pos
        self.wall_us[i] = round(wall_s * 1e6)
        self.tokens[i], self.distinct_sum[i], self.mixed[i] = tokens, distinct_sum, mixed
        self.pos = (i + 1) % len(self.wall_us)
        self.filled = min(self.filled + 1, len(self.wall_us))
        self.count += 1
        self.sum_s += wall_s
        self.sum_tokens += int(tokens)
        self.sum_distinct += int(distinct_sum)
        self.num_mixed += bool(mixed)
        self.buckets[np.searchsorted(STEP_BUCKETS, wall_s)] += 1  # bisect-left: le bounds

    def snapshot(self, num_layers: int, num_experts: int, at: float) -> dict:
        """The ring, oldest first, as compact JSON (columns as lists), plus the totals::

            {"v": 1, "layers": L, "experts": E, "capacity": C, "time": at,
             "wall_us": [...], "tokens": [...], "distinct_sum": [...], "mixed": [0, 1, ...],
             "total": {"steps": N, "seconds": S, "tokens": T, "distinct_sum": X,
                       "mixed": M, "buckets": [[le, cumulative count], ..., ["+Inf", N]]}}
        """
        C = len(self.wall_us)
        idx = (self.pos - self.filled + np.arange(self.filled)) % C
        cum = np.cumsum(self.buckets)
        return {"v": 1, "layers": int(num_layers), "experts": int(num_experts), "capacity": C,
                "time": float(at), "wall_us": self.wall_us[idx].tolist(),
                "tokens": self.tokens[idx].tolist(),
                "distinct_sum": self.distinct_sum[idx].tolist(),
                "mixed": self.mixed[idx].astype(np.int8).tolist(),
                "total": {"steps": self.count, "seconds": self.sum_s,
                          "tokens": self.sum_tokens, "distinct_sum": self.sum_distinct,
                          "mixed": self.num_mixed,
                          "buckets": [[le, int(c)] for le, c in zip(STEP_BUCKETS, cum[:-1],
                                                                    strict=True)]
                          + [["+Inf", int(cum[-1])]]}}


class StepColumns(NamedTuple):
    """What a reader got from a step-ring document (:func:`decode_step_ring`)."""

    wall_s: np.ndarray  # (n,) float64 seconds of each timed decode step, oldest first
    tokens: np.ndarray  # (n,) int64 rows scheduled in it (B)
    distinct_sum: np.ndarray  # (n,) int64 Σ over the L MoE layers of its distinct experts
    mixed: np.ndarray  # (n,) bool: prompt rows ran in the same step
    num_layers: int  # L
    num_experts: int  # E
    total_steps: int  # timed steps over the engine's life (>= n: the ring forgets)


def decode_step_ring(obj: object) -> StepColumns:
    """Validate and read a step-ring document (:meth:`StepRing.snapshot`, served as
    ``GET /eldr/steps``); ``ValueError`` naming the problem otherwise."""
    if not isinstance(obj, dict):
        raise ValueError(f"eldr steps: must be a JSON object, got {type(obj).__name__}")
    if obj.get("v") != 1:
        raise ValueError(f"eldr steps: version {obj.get('v')!r}, expected 1")
    L, E = obj.get("layers"), obj.get("experts")
    if not all(type(x) is int and 0 < x <= 4096 for x in (L, E)):
        raise ValueError(f"eldr steps: layers and experts must be integers in [1, 4096], "
                         f"got {L!r}, {E!r}")
    cols = {}
    for key in ("wall_us", "tokens", "distinct_sum", "mixed"):
        v = obj.get(key)
        if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
            raise ValueError(f"eldr steps: {key} must be a list of non-negative integers")
        cols[key] = np.asarray(v, np.int64)
    n = len(cols["wall_us"])
    if any(len(c) != n for c in cols.values()):
        raise ValueError("eldr steps: wall_us, tokens, distinct_sum and mixed differ in length")
    if n and int(cols["distinct_sum"].max()) > L * E:
        raise ValueError(f"eldr steps: a distinct_sum exceeds layers x experts = {L * E}")
    total = obj.get("total", {})
    steps = total.get("steps", n) if isinstance(total, dict) else n
    if type(steps) is not int or steps < n:
        raise ValueError(f"eldr steps: total.steps must be an integer >= {n}, got {steps!r}")
    return StepColumns(cols["wall_us"] * 1e-6, cols["tokens"], cols["distinct_sum"],
                       cols["mixed"] > 0, L, E, steps)


class DecodeReport(NamedTuple):
    """What the router read from one decode payload."""

    counts: np.ndarray  # (L, E) int32 decode-token selections
    tokens: int  # decode tokens counted
    steps: int  # decode steps the request took part in
    distinct: np.ndarray  # (L,) float64 mean distinct experts per layer per step
    step_s: float | None = None  # Σ wall seconds of its steps on the engine (if timed)

    @property
    def mean_distinct(self) -> float:
        """Mean over layers of ``distinct`` (NaN without steps)."""
        return float(self.distinct.mean()) if self.steps else float("nan")


def encode_decode_payload(tally: DecodeTally, *, own: bool = False) -> dict:
    """The wire payload of a request's tally (module docstring)."""
    obj = encode_payload(tally.counts, tokens=tally.tokens)
    obj["steps"] = int(tally.steps)
    obj["distinct"] = [int(x) for x in tally.distinct]
    if tally.step_s > 0:
        obj["step_s"] = round(float(tally.step_s), 6)
    if own:
        obj["own"] = 1
    return obj


def decode_decode_payload(obj: object, *, num_layers: int | None = None,
                          num_experts: int | None = None) -> DecodeReport:
    """Validate and read a decode payload; ``ValueError`` naming the problem otherwise.
    Without an expected shape, the payload's own ``shape`` is used (bounded)."""
    if not isinstance(obj, dict):
        raise ValueError(f"eldr decode payload: must be a JSON object, got "
                         f"{type(obj).__name__}")
    shape = obj.get("shape")
    if num_layers is None or num_experts is None:
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(type(s) is int and 0 < s <= 4096 for s in shape)):
            raise ValueError(f"eldr decode payload: bad shape {shape!r}")
        num_layers, num_experts = shape
    if obj.get("v") != 2:
        raise ValueError(f"eldr decode payload: version {obj.get('v')!r}, expected 2")
    p = decode_payload(obj, num_layers=num_layers, num_experts=num_experts)
    steps, distinct = obj.get("steps"), obj.get("distinct")
    if p.tokens is None:
        raise ValueError("eldr decode payload: tokens missing")
    if type(steps) is not int or steps < 0:
        raise ValueError(f"eldr decode payload: steps must be a non-negative integer, got "
                         f"{steps!r}")
    if (not isinstance(distinct, list) or len(distinct) != num_layers
            or not all(type(d) is int and 0 <= d <= num_experts * max(steps, 1)
                       for d in distinct)):
        raise ValueError(f"eldr decode payload: distinct must be {num_layers} integers in "
                         f"[0, {num_experts} x steps]")
    per_layer = p.counts.sum(axis=1)
    if p.layers is None and per_layer.size and (per_layer != per_layer[0]).any():
        raise ValueError("eldr decode payload: layers hold different numbers of selections")
    step_s = obj.get("step_s")
    if step_s is not None and (isinstance(step_s, bool) or not isinstance(step_s, (int, float))
                               or not (np.isfinite(step_s) and step_s >= 0)):
        raise ValueError(f"eldr decode payload: step_s must be a finite number >= 0, got "
                         f"{step_s!r}")
    mean = np.asarray(distinct, np.float64) / steps if steps else np.zeros(num_layers)
    return DecodeReport(p.counts, int(p.tokens), int(steps), mean,
                        None if step_s is None else float(step_s))
