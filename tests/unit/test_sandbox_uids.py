"""Sandbox uids (``laminar/tools/uids.py``): no two calls in one process hold one. Across
processes, and a claim ending with its process killed with -9:
``tests/integration/test_sandbox_uids.py``."""

from __future__ import annotations

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
