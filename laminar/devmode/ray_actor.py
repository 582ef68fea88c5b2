"""The Ray actor that holds one role instance of ``laminar run --launcher ray``.

One actor per instance (``rollout-0``), placed by the launcher (:mod:`laminar.devmode.ray_launch`)
in its machine's placement group, for the whole run. Each :meth:`RoleProcess.once` runs one
incarnation of the instance's ``laminar serve`` on the actor's machine, exactly as the local
supervisor runs a child: through :class:`laminar.proc.children.ChildProcesses` (its own group,
``PR_SET_PDEATHSIG``, umask 077, its output to ``<run_dir>/logs/NAME.log``, its exit seen on a
pidfd, what it left in its group ended after a grace period, its error line and OOM kills
found). Only the restart decision is not taken here: the launcher takes it, with the policy every
launcher shares (:mod:`laminar.proc.restart`), as soon as :meth:`RoleProcess.exited` reports the
exit (:class:`laminar.proc.exits.Exit`).

This module does not import Ray: the launcher wraps the class with ``ray.remote`` and Ray imports
it by name on the worker. Every method is a coroutine, so Ray runs it as an async actor whose
calls interleave (:meth:`~RoleProcess.stop` while :meth:`~RoleProcess.once` runs) on one event
loop thread that lives as long as the actor: the role's process is forked from that thread, so
its parent-death signal fires when the actor dies, not when some pool thread is retired.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import deque
from pathlib import Path
from typing import Any

from laminar.devmode import ALARMS
from laminar.proc.children import Child, ChildProcesses
from laminar.proc.exits import Exit
from laminar.proc.procfs import kill_group
from laminar.runtime.config import RoleSpec

#: How many of them one incarnation passes on, the last ones (a traceback's end says the most).
MAX_ALARMS = 40


class _OneIncarnation(ChildProcesses):
    """The local supervisor's child lifecycle, one incarnation at a time: the decision to
    restart is the launcher's, so here it is always "no", and the exit goes to ``reported``."""

    def __init__(self, started: asyncio.Event, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started = started
        self.reported: asyncio.Future[Exit] | None = None  # made by each RoleProcess.once

    def decide(self, child: Child, exit: Exit) -> bool:
        if self.reported is not None and not self.reported.done():
            self.reported.set_result(exit)
        return False

    async def _start(self, child: Child) -> asyncio.subprocess.Process:
        proc = await super()._start(child)
        self.started.set()
        return proc


class RoleProcess:
    """One role instance's ``laminar serve``, one incarnation per :meth:`once`."""

    def __init__(
        self,
        name: str,
        role: str,
        section: str,
        spec: RoleSpec,
        *,
        env: dict[str, str],
        mark: str,
        grace: float,
        log_dir: str,
        cwd: str,
        gpus: float = 0,
    ) -> None:
        try:
            os.chdir(cwd)  # the config's relative paths are the driver's
        except OSError as exc:
            raise RuntimeError(
                f"{name}: cannot enter {cwd} on this machine ({exc}); the nodes of a Ray "
                "cluster need the repository (and the venv) at the driver's paths"
            ) from None
        if gpus > 0:  # Ray set this actor's CUDA_VISIBLE_DEVICES to the GPUs it was given
            env = {**env, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
        self.child = Child(name, role, section, spec, colour="")
        self.argv: list[str] = []
        self.notes: list[tuple[str, str]] = []  # what this incarnation said, for the driver
        self.alarms: deque[str] = deque(maxlen=MAX_ALARMS)
        self.started = asyncio.Event()
        self.stopping = asyncio.Event()
        self.processes = _OneIncarnation(
            self.started,
            env=env,
            mark=mark,
            grace=grace,
            log_dir=Path(log_dir),
            stopping=self.stopping,
            command=lambda child: self.argv,
            echo=self._echo,
            say=lambda message, style: self.notes.append((message, style)),
            gave_up=lambda child: None,
        )

    def _echo(self, child: Child, line: str) -> None:
        if child.log is not None:
            child.log.write(line + "\n")
            child.log.flush()
        if any(a in line for a in ALARMS):
            self.alarms.append(line)

    async def once(self, argv: list[str]) -> dict[str, Any]:
        """Run one incarnation of the role to its end: its exit status, what the lifecycle said
        (e.g. processes it left behind) and its alarming output lines."""
        self.argv = argv
        self.notes, self.alarms = [], deque(maxlen=MAX_ALARMS)
        self.started.clear()
        self.child.exit = None
        reported = self.processes.reported = asyncio.get_running_loop().create_future()
        try:
            await self.processes._life(self.child)
        finally:
            if self.child.exit is None:  # it never started: nobody may wait for it forever
                self.child.exit = asyncio.get_running_loop().create_future()
                self.child.exit.set_result(None)
            if not reported.done():  # stopped, or its watch failed: no reason
                code = self.child.exit.result() if self.child.exit.done() else None
                reported.set_result(Exit(code))
            self.started.set()
        return {
            "code": self.child.exit.result(),
            "notes": self.notes,
            "alarms": list(self.alarms),
            "pid": self.child.process.pid if self.child.process is not None else None,
        }

    async def exited(self) -> dict[str, Any]:
        """How the current incarnation ended (:meth:`laminar.proc.exits.Exit.wire`), as soon as
        it is known: its status (negative: a signal; None: unknown, or it never started), its
        error line, an OOM kill. Call it after :meth:`once`."""
        await self.started.wait()
        assert self.processes.reported is not None
        exit = await asyncio.shield(self.processes.reported)
        return exit.wire()

    async def ready(self) -> dict[str, Any] | None:
        """The current incarnation's ``LAMINAR_READY`` info (address, pid), or None if it exited
        first. Call it after :meth:`once`."""
        await self.started.wait()
        assert self.child.exit is not None
        ready = asyncio.ensure_future(self.child.ready.wait())
        either: set[asyncio.Future[Any]] = {ready, self.child.exit}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        return dict(self.child.info) if self.child.ready.is_set() else None

    async def stop(self) -> None:
        """SIGTERM the role's own process (it stops what it started); a start after this one is
        stopped at once."""
        self.stopping.set()
        self.processes._signal(self.child, signal.SIGTERM)

    async def kill(self) -> list[int]:
        """SIGKILL everything in the current incarnation's group; the pids signalled."""
        if self.child.process is None:
            return []
        pid = self.child.process.pid
        return await asyncio.to_thread(kill_group, pid, self.processes.mark)

    async def sweep(self) -> list[tuple[str, str]]:
        """The end of the run: kill whatever is left in the groups this actor started (nothing
        outlives the run), close the log; what it said."""
        self.stopping.set()
        self.notes = []
        await self.processes.sweep()
        if self.child.log is not None:
            self.child.log.close()
            self.child.log = None
        return self.notes
