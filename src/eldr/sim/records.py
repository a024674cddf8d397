"""What the simulator records of each request: one slotted record per arrival.

A field is ``None`` until the event that sets it has happened (a finished run sets every
field except ``signature_exact``, which only online signature sources fill in). Metrics
read whole columns: :meth:`Requests.column` turns a field into an (N,) array once and
caches it (read-only).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

__all__ = ["RequestRecord", "Requests"]


@dataclass(slots=True)
class RequestRecord:
    """One arrival's life: prefill pool → KV transfer → decode pool (times in seconds)."""

    trace_index: int  # the trace request it replays
    t_arrival: float  # arrival at the prefill router
    prompt_len: int  # prompt tokens
    n_out: int  # output tokens = decode steps it takes
    prefill_worker: int | None = None  # prefill worker the prefix-affinity router chose
    cached_tokens: int | None = None  # prompt tokens served by the prefix cache (0: no hit)
    t_prefill_start: float | None = None  # its prefill batch started
    t_prefill_end: float | None = None  # its prefill batch ended; routed to a decoder then
    decoder: int | None = None  # decode worker the policy chose
    t_kv_done: float | None = None  # its KV reached the decoder (joins the waiting queue)
    t_admit: float | None = None  # admitted into the decoder's running batch
    t_first: float | None = None  # first output token (end of its first decode step)
    t_last: float | None = None  # last output token
    tokens_out: int = 0  # output tokens emitted, set when it finishes
    finishes: int = 0  # times it finished: 1 after a run (a conservation check)
    signature_exact: bool | None = None  # routed signature == the exact one (online sources)


_FIELDS = tuple(f.name for f in fields(RequestRecord))
_FLOAT_FIELDS = frozenset(n for n in _FIELDS if n.startswith("t_"))
_BOOL_FIELDS = frozenset({"signature_exact"})


class Requests(Sequence):
    """The records of one run, in arrival order; also read by column.

    ``requests[i]`` is record i; ``requests["t_first"]`` (or :meth:`column`) the (N,) array
    of a field; ``"signature_exact" in requests`` says whether a column is complete (no
    record lacks it). Records must not change once a result holds them (columns are cached).
    """

    def __init__(self, records: Iterable[RequestRecord]) -> None:
        self._records = list(records)
        self._columns: dict[str, np.ndarray] = {}

    @classmethod
    def from_columns(cls, columns: Mapping[str, Sequence]) -> Requests:
        """Records from equal-length columns (e.g. hand-built results in tests)."""
        names = list(columns)
        unknown = set(names) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown request fields {sorted(unknown)}")
        rows = zip(*(np.asarray(columns[n]).tolist() for n in names), strict=True)
        return cls(RequestRecord(**dict(zip(names, row, strict=True))) for row in rows)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(self._records)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.column(key)
        return self._records[key]

    def __contains__(self, item) -> bool:
        if isinstance(item, str):
            return item in _FIELDS and all(getattr(r, item) is not None for r in self._records)
        return item in self._records

    def column(self, name: str) -> np.ndarray:
        """(N,) array of field ``name``: float64 for times (NaN where still ``None``),
        int64 or bool otherwise (``ValueError`` if any record lacks it)."""
        col = self._columns.get(name)
        if col is not None:
            return col
        if name not in _FIELDS:
            raise KeyError(f"no request field {name!r}; fields: {', '.join(_FIELDS)}")
        values = [getattr(r, name) for r in self._records]
        if name in _FLOAT_FIELDS:
            col = np.array(values, dtype=np.float64)  # None -> NaN
        else:
            if any(v is None for v in values):
                raise ValueError(f"request field {name!r} is unset for some requests")
            col = np.array(values, dtype=bool if name in _BOOL_FIELDS else np.int64)
        col.setflags(write=False)
        self._columns[name] = col
        return col
