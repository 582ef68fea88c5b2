"""What a dev-mode run's child process writes (a SQLite file in WAL mode, as the data role makes)
is readable by its user only, under umask 022. The rest of the run directory is
``tests/unit/test_rundir_modes.py``."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

from laminar.proc.children import Child, ChildProcesses
from laminar.proc.procfs import KEEP_ENVIRON, MARK_ENV
from laminar.runtime.config import RoleSpec
from tests.support.procs import env
from tests.unit.test_rundir_modes import mode

# What the data role does to its store: WAL mode, a write, and the three files while it is open.
SQLITE = r"""
import os, sqlite3, stat
db = sqlite3.connect("store.sqlite")
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE t (x)")
db.execute("INSERT INTO t VALUES (1)")
db.commit()
for name in ("store.sqlite", "store.sqlite-wal", "store.sqlite-shm"):
    print(name, oct(stat.S_IMODE(os.stat(name).st_mode)))
"""


async def test_logs_and_what_a_child_writes_are_private(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    lines: list[str] = []
    work = tmp_path / "work"
    work.mkdir()
    processes = ChildProcesses(
        env=env(**KEEP_ENVIRON, **{MARK_ENV: mark}),
        mark=f"{MARK_ENV}={mark}",
        grace=1.0,
        log_dir=tmp_path / "run" / "logs",
        stopping=asyncio.Event(),
        command=lambda child: [
            sys.executable,
            "-c",
            f"import os; os.chdir({str(work)!r})\n{SQLITE}",
        ],
        echo=lambda child, line: lines.append(line),
        say=lambda message, style="": None,
        gave_up=lambda child: None,
    )
    child = Child("data-0", "data", "data", RoleSpec(role="data", restart="never"), "cyan")
    try:
        await asyncio.wait_for(processes.supervise(child), 30)
    finally:
        await processes.sweep()
        child.log.close()
    assert sorted(lines) == [
        "store.sqlite 0o600",
        "store.sqlite-shm 0o600",
        "store.sqlite-wal 0o600",
    ], lines
    assert mode(tmp_path / "run" / "logs") == 0o700
    assert mode(tmp_path / "run" / "logs" / "data-0.log") == 0o600
