"""Progress bars on stderr for long commands: a thin wrapper over ``tqdm``.

Shown only when stderr is a terminal, or when ``ELDR_PROGRESS=1`` (``ELDR_PROGRESS=0``
silences them on a terminal too); silent in tests and CI logs unless asked for. ``tqdm``
is imported only when a bar is shown, and a hidden bar's ``update`` is one addition (the
simulator calls it every step).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _enabled() -> bool:
    flag = os.environ.get("ELDR_PROGRESS")
    if flag is not None:
        return flag not in ("", "0", "false", "no")
    return sys.stderr.isatty()


class Progress:
    """``with Progress(total, "fitting") as bar: bar.update(1)``.

    ``enabled`` None follows :func:`_enabled` (a terminal, or ``ELDR_PROGRESS``); False
    hides the bar whatever the environment says.
    """

    def __init__(self, total: int | None, desc: str, *, enabled: bool | None = None) -> None:
        self.total = total
        self.desc = desc
        self.done = 0
        self.enabled = _enabled() if enabled is None else enabled
        self._bar = None  # the tqdm bar while open and shown

    def __enter__(self) -> Progress:
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, file=sys.stderr,
                             dynamic_ncols=True, mininterval=0.1, leave=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)


def track(items: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    """Iterate ``items`` while drawing a progress bar."""
    with Progress(total, desc) as bar:
        for item in items:
            yield item
            bar.update(1)
