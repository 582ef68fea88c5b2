"""Sandbox uids (``laminar/tools/uids.py``) across processes: another process holds its claims
until it is killed with -9. Claims within one process are ``tests/unit/test_sandbox_uids.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from laminar.tools.uids import UidClaims
from tests.unit.test_sandbox_uids import FOUR

HOLDER = """
import sys, time
from laminar.tools.uids import UidClaims
claims = UidClaims(sys.argv[1], range(300, 304))
print(claims.claim(), claims.claim(), flush=True)
time.sleep(600)
"""


def test_another_process_holds_its_claims_until_it_is_killed(tmp_path: Path) -> None:
    path = str(tmp_path / "uids.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, path], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        theirs = {int(u) for u in holder.stdout.readline().split()}
        claims = UidClaims(path, FOUR)
        ours = {claims.claim(), claims.claim()}
        assert len(theirs) == 2 and ours == set(FOUR) - theirs
        with pytest.raises(RuntimeError):
            claims.claim()
        holder.kill()  # -9: the kernel drops its locks
        holder.wait()
        assert {claims.claim(), claims.claim()} == theirs
    finally:
        holder.kill()
        holder.wait()
