"""Atomic file writes: readers see the old file or the new one, never half of one.

Every file ELDR writes (traces, artifacts, placements, reports) goes through
:func:`atomic_file`: a temporary file in the target's folder, then ``os.replace``. The
temporary file gets the permissions a plain ``open(path, "w")`` would have (0666 minus the
umask), not ``mkstemp``'s private 0600, so a written trace is readable like any other file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_file", "atomic_write_text", "default_dir_mode", "default_file_mode"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """0666 minus the process umask (what ``open(..., "w")`` would create)."""
    return 0o666 & ~_umask()


def default_dir_mode() -> int:
    """0777 minus the process umask (what ``mkdir`` would create; ``mkdtemp`` uses 0700)."""
    return 0o777 & ~_umask()


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """``with atomic_file(p) as fh: ...`` writes ``p`` atomically; on error ``p`` is untouched."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, default_file_mode())
        kw = {"encoding": "utf-8", "newline": ""} if mode == "w" else {}
        with os.fdopen(fd, mode, **kw) as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and return the path."""
    with atomic_file(path, "w") as fh:
        fh.write(text)
    return Path(path)
