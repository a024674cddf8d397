"""The learn buffer: completed requests kept as a rolling calibration trace.

Each completed request gives a :class:`Record`: its prompt's expert counts (L, E) from the
prefill response, its decode counts (L, E) when the engines report them (issue 13 item 2;
optional), how many tokens each covers, and the decoder it went to. :class:`LearnBuffer`
keeps the newest ``max_requests`` (the oldest is dropped) and turns them into a trace in
the project's format (docs/trace-format.md), so ``eldr fit``, ``eldr score`` and the
simulator read it like any other:

- ``prompt_lens[r]`` is the number of tokens the prefill counted (``k`` selections per
  layer each), the whole prompt: the router does not offer counts of part of a prompt
  (:func:`eldr.proxy.control.learning.read_parts`);
- a request WITH decode counts has ``output_lens[r] = decode tokens + 1`` (the trace's
  token convention); one WITHOUT has ``decode_counts[r] = 0`` and ``output_lens[r] = 1``
  (no decode routing observed). ``decode_known`` says which is which, and the generated
  length the answer reported (if any) is kept beside the trace;
- ``domains`` / ``domain_names`` name the decoder each request went to.

A record may also keep its prompt as the prompt predictor sees it
(:mod:`eldr.fit.prompt`): the sorted bag of its hashed unigrams and bigrams
(:func:`~eldr.fit.prompt.ngram_hashes`) and its largest token id, never the token ids or
the text. The order of the n-grams is gone, so the prompt cannot be read back in order.

On disk (:func:`save`, :func:`load`) the buffer is a directory ``DIR/buffer`` holding
``trace.npz`` (a valid trace), ``learn.json`` (what the format has no field for:
``decode_known``, reported output tokens, completion times, counters and the learner's
state) and, when any record has them, ``prompts.npz`` (the hashed n-gram bags, flat, with
offsets). The directory is written whole next to the old one and renamed into place, so a
reader (or a restart after a crash) sees the old buffer or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr.fileio import atomic_directory, open_regular
from eldr.traces import trace as trace_io
from eldr.traces.trace import Trace, TraceMeta

__all__ = ["LearnBuffer", "Record", "load", "make_record", "records_to_trace", "save"]

SOURCE = "learned:eldr-serve"
_STATE_VERSION = 1
_MAX_STATE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Record:
    """One completed request, as the learner keeps it."""

    prefill_counts: np.ndarray  # (L, E) int32 prompt tokens that chose expert e at layer l
    prompt_tokens: int  # tokens the prefill counts cover (each layer sums to k * this)
    decoder: str  # name of the decoder the request went to
    time: float  # completion time (time.time())
    decode_counts: np.ndarray | None = None  # (L, E) int32 decode selections, or None
    output_tokens: int | None = None  # generated tokens the answer reported, or None
    # the prompt's hashed unigrams and bigrams (2P - 1,) uint64, sorted (order gone), or None
    prompt_hashes: np.ndarray | None = None
    max_token_id: int | None = None  # the prompt's largest token id (the vocabulary seen)


def _per_layer_tokens(counts: np.ndarray, top_k: int, what: str) -> int:
    sums = counts.sum(axis=1, dtype=np.int64)
    if sums.size == 0 or (sums != sums[0]).any():
        raise ValueError(f"{what} counts differ between layers")
    if sums[0] % top_k:
        raise ValueError(f"{what} counts ({int(sums[0])} a layer) are not a multiple of "
                         f"k={top_k}")
    return int(sums[0] // top_k)


def make_record(prefill_counts, *, top_k: int, decoder: str, time: float,
                tokens: int | None = None, decode_counts=None,
                output_tokens: int | None = None, prompt_ids=None) -> Record:
    """A validated :class:`Record`; ``ValueError`` names what is inconsistent.

    ``tokens`` (the payload's counted tokens) must match the counts (k per layer each);
    decode counts that do not hold ``k`` selections per decoded token on every layer are
    refused with the record (the caller may retry without them). ``prompt_ids``: the
    prompt's token ids, kept only as their hashed n-gram bag, and only when they are as
    many as the counted tokens and valid ids (else the record is kept without them).
    """
    c = np.asarray(prefill_counts)
    if c.ndim != 2 or not np.issubdtype(c.dtype, np.integer) or (c.size and c.min() < 0):
        raise ValueError(f"prefill counts must be (L, E) non-negative integers, got "
                         f"{c.shape} {c.dtype}")
    counted = _per_layer_tokens(c, top_k, "prefill")
    if tokens is not None and tokens != counted:
        raise ValueError(f"prefill counts cover {counted} tokens, the payload says {tokens}")
    d = None
    if decode_counts is not None:
        d = np.asarray(decode_counts)
        if d.shape != c.shape or not np.issubdtype(d.dtype, np.integer) or \
                (d.size and d.min() < 0):
            raise ValueError(f"decode counts must be {c.shape} non-negative integers, got "
                             f"{d.shape} {d.dtype}")
        _per_layer_tokens(d, top_k, "decode")
        d = d.astype(np.int32)
    if output_tokens is not None and (isinstance(output_tokens, bool) or output_tokens < 1):
        output_tokens = None
    bag, top = _prompt_bag(prompt_ids, counted)
    return Record(c.astype(np.int32), counted, str(decoder), float(time), d, output_tokens,
                  bag, top)


def _prompt_bag(prompt_ids, counted: int) -> tuple[np.ndarray | None, int | None]:
    """(sorted hashed n-gram bag, largest id) of valid prompt ids of ``counted`` tokens."""
    if prompt_ids is None:
        return None, None
    from eldr.fit.prompt import ngram_hashes

    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or ids.size != counted or ids.size == 0 or ids.dtype.kind not in "iu" \
            or int(ids.min()) < 0 or int(ids.max()) >= 1 << 31:
        return None, None
    return np.sort(ngram_hashes(ids.astype(np.int64))), int(ids.max())


def records_to_trace(records, *, model: str, top_k: int) -> tuple[Trace, np.ndarray]:
    """(trace, decode_known (R,) bool) of ``records`` (module docstring for the fields)."""
    if not records:
        raise ValueError("no requests collected yet")
    L, E = records[0].prefill_counts.shape
    R = len(records)
    prefill = np.stack([r.prefill_counts for r in records]).astype(np.int32)
    decode = np.zeros((R, L, E), dtype=np.int32)
    known = np.zeros(R, dtype=bool)
    out = np.ones(R, dtype=np.int64)
    for i, r in enumerate(records):
        if r.decode_counts is not None:
            decode[i] = r.decode_counts
            known[i] = True
            out[i] = int(r.decode_counts[0].sum()) // top_k + 1
    names = sorted({r.decoder for r in records})
    domains = np.array([names.index(r.decoder) for r in records], dtype=np.int32)
    meta = TraceMeta(model=model, num_layers=int(L), num_experts=int(E), top_k=int(top_k),
                     source=SOURCE)
    trace = Trace(meta=meta, prefill_counts=prefill, decode_counts=decode,
                  prompt_lens=np.array([r.prompt_tokens for r in records], dtype=np.int64),
                  output_lens=out, domains=domains, domain_names=tuple(names))
    return trace, known


class LearnBuffer:
    """The newest ``max_requests`` records of one model (same L, E, k), oldest dropped.

    Appending is O(1) on the event loop; :meth:`snapshot` copies references only (records
    are immutable), so building a trace from it can happen in another thread or process.
    """

    def __init__(self, max_requests: int) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.max_requests = max_requests
        self._records: deque[Record] = deque(maxlen=max_requests)
        self.model = "unknown"  # the served model's name, when known
        self.top_k: int | None = None  # k of the model, fixed by the first record
        self.num_seen = 0  # records ever added (a restart keeps counting)
        self.num_dropped = 0  # records pushed out by the bound

    def __len__(self) -> int:
        return len(self._records)

    @property
    def shape(self) -> tuple[int, int] | None:
        """(L, E) of the buffered model, or None while empty and never fixed."""
        return None if not self._records else self._records[0].prefill_counts.shape

    @property
    def num_with_decode(self) -> int:
        return sum(r.decode_counts is not None for r in self._records)

    def add(self, record: Record) -> None:
        """Append; a record of another (L, E) than the buffered ones is refused."""
        shape = self.shape
        if shape is not None and record.prefill_counts.shape != shape:
            raise ValueError(f"counts of shape {record.prefill_counts.shape}, the buffer "
                             f"holds {shape}")
        if len(self._records) == self.max_requests:
            self.num_dropped += 1
        self._records.append(record)
        self.num_seen += 1

    def snapshot(self, last: int | None = None) -> list[Record]:
        """The newest ``last`` records (all by default), oldest first."""
        recs = list(self._records)
        return recs if last is None or last >= len(recs) else recs[len(recs) - last:]

    def to_trace(self, last: int | None = None) -> tuple[Trace, np.ndarray]:
        if self.top_k is None:
            raise ValueError("no requests collected yet")
        return records_to_trace(self.snapshot(last), model=self.model, top_k=self.top_k)


# -- persistence ------------------------------------------------------------------------------
def save(buffer_dir: str | os.PathLike, records: list[Record], *, model: str,
         top_k: int | None, num_seen: int, num_dropped: int, state: dict) -> Path:
    """Write ``records`` and the learner's ``state`` to ``buffer_dir`` (replaced whole)."""
    target = Path(buffer_dir)
    with atomic_directory(target) as tmp:
        doc = {"version": _STATE_VERSION, "model": model, "top_k": top_k,
               "num_seen": int(num_seen), "num_dropped": int(num_dropped), "state": state,
               "decode_known": [], "output_tokens": [], "times": []}
        if records:
            trace, known = records_to_trace(records, model=model, top_k=int(top_k))
            trace_io.save(trace, tmp / "trace.npz")
            doc.update(decode_known=[int(x) for x in known],
                       output_tokens=[r.output_tokens for r in records],
                       times=[round(r.time, 3) for r in records])
            if any(r.prompt_hashes is not None for r in records):
                _save_prompts(tmp / _PROMPTS, records)
        (tmp / "learn.json").write_text(json.dumps(doc) + "\n")
    return target


def load(buffer_dir: str | os.PathLike) -> tuple[list[Record], dict]:
    """(records, document) written by :func:`save`; ([], {}) when there is none yet.

    A crash between the two renames of :func:`save` leaves only the previous buffer under
    its ``.old`` name: it is read then. Everything is validated; a damaged buffer raises
    ``ValueError`` naming the file (the router then refuses to start rather than silently
    dropping what it learned).
    """
    target = Path(buffer_dir)
    if not target.exists():
        olds = sorted(target.parent.glob(f".{target.name}.*.old"))
        if not olds:
            return [], {}
        target = olds[-1]
    try:
        with open_regular(target / "learn.json", max_bytes=_MAX_STATE_BYTES,
                          what="a learn state") as fh:
            doc = json.loads(fh.read().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{target}: not a learn buffer (no learn.json)") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{target / 'learn.json'}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != _STATE_VERSION:
        raise ValueError(f"{target / 'learn.json'}: not a version {_STATE_VERSION} learn state")
    known = doc.get("decode_known") or []
    if not known:
        return [], doc
    trace = trace_io.load(target / "trace.npz")
    outs, times = doc.get("output_tokens") or [], doc.get("times") or []
    if not (len(known) == len(outs) == len(times) == trace.num_requests):
        raise ValueError(f"{target}: learn.json describes {len(known)} requests, trace.npz "
                         f"holds {trace.num_requests}")
    names = trace.domain_names or ()
    records = []
    for i in range(trace.num_requests):
        decoder = names[trace.domains[i]] if trace.domains is not None else "?"
        out = outs[i] if isinstance(outs[i], int) and outs[i] >= 1 else None
        records.append(Record(trace.prefill_counts[i], int(trace.prompt_lens[i]), decoder,
                              float(times[i]),
                              trace.decode_counts[i] if known[i] else None, out))
    if (target / _PROMPTS).exists():
        records = _load_prompts(target / _PROMPTS, records)
    return records, doc


_PROMPTS = "prompts.npz"


def _save_prompts(path: Path, records: list[Record]) -> None:
    """``hashes`` (flat uint64), ``offsets`` (R + 1,) int64 and ``max_ids`` (R,) int64
    (-1: that record has no prompt bag)."""
    bags = [r.prompt_hashes if r.prompt_hashes is not None else np.empty(0, np.uint64)
            for r in records]
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([b.size for b in bags])
    max_ids = np.array([-1 if r.max_token_id is None else r.max_token_id for r in records],
                       dtype=np.int64)
    with open(path, "wb") as fh:
        np.savez(fh, hashes=np.concatenate(bags).astype(np.uint64), offsets=offsets,
                 max_ids=max_ids)


def _load_prompts(path: Path, records: list[Record]) -> list[Record]:
    """``records`` with their prompt bags from ``path``; ValueError naming a damaged file."""
    from dataclasses import replace

    try:
        with np.load(path, allow_pickle=False) as z:
            hashes, offsets, max_ids = z["hashes"], z["offsets"], z["max_ids"]
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a learn buffer's prompt bags ({exc})") from None
    R = len(records)
    if hashes.dtype != np.uint64 or hashes.ndim != 1 or offsets.shape != (R + 1,) or \
            max_ids.shape != (R,) or offsets[0] != 0 or offsets[-1] != hashes.size or \
            (np.diff(offsets) < 0).any():
        raise ValueError(f"{path}: prompt bags inconsistent with the {R} buffered requests")
    out = []
    for i, r in enumerate(records):
        bag = hashes[offsets[i]:offsets[i + 1]]
        has = bag.size > 0 and max_ids[i] >= 0
        out.append(replace(r, prompt_hashes=bag.copy() if has else None,
                           max_token_id=int(max_ids[i]) if has else None))
    return out


def restore(buffer: LearnBuffer, buffer_dir: str | os.PathLike) -> dict:
    """Fill ``buffer`` from ``buffer_dir`` (newest records kept); returns the saved state."""
    records, doc = load(buffer_dir)
    if doc:
        buffer.model = str(doc.get("model") or buffer.model)
        k = doc.get("top_k")
        buffer.top_k = int(k) if isinstance(k, int) and k > 0 else buffer.top_k
    for r in records[-buffer.max_requests:]:
        buffer._records.append(r)
    buffer.num_seen = int(doc.get("num_seen", len(records))) if doc else 0
    buffer.num_dropped = int(doc.get("num_dropped", 0)) if doc else 0
    state = doc.get("state") if doc else None
    return state if isinstance(state, dict) else {}
