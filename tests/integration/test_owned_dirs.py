"""Directories that belong to one process (:mod:`laminar.proc.owned_dirs`) whose owner is a real
process that has exited: the next :func:`make` sweeps them, and leaves another user's alone. The
naming and the privacy are ``tests/unit/test_owned_dirs.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from laminar.proc import owned_dirs, procfs
from tests.unit.test_owned_dirs import me


@pytest.fixture
def root() -> Iterator[Path]:
    """A short directory under the system's temp directory, as for the unit tests."""
    path = Path(tempfile.mkdtemp(prefix="od-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def a_dead_process() -> tuple[int, int]:
    """``(pid, start)`` of a child that has exited and been reaped."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    stat = procfs.stat(child.pid)
    assert stat is not None
    child.communicate(b"")
    return child.pid, stat.start


def named(root: Path, pid: int, start: int, rest: str = "x1y2z3") -> Path:
    path = root / f"{owned_dirs.PREFIX}-{pid}-{start}-{rest}"
    path.mkdir()
    (path / "socket").touch()
    return path


def test_the_next_make_sweeps_directories_whose_owner_is_gone(root: Path) -> None:
    pid, start = me()
    dead = named(root, *a_dead_process())
    recycled = named(root, pid, start + 1)  # this pid, but a process that started later
    live = named(root, pid, start)
    others = [
        root / f"{owned_dirs.PREFIX}-{pid}",  # not named as make names them
        root / f"{owned_dirs.PREFIX}-x-{start}-abc",
        root / "unrelated-1-2-abc",
    ]
    for path in others:
        path.mkdir()
    a_file = root / f"{owned_dirs.PREFIX}-1-1-file"  # a file, not a directory
    a_file.touch()

    path, swept = owned_dirs.make(root=str(root))
    assert sorted(swept) == sorted([dead, recycled])
    assert not dead.exists() and not recycled.exists()
    assert live.is_dir() and (live / "socket").exists() and path.is_dir()
    assert all(p.exists() for p in others) and a_file.exists()
    assert owned_dirs.sweep(root=str(root)) == []  # nothing stale left


def test_another_users_directories_are_left_to_them(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    theirs = named(tmp_path, *a_dead_process())
    os.chown(theirs, 65534, 65534)
    assert owned_dirs.sweep(root=str(tmp_path)) == []
    assert theirs.is_dir()
