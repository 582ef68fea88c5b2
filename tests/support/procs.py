"""Start real role processes and read their LAMINAR_READY line."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from laminar.service import READY_PREFIX

ROOT = Path(__file__).resolve().parents[2]
SUPPORT_ROLES = str(ROOT / "tests" / "support" / "roles.py")
TOKEN = "test-token-0123456789abcdef"


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
    log: Path | None = None,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start a process and wait for its ready line; kills it and raises if it never comes.

    With ``log``, stderr goes to that file and so does stdout after the ready line (a thread
    copies it): chatty processes (vLLM) would otherwise block on a full pipe.
    """
    log_file = log.open("a") if log is not None else None
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=log_file if log_file is not None else subprocess.PIPE,
        text=True,
        env=environ or env(),
        cwd=ROOT,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen: list[str] = []
    while time.monotonic() < deadline:
        if not sel.select(timeout=0.1):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if log_file is not None:
            log_file.write(line)
            log_file.flush()
        if line.startswith(READY_PREFIX):
            sel.close()
            if log_file is not None:
                threading.Thread(target=_copy, args=(proc.stdout, log_file), daemon=True).start()
            return proc, json.loads(line[len(READY_PREFIX) :])
    proc.kill()
    _, err = proc.communicate(timeout=10)
    if log is not None:
        err = log.read_text()[-5000:]
    raise RuntimeError(f"{args} never became ready:\n{''.join(seen)[-5000:]}\n{err}")


def _copy(src: Any, dst: Any) -> None:
    for line in src:
        dst.write(line)
        dst.flush()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    if proc.stdout is not None and proc.stderr is not None:
        proc.communicate(timeout=10)
    else:
        proc.wait(timeout=10)
