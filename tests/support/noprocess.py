"""The rule that unit tests start no processes, enforced (``tests/unit/conftest.py`` turns it on).

While the guard is on, every way Python starts a process (``subprocess`` and asyncio's
subprocesses, ``os.fork``/``forkpty``/``posix_spawn``/``system``, multiprocessing, the helpers
multiprocessing execs) raises :class:`StartedAProcess` and is remembered, so that a test whose
code under test swallows the error still fails. A test that starts processes belongs in
``tests/integration``, which ``make test`` runs and ``make test-fast`` does not.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MESSAGE = "unit tests start no processes: move this test to tests/integration"

#: Callers that may start a process while a unit test runs though the test never asked for one:
#: ``ctypes.util.find_library`` runs ldconfig (or a compiler) to locate a shared library, which
#: libraries do while they are imported (torch's look-up of the CUDA libraries does, GPU or not),
#: and an import happens in whichever test comes first.
ALLOWED_CALLERS = (os.path.join("ctypes", "util.py"),)


class StartedAProcess(AssertionError):
    """A unit test (or the code it runs) started a process."""


def _argv(how: str) -> Callable[[tuple[Any, ...]], str]:
    def describe(args: tuple[Any, ...]) -> str:
        argv = args[0] if args else ""
        if isinstance(argv, list | tuple):
            argv = " ".join(str(a) for a in argv)
        return f"{how} {str(argv)[:200]}"

    return describe


def _allowed_caller() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(ALLOWED_CALLERS):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class Guard:
    """Turned on around each phase of a unit test; ``started`` says what was refused."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _targets(self) -> list[tuple[Any, str, Callable[[tuple[Any, ...]], str]]]:
        return [
            # every subprocess.Popen (asyncio's subprocesses, os.popen and run_cli-style helpers
            # included) goes through it; args[1] is the argv
            (subprocess.Popen, "_execute_child", lambda a: _argv("subprocess")(a[1:])),
            (os, "fork", lambda a: "os.fork()"),
            (os, "forkpty", lambda a: "os.forkpty()"),
            (os, "posix_spawn", _argv("os.posix_spawn")),
            (os, "posix_spawnp", _argv("os.posix_spawnp")),
            (os, "system", _argv("os.system")),
            # multiprocessing's spawn and forkserver start their helpers with it directly
            (_posixsubprocess, "fork_exec", _argv("multiprocessing")),
            # a forkserver already running starts a child without any of the above
            (
                multiprocessing.process.BaseProcess,
                "start",
                lambda a: f"multiprocessing {type(a[0]).__name__}.start()",
            ),
        ]

    def _refuse(self, original: Any, describe: Callable[[tuple[Any, ...]], str]) -> Any:
        guard = self

        def refused(*args: Any, **kwargs: Any) -> Any:
            if _allowed_caller():
                return original(*args, **kwargs)
            what = describe(args)
            guard.started.append(what)
            raise StartedAProcess(f"{MESSAGE} (it started {what})")

        return refused

    @contextmanager
    def on(self) -> Iterator[None]:
        if self._saved:  # already on (a nested phase): the outer one restores
            yield
            return
        for owner, name, describe in self._targets():
            original = owner.__dict__[name]
            self._saved.append((owner, name, original))
            setattr(owner, name, self._refuse(original, describe))
        try:
            yield
        finally:
            saved, self._saved = self._saved, []
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)

    def take(self) -> list[str]:
        """What was refused since the last call (and forget it)."""
        started, self.started = self.started, []
        return started


GUARD = Guard()
