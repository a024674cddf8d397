"""Readers of the two request-trace file formats (private to :mod:`eldr.traces.arrivals`).

Both readers return raw per-line values (integer time stamps, lengths, block ids) in file
order; :func:`eldr.traces.arrivals.load_arrivals` sorts them and builds the record. Every
malformed line raises ValueError naming the file, the line (as an editor counts them) and
the field; nothing is returned for a file with any bad line.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from pathlib import Path

import numpy as np

MAX_FILE_BYTES = 256 << 20  # refuse larger files before reading (the shipped ones are < 4 MB)

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def detect_format(path: str | os.PathLike) -> str:
    """``"azure_csv"`` or ``"mooncake_jsonl"``, from the first non-blank line's content.

    A line starting with ``{`` is Mooncake JSONL; a CSV header naming ``TIMESTAMP``,
    ``ContextTokens`` and ``GeneratedTokens`` is Azure. Anything else raises ValueError.
    """
    path = Path(path)
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                return _format_of(path, line)
    raise ValueError(f"{path}: empty file, no requests")


def _format_of(path: Path, first: str) -> str:
    if first.lstrip().startswith("{"):
        return "mooncake_jsonl"
    header = [c.strip() for c in next(csv.reader([first]))]
    if all(c in header for c in _AZURE_COLUMNS):
        return "azure_csv"
    raise ValueError(f"{path}: line 1 is neither a Mooncake JSON object nor an Azure CSV header "
                     f"with columns {', '.join(_AZURE_COLUMNS)}; got {first[:80]!r}")


def _open_text(path: Path, max_bytes: int = MAX_FILE_BYTES) -> io.TextIOWrapper:
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path}: {size} bytes is above the {max_bytes}-byte limit "
                         "(pass max_bytes= to read it anyway)")
    return open(path, encoding="utf-8", newline="")  # the caller closes it


def read_trace_file(path: Path, max_bytes: int = MAX_FILE_BYTES):
    """(format, stamps (N,) int64, seconds per stamp unit, prompt, output, blocks or None).

    Stamps are integer nanoseconds (Azure) or milliseconds (Mooncake), so differences are
    exact; blank lines are skipped.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"load_arrivals: max_bytes must be a positive integer, got {max_bytes!r}")
    try:
        with _open_text(path, max_bytes) as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    # split on "\n" only (str.splitlines also splits on form feeds etc.): line numbers
    # in errors are the ones an editor shows; csv and json accept a trailing "\r"
    lines = text.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise ValueError(f"{path}: empty file, no requests")
    fmt = _format_of(path, lines[first])
    if fmt == "azure_csv":
        stamps, prompt, output, blocks = _read_azure(path, lines, first)
    else:
        stamps, prompt, output, blocks = _read_mooncake(path, lines)
    if not stamps:
        raise ValueError(f"{path}: no requests after the header")
    unit = 1e-9 if fmt == "azure_csv" else 1e-3
    return fmt, np.asarray(stamps, dtype=np.int64), unit, prompt, output, blocks


def _bad(path: Path, line: int, field: str, why: str) -> ValueError:
    return ValueError(f"{path}: line {line}, field {field!r}: {why}")


def _count(path: Path, line: int, field: str, value, *, text: bool = False) -> int:
    """A non-negative integer token count: CSV decimal digits (``text``) or a JSON int."""
    if text and isinstance(value, str):
        text = value.strip()
        if not text.isdigit():
            raise _bad(path, line, field, f"expected a non-negative integer, got {value!r}")
        return int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(path, line, field, f"expected a non-negative integer, got {value!r}")
    return value


def _read_azure(path: Path, lines: list[str], first: int):
    header = [c.strip() for c in next(csv.reader([lines[first]]))]
    col = {name: header.index(name) for name in _AZURE_COLUMNS}
    stamps, prompt, output = [], [], []
    for i, row in enumerate(csv.reader(lines[first + 1:]), start=first + 2):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) != len(header):
            raise _bad(path, i, "*", f"expected {len(header)} columns, got {len(row)}")
        m = _AZURE_TIME.fullmatch(row[col["TIMESTAMP"]].strip())
        if m is None:
            raise _bad(path, i, "TIMESTAMP", "expected 'YYYY-MM-DD HH:MM:SS.fffffff', got "
                       f"{row[col['TIMESTAMP']]!r}")
        day, hh, mm, ss, frac = m.groups()
        try:
            ordinal = np.datetime64(day, "D").astype(np.int64)
        except ValueError:
            raise _bad(path, i, "TIMESTAMP", f"invalid date {day!r}") from None
        if int(hh) > 23 or int(mm) > 59 or int(ss) > 60:
            raise _bad(path, i, "TIMESTAMP", f"invalid time {hh}:{mm}:{ss}")
        secs = int(ordinal) * 86400 + int(hh) * 3600 + int(mm) * 60 + int(ss)
        stamps.append(secs * 10**9 + int((frac or "0").ljust(9, "0")))
        prompt.append(_count(path, i, "ContextTokens", row[col["ContextTokens"]], text=True))
        output.append(_count(path, i, "GeneratedTokens", row[col["GeneratedTokens"]],
                             text=True))
    return stamps, prompt, output, None


def _read_mooncake(path: Path, lines: list[str]):
    stamps, prompt, output, blocks = [], [], [], []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise _bad(path, i, "*", f"not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(rec, dict):
            raise _bad(path, i, "*", f"expected a JSON object, got {type(rec).__name__}")
        for key in _MOONCAKE_KEYS:
            if key not in rec:
                raise _bad(path, i, key, "missing")
        ts = rec["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
                or ts < 0:
            raise _bad(path, i, "timestamp", f"expected milliseconds >= 0, got {ts!r}")
        if ts != int(ts):
            raise _bad(path, i, "timestamp", f"expected whole milliseconds, got {ts!r}")
        ids = rec["hash_ids"]
        if not isinstance(ids, list) or any(isinstance(x, bool) or not isinstance(x, int)
                                            or x < 0 for x in ids):
            raise _bad(path, i, "hash_ids", "expected a list of non-negative integers")
        stamps.append(int(ts))
        prompt.append(_count(path, i, "input_length", rec["input_length"]))
        output.append(_count(path, i, "output_length", rec["output_length"]))
        blocks.append(np.asarray(ids, dtype=np.int64))
    return stamps, prompt, output, blocks
