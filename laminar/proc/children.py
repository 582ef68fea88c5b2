"""The children of ``laminar run``: each role instance's process, its group, its restarts.

A :class:`Child` is one role instance (``rollout-0``) for the whole run; :class:`ChildProcesses`
owns the life of its process, one incarnation after another:

* **start**: in a process group of its own (the group id is its pid), so everything it starts (a
  rollout's vLLM engine core and workers) can be found and stopped with it; on its CPU slot; with
  ``PR_SET_PDEATHSIG`` (SIGTERM), so it dies with the supervisor
  (:func:`laminar.proc.spawn.arm_parent_death`). With umask 077, so what it writes (the data
  role's SQLite file, checkpoints, logs) is readable by this user only. Its output is read in
  chunks and split into lines of at most 64 KiB (:func:`laminar.proc.spawn.pump_lines`: a longer
  one is cut, with a marker, and never stops the reading, so the child never blocks on a full
  pipe): the ``LAMINAR_READY`` line gives its address, the rest goes to the supervisor's
  ``echo``; its log file is 0600. Starting it, reading it and its ready line are
  :mod:`laminar.proc.spawn`'s, shared with :class:`laminar.harness.launch.ProcessCluster`.
* **exit**: noticed on a pidfd of the process, not by its output closing (what it started inherits
  its pipes; :mod:`laminar.proc.exitwait`). A status that cannot be known is said as such and
  counts as a failure.
* **end of group**: what the process left in its group gets a moment to end by itself
  (:data:`SETTLE_S`: a vLLM engine kills itself once its rollout is gone), then SIGTERM, SIGKILL
  after ``run.shutdown_grace_s``, and the supervisor says so
  (:func:`laminar.proc.spawn.end_role_groups`, in a thread: ``/proc`` is polled, never on the
  event loop; it also removes the vLLM socket directories of owners now gone). Only processes
  carrying the run's mark are signalled (see :mod:`laminar.proc.procfs`).
  A group that needs SIGKILL loses multiprocessing's resource tracker with it, so what that
  tracker would have unlinked (vLLM's 160 MiB message queues in ``/dev/shm``) is unlinked here
  (:func:`laminar.proc.procfs.kill_group`). Then
  the process's pipes are closed, so one that escaped the group still holding them costs no file
  descriptors per restart.
* **why**: the last lines of each incarnation's output are kept (bounded), and so is the
  kernel's count of OOM kills in its memory cgroup at its start; once it has exited and what it
  wrote before has been read (until its pipes close or go quiet, a moment at most), its
  :class:`~laminar.proc.exits.Exit` gives its error line, whether the OOM killer struck, and how
  long it had been ready (:mod:`laminar.proc.exits`).
* **restart**: by the role's ``restart`` policy (``on-failure``: any non-zero exit or a signal,
  kill -9 included; ``max_restarts`` times, with a growing pause), decided and said once, with
  the error line, as soon as the exit is known; a failure that will repeat is not retried
  (:mod:`laminar.proc.restart`). A child given up on is reported to the supervisor, which
  decides whether the run goes on.
* **stop** (:meth:`ChildProcesses.stop`): SIGTERM to each child's own process (it stops what it
  started); its watcher sees it exit and ends its group as above; a child still running after
  the grace period gets SIGKILL to its whole group. **sweep**: last, whatever is left in a
  group not yet seen empty is killed, and then whatever else carries the run's mark (a process
  that left its role's group), so no process of the run outlives it.
* **what left the group**: each incarnation is started with a mark of its own
  (:data:`laminar.proc.procfs.INCARNATION_ENV`), which what it starts inherits wherever it goes (a
  reward worker's own group, a ``setsid``); once the group is ended, every process still carrying
  that mark is killed, so what a reward forked does not outlive its data role until the run's
  end.

A watcher never dies silently: an unexpected error is said, the child's group killed, and the
child given up on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from laminar.proc.cpus import CpuSlot
from laminar.proc.exits import Exit, OomCounter, OutputTail, oom_rose, ready_for
from laminar.proc.exitwait import exit_status, open_pidfd, returncode
from laminar.proc.gpus import gpu_env
from laminar.proc.procfs import INCARNATION_ENV, kill_group, signal_marked
from laminar.proc.restart import decide, keep_running
from laminar.proc.spawn import (
    arm_parent_death,
    cpu_env,
    end_role_groups,
    parse_ready_line,
    pump_lines,
    start_async,
)
from laminar.runtime.config import RoleSpec
from laminar.runtime.errors import LaminarError

#: Seconds what a child left behind gets to end by itself before SIGTERM (a vLLM engine's watch
#: kills it 1 s after its rollout is gone, see :mod:`laminar.engines.vllm_worker`).
SETTLE_S = 2.0
#: After an exit, how long the output may stay silent before what the process wrote is taken as
#: read, and how long reading it may take at most (what it started may hold its pipes and write
#: on: a vLLM engine core's shutdown lines).
QUIET_S = 0.2
DRAIN_S = 2.0


@dataclass
class Child:
    name: str
    role: str
    section: str
    spec: RoleSpec
    colour: str
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pinned_bind: str | None = None
    cpu: CpuSlot | None = None
    gpus: list[str] | None = None  # CUDA_VISIBLE_DEVICES (None: not set; laminar.proc.gpus)
    log: Any = None  # the open log file
    pidfd: int | None = None  # of the current process, until its exit is seen
    exit: asyncio.Future[int | None] | None = None  # the current process's exit status
    incarnation: str | None = None  # the current process's mark (procfs.INCARNATION_ENV=...)
    watcher: asyncio.Task[None] | None = None  # owns the child for the whole run
    # Why it ends (laminar.proc.exits, laminar.proc.restart):
    tail: OutputTail = field(default_factory=OutputTail)  # the current incarnation's last lines
    ready_at: float | None = None  # when the current incarnation became ready (time.monotonic)
    oom: OomCounter | None = None  # OOM kills in its memory cgroup, counted from its start
    last_exit: Exit | None = None  # the previous incarnation's end
    dead: str | None = None  # given up on after a failure: how it ended ("exited with ...")
    fatal: str | None = None  # its end ends the run: why ("X's configuration was refused")
    done: bool = False  # given up on: it will not be started again


def _child_setup(cpus: tuple[int, ...], parent: int) -> Callable[[], None]:
    def setup() -> None:  # in the child between fork and exec: no imports, no library loading
        os.umask(0o077)  # what the run writes is this user's only
        arm_parent_death(parent)
        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cpus)

    return setup


def open_log(path: Path) -> IO[str]:
    """Open a child's log for appending, readable by this user only (its directory 0700, the file
    0600), whatever the umask and whatever mode a resumed run's log had."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    return open(fd, "a")  # closed by the supervisor at the end of the run


def processes(pids: list[int]) -> str:
    return f"{len(pids)} process{'es' if len(pids) != 1 else ''} (pid {', '.join(map(str, pids))})"


# -- the children's processes ----------------------------------------------------------------------


class ChildProcesses:
    """Starts, watches, restarts and stops the processes of a run's children (see the module
    docstring). ``command`` gives a child's command line; ``echo`` gets each line it prints
    (but its ready line); ``say`` speaks for the supervisor; ``gave_up`` learns of a child that
    will not be restarted although the run goes on."""

    def __init__(
        self,
        *,
        env: dict[str, str],
        mark: str,
        grace: float,
        log_dir: Path,
        stopping: asyncio.Event,
        command: Callable[[Child], list[str]],
        echo: Callable[[Child, str], None],
        say: Callable[[str, str], None],
        gave_up: Callable[[Child], None],
    ) -> None:
        self.env = env
        self.mark = mark
        self.grace = grace
        self.log_dir = log_dir
        self.stopping = stopping
        self.command = command
        self.echo = echo
        self.say = say
        self.gave_up = gave_up
        # Group ids (a child's pid) not yet seen empty: swept before the supervisor returns.
        self.groups: set[int] = set()

    def supervise(self, child: Child) -> asyncio.Task[None]:
        """Start the task that owns ``child`` for the whole run (``child.watcher``)."""
        child.watcher = asyncio.create_task(self._watch(child), name=f"watch:{child.name}")
        return child.watcher

    # -- one incarnation --

    async def _start(self, child: Child) -> asyncio.subprocess.Process:
        child.ready.clear()
        child.ready_at = None
        child.tail = OutputTail()
        if child.log is None:
            child.log = open_log(self.log_dir / f"{child.name}.log")
        mark = uuid.uuid4().hex
        child.incarnation = f"{INCARNATION_ENV}={mark}"
        env = {
            **gpu_env(cpu_env(self.env, child.cpu, child.section), child.gpus),
            INCARNATION_ENV: mark,
        }
        proc = await start_async(  # in a process group of its own: the group id is its pid
            self.command(child),
            env,
            preexec_fn=_child_setup(child.cpu.cpus if child.cpu else (), os.getpid()),
        )
        child.process = proc
        child.exit = asyncio.get_running_loop().create_future()
        self.groups.add(proc.pid)
        child.pidfd = open_pidfd(proc)
        child.oom = await asyncio.to_thread(OomCounter.of, proc.pid)
        return proc

    def _line(self, child: Child, text: str) -> None:
        try:
            info = parse_ready_line(text)
        except LaminarError:  # not one it can be joined on: kept in its log, never taken
            info = None
        if info is None:
            child.tail.add(text)
            self.echo(child, text)
            return
        child.info = info
        child.ready_at = time.monotonic()
        child.ready.set()

    async def _end_group(self, child: Child, gid: int) -> None:
        grace = self.grace
        ends = await asyncio.to_thread(end_role_groups, [gid], grace, self.mark, settle=SETTLE_S)
        end = ends[gid]
        if end.left:
            how = f"{len(end.killed)} needed SIGKILL after {grace:g} s" if end.killed else "SIGTERM"
            them = "it" if len(end.left) == 1 else "them"
            message = f"{child.name} left {processes(end.left)} behind; stopped {them} ({how})"
            self.say(message, "yellow")
        if end.remaining:  # unkillable for now (stuck in the kernel): the sweep tries again
            self.say(f"{child.name}: {processes(end.remaining)} survived SIGKILL", "bold red")
        else:
            self.groups.discard(gid)
        # What left the group: a reward worker leads its own and dies with its data role, but
        # what a reward forked would stay until the run's end (one scan of /proc).
        if child.incarnation is not None:
            strays = await asyncio.to_thread(signal_marked, child.incarnation, signal.SIGKILL)
            if strays:
                them = "it" if len(strays) == 1 else "them"
                self.say(
                    f"{child.name} left {processes(strays)} outside its group; killed {them}",
                    "yellow",
                )

    async def _close(self, proc: asyncio.subprocess.Process) -> None:
        """Release the process's pipes once the loop has reaped it (closing the transport of a
        process not yet reaped would kill it or reap it behind the loop's back)."""
        if proc.returncode is None:
            await returncode(proc)
        if proc.returncode is not None:
            transport = getattr(proc, "_transport", None)
            with contextlib.suppress(Exception):
                if transport is not None:
                    transport.close()

    async def _life(self, child: Child) -> bool:
        """One incarnation: start, relay output, see it exit, end its group. Whether to start
        it again (decided and said as soon as its exit status is known)."""
        proc = await self._start(child)
        assert child.exit is not None and proc.stdout is not None and proc.stderr is not None
        if self.stopping.is_set():  # started while the run stops: stop it at once
            self._signal(child, signal.SIGTERM)
        pumps = [
            asyncio.create_task(pump_lines(s, lambda text: self._line(child, text)))
            for s in (proc.stdout, proc.stderr)
        ]
        try:
            code = await exit_status(child)
            child.exit.set_result(code)
            restart = False
            if not self.stopping.is_set():
                restart = self.decide(child, await self._exit(child, code, pumps))
            await self._end_group(child, proc.pid)
            # The group is gone, so are the pipes' writers (bar one that left the group)
            await asyncio.wait(pumps, timeout=2.0)
            return restart
        finally:
            for pump in pumps:
                pump.cancel()
            exited = child.exit.done()
            if not exited:  # cancelled, or failed: nobody waits for an exit any more
                child.exit.set_result(None)
            if child.pidfd is not None:
                os.close(child.pidfd)
                child.pidfd = None
            if exited:
                await self._close(proc)

    async def _exit(self, child: Child, code: int | None, pumps: list[asyncio.Task[None]]) -> Exit:
        """How the incarnation ended, once what it wrote before its exit has been read: its
        pipes closed, or its output quiet for :data:`QUIET_S` (its exit is seen on a pidfd, which
        may come before the last of its output is read), within :data:`DRAIN_S`."""
        loop = asyncio.get_running_loop()
        ready_s = ready_for(child.ready_at)
        deadline = loop.time() + DRAIN_S
        while loop.time() < deadline:
            done, _ = await asyncio.wait(pumps, timeout=QUIET_S)
            if len(done) == len(pumps) or time.monotonic() - child.tail.last_at >= QUIET_S:
                break
        oom = await asyncio.to_thread(oom_rose, child.oom) if code != 0 else None
        return Exit(code, child.tail.error_line(code), oom, ready_s)

    async def _watch(self, child: Child) -> None:
        """Own one child for the whole run: its incarnations, the pause between them (the
        restart policy every launcher shares: :mod:`laminar.proc.restart`)."""
        await keep_running(
            child,
            self._life,
            stopping=self.stopping,
            say=self.say,
            gave_up=self.gave_up,
            kill=self._kill,
        )

    async def _kill(self, child: Child) -> None:
        if child.process is not None:
            await asyncio.to_thread(kill_group, child.process.pid, self.mark)

    def decide(self, child: Child, exit: Exit) -> bool:
        """Whether the child is started again, by its restart policy; says which, and why it
        failed. An unknown status counts as a failure."""
        return decide(child, exit, self.say)

    # -- stopping --

    def _signal(self, child: Child, sig: int) -> None:
        """Signal the child's own process, if it is still running (through its pidfd while it
        has one: its pid cannot be someone else's then)."""
        if child.exit is None or child.exit.done() or child.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if child.pidfd is not None:
                signal.pidfd_send_signal(child.pidfd, sig)
            elif child.process.returncode is None:
                child.process.send_signal(sig)

    async def stop(self, children: list[Child]) -> None:
        """SIGTERM each child's own process (it stops what it started); its watcher sees it exit
        and ends its group. A child not gone after the grace period: SIGKILL to its group.
        Returns once their watchers are done (or a second grace period and 15 s have passed)."""
        grace = self.grace
        live = [c for c in children if c.watcher is not None and not c.watcher.done()]
        for child in live:
            self._signal(child, signal.SIGTERM)
        running = [c.exit for c in live if c.exit is not None and not c.exit.done()]
        if running:
            await asyncio.wait(running, timeout=grace)
        for child in live:
            if child.exit is not None and not child.exit.done() and child.process is not None:
                pid = child.process.pid
                self.say(
                    f"{child.name} (pid {pid}) did not stop {grace:g} s after SIGTERM; "
                    "killing its processes",
                    "bold red",
                )
                await asyncio.to_thread(kill_group, pid, self.mark)
        watchers = [c.watcher for c in live if c.watcher is not None]
        if watchers:  # they end what the groups still hold (with a grace period of their own)
            await asyncio.wait(watchers, timeout=grace + SETTLE_S + 15.0)

    async def sweep(self) -> None:
        """Kill whatever is left in the run's groups (a child started while the run stopped, a
        watcher cancelled before its child's group was empty), then whatever else carries the
        run's mark: nothing outlives the run."""
        for gid in sorted(self.groups):
            left = await asyncio.to_thread(kill_group, gid, self.mark)
            if left:
                self.say(f"killed {processes(left)} left at the end of the run", "bold red")
        self.groups.clear()
        # What left its role's group (a reward worker leads its own, and what a reward forked
        # stays there after its data role died) still carries the run's mark.
        strays = await asyncio.to_thread(signal_marked, self.mark, signal.SIGKILL)
        if strays:
            self.say(f"killed {processes(strays)} of the run outside its roles' groups", "bold red")
