"""Start real role processes and read their LAMINAR_READY line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from laminar.proc import placement
from laminar.proc.spawn import read_ready_line

ROOT = Path(__file__).resolve().parents[2]
SUPPORT_ROLES = str(ROOT / "tests" / "support" / "roles.py")
TOKEN = "test-token-0123456789abcdef"


def threads_nice(pid: int) -> set[int]:
    """The niceness of each of ``pid``'s threads, as a set (laminar.proc.placement)."""
    return {placement.niceness(tid) for tid in placement.thread_ids(pid)}


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    out.update({"LAMINAR_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}, **extra)
    return out


def laminar(*args: str) -> list[str]:
    return [sys.executable, "-m", "laminar", *args]


def run_cli(*args: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run one `laminar ...` command to completion, output captured."""
    return subprocess.run(
        laminar(*args), capture_output=True, text=True, env=environ or env(), cwd=ROOT, timeout=30
    )


def start(
    args: list[str],
    *,
    timeout: float = 30.0,
    environ: dict[str, str] | None = None,
    stderr: IO[str] | int = subprocess.PIPE,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start a process and wait for its ready line; kills it and raises if it never comes.
    ``stderr``: where its log goes (a file, to read what it said after the fact)."""
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=environ or env(),
        cwd=ROOT,
    )
    seen: list[str] = []
    info = read_ready_line(proc, timeout, seen.append)
    if info is not None:
        return proc, info
    proc.kill()
    _, err = proc.communicate(timeout=10)
    raise RuntimeError(f"{args} never became ready:\n{''.join(seen)}\n{err}")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)
