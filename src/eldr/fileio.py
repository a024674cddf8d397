"""Files in and out: atomic writes, and defensive reads of files ELDR did not write.

Every file ELDR writes (traces, artifacts, placements, reports) goes through
:func:`atomic_file`: a temporary file in the target's folder, then ``os.replace``. The
temporary file gets the permissions a plain ``open(path, "w")`` would have (0666 minus the
umask), not ``mkstemp``'s private 0600, so a written trace is readable like any other file.

Every file ELDR reads (traces, artifacts) is opened with :func:`open_regular` (a FIFO or a
device is refused without blocking; the size is capped before a byte is read) and its
``.npz`` arrays are read with :class:`NpzReader`: each member must be a ``.npy`` array,
its header (shape, dtype) is checked against what the caller expects BEFORE its data is
decompressed, object arrays are refused (they need pickle), and the declared bytes are
capped, so a small file cannot inflate into gigabytes. Failures are one-line
``ValueError``s naming the file and the problem.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import stat
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, BinaryIO

import numpy as np

__all__ = ["NpzReader", "atomic_file", "atomic_write_text", "default_dir_mode",
           "default_file_mode", "open_regular"]

_MAX_NPY_HEADER = 10_000  # bytes of a .npy header (numpy's own default limit)


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


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_directory(d) as tmp: <write files into tmp>`` replaces ``d`` whole.

    ``tmp`` is a fresh directory beside ``d`` (same file system, so the final rename is
    atomic). On success an existing ``d`` is moved aside, ``tmp`` renamed to ``d`` and the
    old one removed (a directory cannot be renamed over a non-empty one); on any error
    ``tmp`` is removed and ``d`` is left as it was. Readers never see a half-written ``d``.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    old = None
    try:
        os.chmod(tmp, default_dir_mode())
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.{os.getpid()}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not target.exists():
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and return the path."""
    with atomic_file(path, "w") as fh:
        fh.write(text)
    return Path(path)


def open_regular(path: str | os.PathLike, *, max_bytes: int, what: str) -> BinaryIO:
    """``path`` opened for binary reading, if it is a regular file of at most ``max_bytes``.

    The file is opened non-blocking and checked on its descriptor (no race between a check
    and the open): a FIFO would otherwise block the open until a writer came, and a reader
    stuck there cannot even be stopped by SIGTERM. ``what`` names the file in errors
    ("a trace"). A missing file raises ``FileNotFoundError`` (an ``OSError``).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file (cannot be {what})")
        if st.st_size > max_bytes:
            raise ValueError(f"{path}: {st.st_size} bytes, over the {max_bytes}-byte limit "
                             f"for {what}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class NpzReader:
    """Reads the ``.npy`` members of an ``.npz`` archive one at a time, checking each.

    ``NpzReader(fh, max_bytes=N, where=path)``: ``names`` are the members (without
    ``.npy``); :meth:`read` checks a member's header with the caller's ``check(shape,
    dtype)`` (raise ``ValueError`` for an unexpected one) before its data is decompressed.
    ``max_bytes`` bounds the bytes all members read so far may declare together.
    """

    def __init__(self, fh: BinaryIO, *, max_bytes: int, where: str | os.PathLike) -> None:
        self.where = str(where)
        self.max_bytes = max_bytes
        self.num_bytes = 0  # declared bytes of the members read so far
        try:
            self._zip = zipfile.ZipFile(fh)
            infos = self._zip.infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as exc:
            raise ValueError(f"{self.where}: not a readable .npz archive ({exc})") from None
        self._members: dict[str, zipfile.ZipInfo] = {}
        for info in infos:
            if not info.filename.endswith(".npy") or info.is_dir():
                raise ValueError(f"{self.where}: member {info.filename!r} is not a .npy array")
            name = info.filename[:-4]
            if name in self._members:
                raise ValueError(f"{self.where}: member {info.filename!r} appears twice")
            self._members[name] = info

    @property
    def names(self) -> list[str]:
        return list(self._members)

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> NpzReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, name: str, check: Callable[[tuple, np.dtype], None] | None = None
             ) -> np.ndarray:
        """The array ``name``; ``check(shape, dtype)`` runs on its header first."""
        info = self._members.get(name)
        if info is None:
            raise ValueError(f"{self.where}: no member {name!r}")
        try:
            with self._zip.open(info) as member:
                shape, fortran, dtype = self._header(member, name)
                if check is not None:
                    try:
                        check(shape, dtype)
                    except ValueError as exc:
                        raise ValueError(f"{self.where}: {exc}") from None
                count = math.prod(shape)
                size = count * dtype.itemsize
                if self.num_bytes + size > self.max_bytes:
                    raise ValueError(f"{self.where}: {name!r} declares shape {list(shape)} "
                                     f"{dtype} ({size} bytes), over the {self.max_bytes}-byte "
                                     f"limit for the whole file")
                if size > info.file_size:
                    raise ValueError(f"{self.where}: {name!r} declares shape {list(shape)} "
                                     f"{dtype} ({size} bytes) but holds {info.file_size}")
                self.num_bytes += size
                arr = np.empty(count, dtype=dtype)
                view = memoryview(arr.view(np.uint8))
                got = 0
                while got < size:
                    n = member.readinto(view[got:])
                    if not n:
                        break
                    got += n
                if got != size or member.read(1):
                    raise ValueError(f"{self.where}: {name!r} holds other than the "
                                     f"{size} bytes its header declares")
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:  # CRC, truncated
            raise ValueError(f"{self.where}: member {name!r} is damaged ({exc})") from None
        return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)

    def _header(self, member, name: str) -> tuple[tuple, bool, np.dtype]:
        fmt = np.lib.format
        try:
            version = fmt.read_magic(member)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(
                    member, max_header_size=_MAX_NPY_HEADER)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = fmt.read_array_header_2_0(
                    member, max_header_size=_MAX_NPY_HEADER)
            else:
                raise ValueError(f"unsupported .npy version {version}")
        except (ValueError, TypeError, SyntaxError, EOFError) as exc:
            raise ValueError(f"{self.where}: member {name!r} is not a .npy array "
                             f"({_one_line(exc)})") from None
        if dtype.hasobject:
            raise ValueError(f"{self.where}: {name!r} is an object array (needs pickle), "
                             f"refused")
        if any(d < 0 for d in shape):
            raise ValueError(f"{self.where}: {name!r} declares a negative dimension")
        return tuple(int(d) for d in shape), bool(fortran), dtype


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]
