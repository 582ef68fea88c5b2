"""Start role processes from Python: ``laminar serve`` children with their ready lines and logs.

For programs that need a real multi-process cluster without the dev-mode supervisor's console:
integration tests, benchmarks. Each child is ``python -m laminar serve --role R ...``; its
``LAMINAR_READY`` line gives the address; everything else it prints goes to ``<log_dir>/<name>.log``
(a thread drains stdout after the ready line, so a chatty child never blocks on a full pipe).

Each child runs in its own session (so its process group, and everything it starts, can be told
apart from the caller's), and a role's processes end with it: :meth:`ProcessCluster.shutdown`
stops each role, then whatever its session still holds (SIGTERM, SIGKILL after the grace), killed
roles' sessions included (all sessions at once: one grace period, not one each).
:meth:`ProcessCluster.kill9` kills only the role's own process, the way a crash does, so tests can
watch what happens to the rest (a vLLM engine kills itself, see :mod:`laminar.engines.vllm_worker`).
The session helpers are in :mod:`laminar.procfs`, shared with ``laminar run``.

Rollouts are pinned one core each, round robin (``pin_rollouts``), the way ``laminar run``'s CPU
plan pins them (:mod:`laminar.cpus`): left alone, every vLLM CPU engine binds its OpenMP threads
to the same cores, and two engines' spinning threads starved each other so badly that a second
engine took over 180 s to start on a 2-core machine (issue 15's CI failure). Sim engines ignore it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .cpus import CpuSlot, available_cores
from .errors import LaminarError
from .procfs import KEEP_ENVIRON, MARK_ENV, end_session, end_sessions
from .service import READY_PREFIX


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
        # Marks every process this cluster starts (inherited by what they start): a session id
        # swept at shutdown may have been recycled by then (pid_max can be as low as 32768).
        token = uuid.uuid4().hex
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
            **KEEP_ENVIRON,  # vLLM's setproctitle would wipe the mark from /proc: see procfs
            MARK_ENV: token,
        }
        self.mark = f"{MARK_ENV}={token}"
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.sessions: set[int] = set()  # of every role started, killed ones too, until emptied
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
    ) -> dict[str, Any]:
        """Start one role process named ``name``; return its ready info (address, pid, ...).

        ``prefix`` wraps the command, e.g. ``("ip", "netns", "exec", NS)`` to start it on another
        (emulated) host; it must exec the command, so signals reach the role's own process.
        """
        log, proc = self._spawn(role, name, args, prefix)
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

        Their start-ups overlap: a vLLM rollout spends ~20 s importing and loading, and started
        one after another two of them took twice that, while a started one was already busy
        generating on the cores the next one needed. The manager must be up already.
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
        self, role: str, name: str, args: tuple[str, ...], prefix: tuple[str, ...]
    ) -> tuple[IO[str], subprocess.Popen[str]]:
        cmd = [*prefix, sys.executable, "-m", "laminar", "serve", "--role", role]
        cmd += ["--config", str(self.config), "--instance", name, *args]
        if role != "manager":
            if self.manager is None:
                raise LaminarError("start the manager first")
            cmd += ["--join", self.manager]
        log = (self.log_dir / f"{name}.log").open("a")
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=self._env_for(role, name),
            cwd=self.cwd,
            start_new_session=True,  # its session id is its pid: see ``session_members``
        )
        self.procs[name] = proc
        self.sessions.add(proc.pid)
        return log, proc

    def _env_for(self, role: str, name: str) -> dict[str, str]:
        if role != "rollout" or not self.pin_rollouts:
            return self.env
        core = self._rollout_core.setdefault(
            name, self._cores[len(self._rollout_core) % len(self._cores)]
        )
        slot = CpuSlot((core,), 1)
        return {**self.env, **slot.env(role)}

    def _wait_ready(
        self, name: str, proc: subprocess.Popen[str], log: IO[str], timeout: float
    ) -> dict[str, Any]:
        def keep(line: str) -> None:
            log.write(line)
            log.flush()

        info = read_ready_line(proc, timeout, keep)
        if info is not None:
            assert proc.stdout is not None
            threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
            return info
        proc.kill()
        proc.wait(timeout=10)
        # A grace period even here: a tracker of shared memory (multiprocessing's resource
        # tracker ignores SIGTERM) unlinks it once its clients are gone, unless killed with them.
        end_session(proc.pid, grace=5.0, mark=self.mark)
        self.sessions.discard(proc.pid)
        raise LaminarError(f"{name} never became ready; its log ends:\n{self.log_tail(name)}")

    def kill9(self, name: str) -> None:
        """SIGKILL the role's own process, as a crash would; what it started is left to itself
        (and to :meth:`shutdown`)."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def shutdown(self, grace: float = 20.0) -> None:
        """SIGTERM the members, then the manager; SIGKILL whatever outlives ``grace``. Then the
        same, for all of them at once, for anything left in the sessions of every role started
        (killed ones too)."""
        members = [p for name, p in self.procs.items() if name != "manager"]
        manager = [p for name, p in self.procs.items() if name == "manager"]
        for group in (members, manager):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for proc in group:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.procs.clear()
        end_sessions(self.sessions, grace, self.mark)
        self.sessions.clear()

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text()[-chars:] if path.exists() else ""

    def __enter__(self) -> ProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def read_ready_line(
    proc: subprocess.Popen[str], timeout: float, on_line: Callable[[str], None]
) -> dict[str, Any] | None:
    """Read ``proc``'s stdout until its ``LAMINAR_READY`` line; its info, or None if the process
    exited or ``timeout`` passed first. Every line read (the ready line too) goes to ``on_line``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.1):
                if proc.poll() is not None:
                    return None
                continue
            line = proc.stdout.readline()
            if not line:
                return None
            on_line(line)
            if line.startswith(READY_PREFIX):
                return json.loads(line[len(READY_PREFIX) :])
    return None


def _drain(src: IO[str], dst: IO[str]) -> None:
    for line in src:
        dst.write(line)
        dst.flush()
