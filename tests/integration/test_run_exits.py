"""What a failed role's exit says (``laminar.proc.exits``), checked on what real interpreters
print: tracebacks, exception groups, chained exceptions, a crash in C, the CLI's own line,
structlog's error events in both formats; and the repeat rule once with a real child whose last
words are written just before it exits (the supervisor must have read them when it decides). The
rule on recorded output and exit by exit is ``tests/unit/test_run_exits.py``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from laminar.proc.children import Child, ChildProcesses
from laminar.proc.exits import error_line
from laminar.proc.procfs import KEEP_ENVIRON, MARK_ENV
from laminar.runtime.config import RoleSpec
from tests.support.procs import ROOT, env


def printed(code: str, *args: str) -> tuple[int, list[str]]:
    """Run ``code`` in a fresh interpreter: its exit status and what it printed (stdout and
    stderr together, as a supervised child's pipes give them)."""
    out = subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env(),
        timeout=60,
    )
    return out.returncode, out.stdout.splitlines()


def test_a_traceback_gives_its_exception_line() -> None:
    code, lines = printed("""
        print("starting", flush=True)
        def load(path):
            raise ValueError(f"{path}: record 3: 'prompt' must be a string")
        load("data/prompts.jsonl")
    """)
    assert code == 1
    assert (
        error_line(lines) == "ValueError: data/prompts.jsonl: record 3: 'prompt' must be a string"
    )


def test_a_chained_exception_gives_the_last_one() -> None:
    code, lines = printed("""
        try:
            {}["model"]
        except KeyError as exc:
            raise RuntimeError("no model in the config") from exc
    """)
    assert code == 1 and any(line.startswith("KeyError") for line in lines), lines
    assert error_line(lines) == "RuntimeError: no model in the config"


def test_an_exception_group_gives_the_error_inside_not_its_summary() -> None:
    """How a role's failed start ends: the host's task group raises an ExceptionGroup."""
    code, lines = printed("""
        import asyncio
        from laminar.runtime.errors import ConfigError
        async def start():
            raise ConfigError("tok/: no tokenizer.json")
        async def main():
            async with asyncio.TaskGroup() as group:
                group.create_task(asyncio.sleep(1))
                await start()
        asyncio.run(main())
    """)
    assert code == 1 and any("ExceptionGroup: unhandled errors" in x for x in lines), lines
    assert error_line(lines) == "laminar.runtime.errors.ConfigError: tok/: no tokenizer.json"


def test_the_cli_line_wins_over_an_earlier_traceback() -> None:
    code, lines = printed("""
        import logging, sys
        try:
            1 / 0
        except ZeroDivisionError:
            logging.exception("a warm-up step failed; going on")
        print("laminar serve: data.prompts: runs/missing.jsonl does not exist", file=sys.stderr)
        sys.exit(78)
    """)
    assert code == 78 and any(x.startswith("ZeroDivisionError") for x in lines), lines
    assert error_line(lines) == "laminar serve: data.prompts: runs/missing.jsonl does not exist"


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_a_structured_error_event_without_a_traceback(fmt: str) -> None:
    code, lines = printed(f"""
        import sys
        from laminar.runtime.log import configure_logging
        log = configure_logging(role="data", instance="data-0", fmt="{fmt}")
        log.info("data ready", prompts=8)
        log.error("the store is gone", error="disk I/O error")
        log.info("stopping")
        sys.exit(1)
    """)
    assert code == 1
    expected = "the store is gone" if fmt == "console" else "the store is gone: disk I/O error"
    assert error_line(lines) == expected, lines


def test_a_structured_error_event_with_an_exception_gives_the_exception() -> None:
    code, lines = printed("""
        from laminar.runtime.log import configure_logging
        log = configure_logging(role="rollout", instance="rollout-0", fmt="json")
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            log.exception("checkpoint failed")
    """)
    assert code == 0 and json.loads(lines[-1])["level"] == "error", lines
    assert error_line(lines) == "OSError: [Errno 28] No space left on device"


def test_a_crash_in_c_gives_the_fatal_error_line() -> None:
    code, lines = printed("import ctypes; ctypes.string_at(0)", "-X", "faulthandler")
    assert code == -signal.SIGSEGV
    assert error_line(lines) == "Fatal Python error: Segmentation fault"


def test_output_without_an_error_gives_none() -> None:
    code, lines = printed("""
        from laminar.runtime.log import configure_logging
        log = configure_logging(role="data", instance="data-0")
        log.warning("manager unreachable; retrying", error="connection refused")
        print("Error: not a traceback, just words")
    """)
    assert code == 0 and lines
    assert error_line(lines) is None


LAST_WORDS = r"""
import sys
print("working\n" * 2000, flush=True)
sys.stderr.write("Traceback (most recent call last):\n  File \"x.py\", line 1\n")
sys.stderr.write("ValueError: the model has no lm_head\n")
sys.stderr.flush()
import os
os._exit(3)
"""


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "no-pidfd"])
async def test_a_childs_error_line_is_said_beside_its_exit_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfds: bool
) -> None:
    """Its exit is seen on a pidfd (or by a thread in ``waitid``) as soon as it happens, which
    may be before its pipes' last lines are read."""
    if not pidfds:

        def pidfd_open(pid: int, flags: int = 0) -> int:
            raise OSError(errno.ENOSYS, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", pidfd_open)
    mark = uuid.uuid4().hex
    said: list[str] = []
    processes = ChildProcesses(
        env=env(**KEEP_ENVIRON, **{MARK_ENV: mark}),
        mark=f"{MARK_ENV}={mark}",
        grace=1.0,
        log_dir=tmp_path / "logs",
        stopping=asyncio.Event(),
        command=lambda child: [sys.executable, "-c", LAST_WORDS],
        echo=lambda child, line: None,
        say=lambda message, style="": said.append(message),
        gave_up=lambda child: None,
    )
    for _ in range(10):  # the exit and the last lines race: the lines must win every time
        said.clear()
        c = Child("model-0", "model", "model", RoleSpec(role="model", restart="never"), "cyan")
        try:
            async with asyncio.timeout(30):
                await processes.supervise(c)
        finally:
            await processes.sweep()
        assert said == [
            "model-0 exited with code 3: ValueError: the model has no lm_head; not restarting "
            "(policy never, 0 restarts)"
        ]
        assert c.done and c.dead == "exited with code 3: ValueError: the model has no lm_head"
        c.log.close()
