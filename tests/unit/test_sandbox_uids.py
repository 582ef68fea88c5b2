"""Sandbox uids (``laminar/tools/uids.py``): no two calls hold one, in one process or across
processes, and a claim ends with its process even when that process is killed with -9."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from laminar.tools.uids import UidClaims

FOUR = range(300, 304)


def test_claims_in_one_process_never_repeat_until_released(tmp_path: Path) -> None:
    claims = UidClaims(str(tmp_path / "uids.lock"), FOUR)
    held = [claims.claim() for _ in FOUR]
    assert sorted(held) == list(FOUR)
    with pytest.raises(RuntimeError, match="no free sandbox uid"):
        claims.claim()
    claims.release(held[2])
    assert claims.claim() == held[2]
    with pytest.raises(RuntimeError):
        with claims.claimed():
            pass
    claims.release(held[0])
    with claims.claimed() as uid:
        assert uid == held[0]
    assert claims.claim() == held[0]  # released by the context manager


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
