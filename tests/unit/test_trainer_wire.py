"""How a trainer group's ranks meet (``roles/trainer/wire.py``): local ranks at a file in a
private directory. A group formed after a rendezvous that failed, with a second rank that is a
real process, is ``tests/integration/test_trainer_wire.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_local_ranks_meet_at_a_file_in_a_private_directory() -> None:
    """A group of ranks on one host (``spawn``) meets at a file, not at a port chosen free and
    then bound by rank 0 (another process took one in between in a suite run: EADDRINUSE)."""
    from laminar.roles.trainer.wire import local_rendezvous

    address, directory = local_rendezvous()
    try:
        assert address == f"file://{directory / 'store'}"
        assert directory.is_dir() and directory.stat().st_mode & 0o777 == 0o700
        assert list(directory.iterdir()) == []  # torch's file store starts from no file
    finally:
        directory.rmdir()
