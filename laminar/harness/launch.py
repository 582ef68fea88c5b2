"""Start role processes from Python: ``laminar serve`` children with their ready lines and logs.

For programs that need a real multi-process cluster without the dev-mode supervisor's console:
integration tests, benchmarks. Each child is ``python -m laminar serve --role R ...``; its
``LAMINAR_READY`` line gives the address; everything else it prints goes to ``<log_dir>/<name>.log``
(a thread drains stdout after the ready line, so a chatty child never blocks on a full pipe).

Each child leads a process group of its own (so it, and everything it starts, can be told apart
from the caller's), and a role's processes end with it: :meth:`ProcessCluster.shutdown`
stops each role, then whatever its group still holds (SIGTERM, SIGKILL after the grace), killed
roles' groups included (all groups at once: one grace period, not one each).
:meth:`ProcessCluster.kill9` kills only the role's own process, the way a crash does, so tests can
watch what happens to the rest (a vLLM engine kills itself, see :mod:`laminar.engines.vllm_worker`).
A role also ends with the process that started it (from its main thread): the kernel sends it
SIGTERM (``PR_SET_PDEATHSIG``, :func:`laminar.proc.spawn.arm_parent_death`), so a test run killed
with -9, or ended by SIGTERM (whose default action runs no teardown), leaves no role running.
The command line, the environment, the group, the output lines and the ready line come from
:mod:`laminar.proc.spawn`, shared with ``laminar run``; the group helpers from
:mod:`laminar.proc.procfs`.

Rollouts are pinned one core each, round robin (``pin_rollouts``), the way ``laminar run``'s CPU
plan pins them (:mod:`laminar.proc.cpus`): left alone, every vLLM CPU engine binds its OpenMP
threads to the same cores, and two engines' spinning threads starve each other so badly that,
where cores are few, a second engine takes minutes to start. Sim engines ignore it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

from laminar.proc.cpus import CpuSlot, available_cores
from laminar.proc.procfs import signal_marked
from laminar.proc.spawn import (
    OutputLines,
    ServeSpec,
    cpu_env,
    end_role_groups,
    kill_role,
    launch_env,
    serve_command,
    start,
    stop_stages,
)
from laminar.runtime.errors import LaminarError

__all__ = ["ProcessCluster"]


class ProcessCluster:
    def __init__(
        self,
        config: str | Path,
        log_dir: str | Path,
        *,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        pin_rollouts: bool = True,
    ) -> None:
        self.config = Path(config)
        self.pin_rollouts = pin_rollouts
        self._cores = available_cores()
        self._rollout_core: dict[str, int] = {}  # kept across restarts of the same name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Marks every process this cluster starts (inherited by what they start): a group id
        # swept at shutdown may have been recycled by then (pid_max can be as low as 32768).
        self.env, self.mark = launch_env(os.environ, env)
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.roles: dict[str, str] = {}  # name -> role, for the shutdown order
        self.groups: set[int] = set()  # of every role started, killed ones too, until emptied
        self.info: dict[str, dict[str, Any]] = {}
        self.manager: str | None = None

    def serve(
        self,
        role: str,
        name: str,
        *,
        timeout: float = 120.0,
        args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
        config: str | Path | None = None,
    ) -> dict[str, Any]:
        """Start one role process named ``name``; return its ready info (address, pid, ...).

        ``prefix`` wraps the command, e.g. ``("ip", "netns", "exec", NS)`` to start it on another
        (emulated) host; it must exec the command, so signals reach the role's own process.
        ``config``: this member's config file instead of the cluster's (same ``cluster`` section,
        other role sections), e.g. a data role with another task on the same rollouts.
        """
        log, proc = self._spawn(role, name, args, prefix, config)
        info = self._wait_ready(name, proc, log, timeout)
        self.info[name] = info
        if role == "manager":
            self.manager = info["address"]
        return info

    def serve_many(
        self,
        roles: list[tuple[str, str]],
        *,
        timeout: float = 120.0,
        args: dict[str, tuple[str, ...]] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Start several members (``(role, name)`` pairs, ``args[name]`` added to a command) at
        once; wait until each is ready.

        Their start-ups overlap: a vLLM rollout spends most of its start importing and loading,
        and started one after another two of them take twice that, while a started one is
        already busy generating on the cores the next one needs. The manager must be up already.
        """
        extra = args or {}
        spawned = [
            (name, *self._spawn(role, name, extra.get(name, ()), ())) for role, name in roles
        ]
        deadline = time.monotonic() + timeout
        for name, log, proc in spawned:
            left = max(1.0, deadline - time.monotonic())
            self.info[name] = self._wait_ready(name, proc, log, left)
        return {name: self.info[name] for name, _, _ in spawned}

    def _spawn(
        self,
        role: str,
        name: str,
        args: tuple[str, ...],
        prefix: tuple[str, ...],
        config: str | Path | None = None,
    ) -> tuple[IO[str], subprocess.Popen[str]]:
        join = None if role == "manager" else self.manager
        path = Path(config) if config is not None else self.config
        spec = ServeSpec(role, name, path, join=join, args=args, prefix=prefix)
        cmd = serve_command(spec)  # before the log is opened: a member needs the manager
        log = (self.log_dir / f"{name}.log").open("a")
        proc = start(cmd, self._env_for(role, name), stderr=log, cwd=self.cwd)
        self.procs[name] = proc
        self.roles[name] = role
        self.groups.add(proc.pid)  # its group id is its pid: see ``group_members``
        return log, proc

    def _env_for(self, role: str, name: str) -> dict[str, str]:
        if role != "rollout" or not self.pin_rollouts:
            return self.env
        core = self._rollout_core.setdefault(
            name, self._cores[len(self._rollout_core) % len(self._cores)]
        )
        return cpu_env(self.env, CpuSlot((core,), 1), role)

    def _wait_ready(
        self, name: str, proc: subprocess.Popen[str], log: IO[str], timeout: float
    ) -> dict[str, Any]:
        def keep(line: str) -> None:
            log.write(line + "\n")
            log.flush()

        lines = OutputLines(proc)
        problem = "never became ready"
        try:
            info = lines.until_ready(timeout, keep)
        except LaminarError as exc:  # a ready line it cannot be started on
            info, problem = None, str(exc)
        if info is not None:
            threading.Thread(target=lines.drain, args=(keep,), daemon=True).start()
            return info
        kill_role(proc, self.mark)
        self.groups.discard(proc.pid)
        raise LaminarError(f"{name} {problem}; its log ends:\n{self.log_tail(name)}")

    def kill9(self, name: str) -> None:
        """SIGKILL the role's own process, as a crash would; what it started is left to itself
        (and to :meth:`shutdown`)."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self, name: str, grace: float = 20.0) -> None:
        """SIGTERM one member, as an operator stops it (SIGKILL if it outlives ``grace``), then
        end whatever its group still holds."""
        proc = self.procs.pop(name)
        self.roles.pop(name, None)
        self.info.pop(name, None)
        _terminate([proc], grace)
        end_role_groups([proc.pid], grace, self.mark)
        self.groups.discard(proc.pid)

    def shutdown(self, grace: float = 20.0) -> None:
        """SIGTERM the members that use the data role, then the data role, then the manager;
        SIGKILL whatever outlives ``grace``. Then the same, for all of them at once, for anything
        left in the groups of every role started (killed ones too); last, SIGKILL to anything
        else carrying the cluster's mark.

        The order is the dependency order (:func:`laminar.proc.spawn.stop_stages`)."""
        roles = {name: self.roles.get(name, "") for name in self.procs}
        for stage in stop_stages(roles):
            _terminate([self.procs[name] for name in stage], grace)
        self.procs.clear()
        self.roles.clear()
        end_role_groups(self.groups, grace, self.mark)
        self.groups.clear()
        signal_marked(self.mark, signal.SIGKILL)  # what left its role's group (a reward's fork)

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text()[-chars:] if path.exists() else ""

    def __enter__(self) -> ProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _terminate(procs: list[subprocess.Popen[str]], grace: float) -> None:
    """SIGTERM every one of ``procs``, then SIGKILL those alive ``grace`` seconds later."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
