"""Real request traces: arrival times and token lengths, replayed through the simulator.

Two public production formats are read, told apart by their CONTENT (never the file name):

* Azure LLM inference trace (CSV): a header with ``TIMESTAMP`` (ISO date-time, 7
  fractional digits in the published files), ``ContextTokens`` and ``GeneratedTokens``;
* Mooncake (JSONL): one object a line with ``timestamp`` (ms from the trace start),
  ``input_length``, ``output_length`` and ``hash_ids``, the ids of the prompt's 512-token
  blocks (equal ids = equal content, so a shared prefix is a shared leading run of ids).

The package ships one trace of each (``src/eldr/data/workloads/README.md``: sources,
licences, statistics); :func:`default_arrivals` loads them by name. A trace becomes a
:class:`RequestArrivals` record; :func:`scale_to_rate`, :func:`window`, :func:`head` and
:func:`clip_lengths` derive new records from it; :func:`arrivals_trace` builds the
expert-routing :class:`~eldr.traces.trace.Trace` the simulator replays, one trace request
per arrival (routing from :mod:`eldr.traces.synth` for exactly the replayed lengths);
:func:`calibration_and_replay` adds distinct calibration requests from the same draw, and
:func:`sim_arrivals` gives the ``arrivals=(times, trace_index)`` argument of
:func:`eldr.sim.simulate`.

Reading is all or nothing: a malformed line raises a ValueError naming the file, the line
and the field, and no partial record is ever returned. Files above ``max_bytes`` (default
256 MiB) are refused before they are read.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from eldr.traces._arrival_files import MAX_FILE_BYTES, detect_format, read_trace_file
from eldr.traces.models import get_preset
from eldr.traces.synth import generate
from eldr.traces.trace import Trace

__all__ = [
    "DEFAULT_ARRIVALS",
    "MAX_FILE_BYTES",
    "MOONCAKE_BLOCK_TOKENS",
    "RequestArrivals",
    "arrivals_trace",
    "calibration_and_replay",
    "clip_lengths",
    "default_arrivals",
    "detect_format",
    "head",
    "load_arrivals",
    "scale_to_rate",
    "sim_arrivals",
    "window",
]

MOONCAKE_BLOCK_TOKENS = 512  # tokens per Mooncake hash block (its paper and trace README)

# Shipped traces (src/eldr/data/workloads/): name -> file name.
DEFAULT_ARRIVALS: dict[str, str] = {
    "azure_conv": "azure_llm_2023_conv.csv",
    "mooncake_conv": "mooncake_conversation.jsonl",
}
_DATA = Path(__file__).resolve().parent.parent / "data" / "workloads"


@dataclass(frozen=True, eq=False)
class RequestArrivals:
    """N requests of a real trace: when each arrives and how long its prompt and output are.

    Validated on construction. Derive new records with :func:`scale_to_rate`,
    :func:`window`, :func:`head` and :func:`clip_lengths` (the arrays are never changed in
    place).
    """

    times: np.ndarray  # (N,) float64 arrival seconds, >= 0, non-decreasing (0 = trace start)
    prompt_lens: np.ndarray  # (N,) int64 prompt tokens, >= 0
    output_lens: np.ndarray  # (N,) int64 generated tokens, >= 0, as recorded
    block_ids: tuple[np.ndarray, ...] | None  # per request (n_r,) int64 block ids; None: none
    source: str  # what the record came from, e.g. "azure_llm_2023_conv.csv"
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per block of block_ids

    def __post_init__(self) -> None:
        times = np.asarray(self.times, dtype=np.float64)
        n = times.shape[0] if times.ndim == 1 else -1
        if times.ndim != 1:
            raise ValueError(f"RequestArrivals: times must be 1-D, got shape {times.shape}")
        if n and not (np.isfinite(times).all() and times.min() >= 0):
            raise ValueError("RequestArrivals: times must be finite and >= 0")
        if n > 1 and (np.diff(times) < 0).any():
            raise ValueError("RequestArrivals: times must be non-decreasing")
        object.__setattr__(self, "times", times)
        for name in ("prompt_lens", "output_lens"):
            arr = np.asarray(getattr(self, name))
            if arr.shape != (n,) or (n and (arr.dtype == bool
                                            or not np.issubdtype(arr.dtype, np.integer))):
                raise ValueError(f"RequestArrivals: {name} must be ({n},) integers, got "
                                 f"dtype {arr.dtype} shape {arr.shape}")
            if n and arr.min() < 0:
                raise ValueError(f"RequestArrivals: {name} must be >= 0, got {int(arr.min())}")
            object.__setattr__(self, name, arr.astype(np.int64, copy=False))
        if self.block_ids is not None:
            if len(self.block_ids) != n:
                raise ValueError(f"RequestArrivals: block_ids has {len(self.block_ids)} "
                                 f"entries for {n} requests")
            ids = tuple(np.asarray(b, dtype=np.int64) for b in self.block_ids)
            for r, b in enumerate(ids):
                if b.ndim != 1 or (b.size and b.min() < 0):
                    raise ValueError(f"RequestArrivals: block_ids[{r}] must be 1-D and >= 0")
            object.__setattr__(self, "block_ids", ids)
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) \
                or self.block_tokens < 1:
            raise ValueError("RequestArrivals: block_tokens must be a positive integer, got "
                             f"{self.block_tokens!r}")

    @property
    def num_requests(self) -> int:
        return int(self.times.shape[0])

    def __len__(self) -> int:
        return self.num_requests

    @property
    def span_s(self) -> float:
        """Seconds from the first to the last arrival."""
        return float(self.times[-1] - self.times[0]) if self.num_requests else 0.0

    @property
    def mean_rate(self) -> float:
        """Mean arrival rate in requests/s, ``(N - 1) / span`` (one gap fewer than arrivals)."""
        if self.num_requests < 2 or self.span_s <= 0:
            raise ValueError(f"{self.source}: a rate needs >= 2 arrivals over a positive span")
        return (self.num_requests - 1) / self.span_s

    def _take(self, idx: np.ndarray, times: np.ndarray | None = None,
              source: str | None = None) -> RequestArrivals:
        return RequestArrivals(
            times=self.times[idx] if times is None else times,
            prompt_lens=self.prompt_lens[idx], output_lens=self.output_lens[idx],
            block_ids=None if self.block_ids is None
            else tuple(self.block_ids[i] for i in np.arange(self.num_requests)[idx]),
            source=self.source if source is None else source, block_tokens=self.block_tokens)


def load_arrivals(path: str | os.PathLike, *, max_bytes: int = MAX_FILE_BYTES) -> RequestArrivals:
    """Read an Azure CSV or Mooncake JSONL trace (format from content, :func:`detect_format`).

    Times become seconds from the first arrival; requests are sorted by time (stable, so
    equal times keep file order; the shipped files are already sorted). Blank lines are
    skipped. Any malformed line raises ValueError naming the file, line and field; files
    above ``max_bytes`` are refused unread.
    """
    path = Path(path)
    _fmt, t, unit, prompt, output, blocks = read_trace_file(path, max_bytes)
    order = np.argsort(t, kind="stable")
    t = t[order]
    return RequestArrivals(
        times=(t - t[0]).astype(np.float64) * unit,
        prompt_lens=np.asarray(prompt, np.int64)[order],
        output_lens=np.asarray(output, np.int64)[order],
        block_ids=None if blocks is None else tuple(blocks[i] for i in order),
        source=path.name,
    )


def default_arrivals(name: str) -> RequestArrivals:
    """A shipped trace by name, ``"azure_conv"`` or ``"mooncake_conv"`` (DEFAULT_ARRIVALS)."""
    key = str(name).strip().lower()
    if key not in DEFAULT_ARRIVALS:
        raise ValueError(f"unknown shipped arrivals {name!r}; valid names: "
                         f"{', '.join(DEFAULT_ARRIVALS)}")
    return load_arrivals(_DATA / DEFAULT_ARRIVALS[key])


# -- derived records ---------------------------------------------------------------------------
def scale_to_rate(arrivals: RequestArrivals, rate: float) -> RequestArrivals:
    """The same arrivals with every time multiplied by one factor so the mean rate is ``rate``.

    One factor ``f = mean_rate / rate`` for all times keeps the order and every ratio of
    inter-arrival gaps (the burst structure), unlike a Poisson process at the new rate.
    ``rate`` in requests/s; needs at least two arrivals over a positive span.
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (
            math.isfinite(rate) and rate > 0):
        raise ValueError(f"scale_to_rate: rate must be finite and > 0 req/s, got {rate!r}")
    factor = arrivals.mean_rate / float(rate)
    return arrivals._take(slice(None), times=arrivals.times * factor,
                          source=f"{arrivals.source}@{float(rate):g}rps")


def window(arrivals: RequestArrivals, start_s: float, duration_s: float) -> RequestArrivals:
    """Arrivals in ``[start_s, start_s + duration_s)``, their times shifted by ``-start_s``."""
    for name, v in (("start_s", start_s), ("duration_s", duration_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                math.isfinite(v) and v >= 0):
            raise ValueError(f"window: {name} must be finite and >= 0, got {v!r}")
    t = arrivals.times
    keep = (t >= start_s) & (t < start_s + duration_s)
    return arrivals._take(keep, times=t[keep] - float(start_s))


def head(arrivals: RequestArrivals, n: int) -> RequestArrivals:
    """The first ``n`` arrivals (all of them when there are fewer)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"head: n must be a non-negative integer, got {n!r}")
    return arrivals._take(slice(0, int(n)))


def clip_lengths(arrivals: RequestArrivals, max_context_tokens: int) -> RequestArrivals:
    """Lengths clipped so prompt + output fits ``max_context_tokens`` (a model's window or
    what a decode worker's KV holds).

    A prompt keeps its LEADING ``max_context_tokens - 1`` tokens at most (so shared
    prefixes survive; its block ids are cut to match), and the output is cut to what the
    context has left. Requests within the limit are unchanged.
    """
    if isinstance(max_context_tokens, bool) or not isinstance(
            max_context_tokens, (int, np.integer)) or max_context_tokens < 2:
        raise ValueError("clip_lengths: max_context_tokens must be an integer >= 2, got "
                         f"{max_context_tokens!r}")
    m = int(max_context_tokens)
    prompt = np.minimum(arrivals.prompt_lens, m - 1)
    output = np.minimum(arrivals.output_lens, m - prompt)
    blocks = arrivals.block_ids
    if blocks is not None:
        bt = arrivals.block_tokens
        blocks = tuple(b[: -(-int(p) // bt)] for b, p in zip(blocks, prompt, strict=True))
    return RequestArrivals(times=arrivals.times, prompt_lens=prompt, output_lens=output,
                           block_ids=blocks, source=arrivals.source,
                           block_tokens=arrivals.block_tokens)


def sim_arrivals(arrivals: RequestArrivals) -> tuple[np.ndarray, np.ndarray]:
    """``(times (N,) float64, trace_index (N,) int64)`` for ``eldr.sim.simulate(arrivals=)``
    with the trace of :func:`arrivals_trace` (request i of that trace is arrival i)."""
    return arrivals.times.copy(), np.arange(arrivals.num_requests, dtype=np.int64)


# -- routing for the replayed lengths ------------------------------------------------------------
def arrivals_trace(arrivals: RequestArrivals, model, workload="language", *, seed: int = 0,
                   block_size: int = 16, progress: bool = False,
                   gate_sums: bool = True) -> Trace:
    """An expert-routing trace with one request per arrival, of exactly its lengths.

    Routing comes from :func:`eldr.traces.synth.generate` (count path, no per-token top-k)
    for ``model`` on ``workload`` with explicit lengths; the calibrated parameters are
    unchanged. The real traces carry no content, so the domain mixture is the workload's:
    ``language`` by default, the WildChat-like chat mix, since both shipped traces are
    conversation services. Output lengths below 1 become 1 (the trace format's first token
    comes out of prefill). Lengths are NOT clipped here: clip them first
    (:func:`clip_lengths`) to fit a model's window or a decode worker's KV.

    Prompt token ids: with block ids (Mooncake), each 512-token block's tokens are a pure
    function of its block id, so requests with the same leading block ids get the same
    leading token ids and the simulator's prefix cache and prefill affinity see the real
    sharing; tokens past the listed blocks are unique to their request. Without block ids
    (Azure) the trace has no token ids (no affinity, no prefix hits). Routing counts of
    shared blocks are NOT shared (each request's prompt is routed as a whole).
    ``block_size`` is the trace's KV block size (prefix-cache granularity).
    ``gate_sums=False``: no summed gate outputs, everything else the same
    (:func:`~eldr.traces.synth.generate`).
    """
    n = arrivals.num_requests
    if n < 1:
        raise ValueError(f"arrivals_trace: {arrivals.source} has no requests")
    output = np.maximum(arrivals.output_lens, 1)
    trace = generate(model, workload, seed=seed, keep_topk=False, block_size=block_size,
                     lengths=(arrivals.prompt_lens, output), progress=progress,
                     gate_sums=gate_sums)
    ids = None
    if arrivals.block_ids is not None:
        ids = _block_token_ids(arrivals, get_preset(model).vocab_size)
    meta = trace.meta
    return replace(trace, _cache={}, prompt_token_ids=ids,
                   meta=replace(meta, source=f"{meta.source}+arrivals:{arrivals.source}"))


def calibration_and_replay(arrivals: RequestArrivals, model, workload="language", *,
                           num_calibration: int, seed: int = 0, block_size: int = 16,
                           progress: bool = False,
                           gate_sums: bool = True) -> tuple[Trace, Trace]:
    """(calibration trace, replay trace) from ONE synthetic draw, so both share the latent
    routing structure of ``seed`` while no replayed request is also a calibration request.

    The replay trace is :func:`arrivals_trace`'s: request i is arrival i (use
    :func:`sim_arrivals`). The ``num_calibration`` calibration requests take the (prompt,
    output, block ids) of arrivals drawn with replacement (seeded by ``seed``): real
    lengths, fresh routing draws. Fit on the first, replay the second. ``gate_sums``: as
    for :func:`arrivals_trace`.
    """
    if isinstance(num_calibration, bool) or not isinstance(num_calibration, (int, np.integer)) \
            or num_calibration < 1:
        raise ValueError("calibration_and_replay: num_calibration must be a positive integer, "
                         f"got {num_calibration!r}")
    n, c = arrivals.num_requests, int(num_calibration)
    if n < 1:
        raise ValueError(f"calibration_and_replay: {arrivals.source} has no requests")
    pick = np.random.default_rng((int(seed), 0xCA1B)).integers(0, n, size=c)
    both = RequestArrivals(
        times=np.concatenate([np.zeros(c), arrivals.times]),
        prompt_lens=np.concatenate([arrivals.prompt_lens[pick], arrivals.prompt_lens]),
        output_lens=np.concatenate([arrivals.output_lens[pick], arrivals.output_lens]),
        block_ids=None if arrivals.block_ids is None
        else tuple(arrivals.block_ids[i] for i in pick) + arrivals.block_ids,
        source=arrivals.source, block_tokens=arrivals.block_tokens)
    trace = arrivals_trace(both, model, workload, seed=seed, block_size=block_size,
                           progress=progress, gate_sums=gate_sums)
    return trace.subset(np.arange(c)), trace.subset(np.arange(c, c + n))


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 (wrapping arithmetic): a fixed, portable bit mixer."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _block_token_ids(arrivals: RequestArrivals, vocab: int) -> np.ndarray:
    """(Σ prompt_lens,) int32 token ids in ``[256, vocab)`` (first 256 left to specials).

    Token j of block id b is ``mix(b · block_tokens + j)``; token p of request r past its
    listed blocks is ``mix(2^63 + r · 2^32 + p)`` (a key no block token can take while
    block ids stay below 2^54), so it matches nothing else. Built request by request to
    keep the temporary (uint64) arrays small.
    """
    bt = np.uint64(arrivals.block_tokens)
    span = np.uint64(vocab - 256)
    parts = []
    for r, (p, b) in enumerate(zip(arrivals.prompt_lens, arrivals.block_ids, strict=True)):
        if b.size and int(b.max()) >= 1 << 54:
            raise ValueError(f"{arrivals.source}: request {r} has block id {int(b.max())} "
                             ">= 2^54, too large for token derivation")
        pos = np.arange(int(p), dtype=np.uint64)
        key = np.uint64(1 << 63) + np.uint64(r) * np.uint64(1 << 32) + pos
        blk = (pos // bt).astype(np.int64)
        listed = blk < b.size
        if listed.any():
            key[listed] = b.astype(np.uint64)[blk[listed]] * bt + pos[listed] % bt
        parts.append((np.uint64(256) + _mix64(key) % span).astype(np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)
