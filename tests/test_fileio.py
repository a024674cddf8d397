from __future__ import annotations

import os

import pytest

from eldr.fileio import atomic_file, atomic_write_text, default_dir_mode, default_file_mode


def test_writes_and_replaces(tmp_path):
    p = atomic_write_text(tmp_path / "sub" / "a.txt", "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two"
    assert sorted(x.name for x in p.parent.iterdir()) == ["a.txt"]


def test_failure_leaves_old_file_and_no_temp(tmp_path):
    p = atomic_write_text(tmp_path / "a.bin", "old")
    with pytest.raises(RuntimeError), atomic_file(p) as fh:
        fh.write(b"half")
        raise RuntimeError("boom")
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["a.bin"]


def test_permissions_follow_umask_not_mkstemp(tmp_path):
    old = os.umask(0o022)
    try:
        p = atomic_write_text(tmp_path / "a.txt", "x")
        assert default_file_mode() == 0o644 and default_dir_mode() == 0o755
        assert (p.stat().st_mode & 0o777) == 0o644
    finally:
        os.umask(old)


def test_bad_mode_refused(tmp_path):
    with pytest.raises(ValueError, match="mode"), atomic_file(tmp_path / "a", "a"):
        pass


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path):
    from eldr.fileio import atomic_directory

    target = tmp_path / "art"
    with atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("one")
    with atomic_directory(target) as tmp:
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]  # replaced whole
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "c.txt").write_text("half")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temp or old left
