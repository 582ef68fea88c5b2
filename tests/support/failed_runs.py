"""``laminar run`` of a config whose roles fail, from a test: every process of the run tagged in
its environment, the run expected to end by itself long before its budget, and nothing of it
left afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from laminar.proc import procfs
from laminar.proc.procfs import KEEP_ENVIRON

from .devrun import STARTUP_S, kill_session, spawn, write_run_config
from .procs import laminar

TAG = "LAMINAR_TEST_FAILED_RUN"
#: A run's budget: it must end long before, by a role's failure or by a signal.
DURATION_S = 1800


def tagged(tag: str) -> list[int]:
    """Live processes (zombies aside) started with ``TAG=tag`` in their environment."""
    out = []
    for pid in procfs.pids():
        stat = procfs.stat(pid)
        if stat is not None and stat.state != "Z" and procfs.has_env(pid, f"{TAG}={tag}"):
            out.append(pid)
    return out


@contextmanager
def launched(tmp_path: Path, roles: list[dict[str, Any]]) -> Iterator[subprocess.Popen[str]]:
    """``laminar run`` of ``roles`` beside the manager, without the doctor's preflight (what is
    tested is the supervisor), every process of it tagged. Afterwards the run must have ended
    and none of its processes be left (what is left is killed)."""
    tag = uuid.uuid4().hex
    config = write_run_config(tmp_path, roles, display="lines", duration_s=DURATION_S)
    run = spawn(
        laminar("run", str(config), "--skip-doctor"),
        merge_stderr=True,
        **{TAG: tag, **KEEP_ENVIRON},
    )
    failed = False
    try:
        yield run
    except BaseException:
        failed = True
        raise
    finally:
        going = kill_session(run)
        left = [pid for pid in tagged(tag) if pid != run.pid]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if not failed:
            assert not going, f"the run was still going; it had printed:\n{going[-4000:]}"
            assert not left, f"processes of the run outlived it: {left}"


def ended(run: subprocess.Popen[str], timeout: float = STARTUP_S) -> str:
    """What ``run`` printed, once it ended by itself, not by its budget. ``timeout`` bounds a
    hang; it is no timing check."""
    try:
        out, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = kill_session(run)
        raise AssertionError(f"the run did not end within {timeout} s:\n{out[-4000:]}") from None
    assert "run budget" not in out, out
    return out


def said(out: str) -> list[str]:
    """The supervisor's lines of a run's output."""
    prefix = "supervisor | "
    return [line.removeprefix(prefix) for line in out.splitlines() if line.startswith(prefix)]
