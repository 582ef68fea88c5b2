"""Directories that belong to one process (:mod:`laminar.proc.owned_dirs`): named after their
owner by pid and start time, private, and swept by the next :func:`make` once the owner is gone,
whoever that owner was (a real owner that exited: ``tests/integration/test_owned_dirs.py``);
nothing else in the directory is touched."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from laminar.proc import owned_dirs, procfs


@pytest.fixture
def root() -> Iterator[Path]:
    """A short directory under the system's temp directory (pytest's ``tmp_path`` is too long a
    path for socket files inside a directory inside it: see the last test)."""
    path = Path(tempfile.mkdtemp(prefix="od-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def me() -> tuple[int, int]:
    stat = procfs.stat(os.getpid())
    assert stat is not None
    return os.getpid(), stat.start


def test_a_made_directory_is_private_and_names_its_owner(root: Path) -> None:
    path, swept = owned_dirs.make(root=str(root))
    assert swept == [] and path.parent == root and path.is_dir()
    assert path.stat().st_mode & 0o777 == 0o700
    assert owned_dirs.owner(path) == me()
    owned_dirs.remove(path)
    assert not path.exists()
    owned_dirs.remove(path)  # gone already: nothing to do


def test_owner_reads_only_names_that_make_gives() -> None:
    assert owned_dirs.owner(f"/tmp/{owned_dirs.PREFIX}-12-345-abc_de") == (12, 345)
    for name in ("laminar-vllm-12-345", "laminar-vllm-a-345-x", "laminar-vllmx-12-345-x", "other"):
        assert owned_dirs.owner(f"/tmp/{name}") is None, name


def test_a_root_too_long_for_socket_paths_is_refused_with_the_fix(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(ValueError, match=r"at most 70\).*set TMPDIR"):
        owned_dirs.make(root=str(deep))
    assert list(deep.iterdir()) == []  # the directory it made is gone again
