"""``laminar run`` reads its children's output whatever they print.

A line over ``asyncio.StreamReader``'s 64 KiB limit used to stop the reader, and the child then
blocked on its full pipe: alive, but hung. Here a real child prints a 1 MiB line and goes on; it
must run to its end, and the line reaches the log cut, with a marker saying how much is missing.
The line splitting alone is ``tests/unit/test_supervisor_output.py``.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

from laminar.proc.children import Child, ChildProcesses
from laminar.proc.linesplit import MAX_LINE_BYTES
from laminar.proc.procfs import KEEP_ENVIRON, MARK_ENV
from laminar.runtime.config import RoleSpec
from tests.support.procs import env

CHATTY = r"""
import sys
sys.stdout.write("x" * (1 << 20) + "\n")
print("after the long line", flush=True)
sys.stderr.write("e" * (200 << 10) + "\n")  # stderr too, and no newline before the end
sys.stderr.write("last words")
"""


def one_child(tmp_path: Path, code: str) -> tuple[ChildProcesses, Child, list[str], list[str]]:
    mark = uuid.uuid4().hex
    lines: list[str] = []
    said: list[str] = []
    processes = ChildProcesses(
        env=env(**KEEP_ENVIRON, **{MARK_ENV: mark}),
        mark=f"{MARK_ENV}={mark}",
        grace=1.0,
        log_dir=tmp_path / "logs",
        stopping=asyncio.Event(),
        command=lambda child: [sys.executable, "-c", code],
        echo=lambda child, line: lines.append(line),
        say=lambda message, style="": said.append(message),
        gave_up=lambda child: None,
    )
    child = Child("chatty-0", "chatty", "chatty", RoleSpec(role="chatty", restart="never"), "cyan")
    return processes, child, lines, said


async def test_a_child_printing_a_megabyte_line_goes_on_and_the_line_is_cut(
    tmp_path: Path,
) -> None:
    processes, child, lines, said = one_child(tmp_path, CHATTY)
    try:
        # Without chunked reading the child blocks on its pipe forever: this wait times out.
        await asyncio.wait_for(processes.supervise(child), 30)
    finally:
        await processes.sweep()
        child.log.close()
    assert child.exit is not None and child.exit.result() == 0, said
    assert said == ["chatty-0 exited with code 0; not restarting (policy never, 0 restarts)"]
    out = sorted(lines, key=len)  # stdout and stderr interleave in any order
    assert out[:2] == ["last words", "after the long line"], out[:2]
    marker = " ... [line truncated: {} more bytes not shown]"
    assert set(out[2:]) == {
        "e" * MAX_LINE_BYTES + marker.format((200 << 10) - MAX_LINE_BYTES),
        "x" * MAX_LINE_BYTES + marker.format((1 << 20) - MAX_LINE_BYTES),
    }
