"""A dependency-free progress bar on stderr for long commands.

Shown only when stderr is a terminal, or when ``ELDR_PROGRESS=1``; silent in tests and CI
logs unless asked for.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _enabled() -> bool:
    flag = os.environ.get("ELDR_PROGRESS")
    if flag is not None:
        return flag not in ("", "0", "false", "no")
    return sys.stderr.isatty()


class Progress:
    """``with Progress(total, "fitting") as bar: bar.update(1)``."""

    def __init__(self, total: int | None, desc: str, *, enabled: bool | None = None) -> None:
        self.total = total
        self.desc = desc
        self.done = 0
        self.enabled = _enabled() if enabled is None else enabled
        self._start = time.perf_counter()
        self._last = 0.0

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._draw(force=True)
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        self._draw(note=note)

    def _draw(self, *, force: bool = False, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        elapsed = now - self._start
        if self.total:
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            eta = elapsed / frac - elapsed if frac > 0 else 0.0
            text = (f"\r{self.desc}: [{bar:<30}] {self.done}/{self.total} "
                    f"{elapsed:5.1f}s eta {eta:5.1f}s {note}")
        else:
            text = f"\r{self.desc}: {self.done} {elapsed:5.1f}s {note}"
        sys.stderr.write(text[:160])
        sys.stderr.flush()


def track(items: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    """Iterate ``items`` while drawing a progress bar."""
    with Progress(total, desc) as bar:
        for item in items:
            yield item
            bar.update(1)
