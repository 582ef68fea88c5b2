"""One way to start a role process: ``laminar serve``'s command line and environment, its own
process group, its output as lines, its ready line, and its end.

Two launchers start roles: ``laminar run``'s supervisor (:mod:`laminar.devmode.supervisor`, with
restarts, on the event loop: :mod:`laminar.proc.children`) and
:class:`laminar.harness.launch.ProcessCluster` (tests and benchmarks, blocking). They differ in what
they do *around* a process, not in the process: both build the command here, give it the environment
made here, start it in a process group of its own, read its stdout through
:class:`~laminar.proc.linesplit.LineSplitter` and take its address from the line
:func:`parse_ready_line` recognises.

* **The command** (:func:`serve_command`) is a pure function of a :class:`ServeSpec`, so what a
  role is started with can be checked without starting it.
* **The environment** (:func:`launch_env`) marks every process of one launch with a fresh
  ``LAMINAR_LAUNCH`` value, inherited by whatever the role starts, and keeps that mark readable
  through ``setproctitle`` (:mod:`laminar.proc.procfs`): only marked processes are ever signalled by
  group, because a group id is recycled once the group is empty. A launch needs one cluster
  token for all its roles (:func:`ensure_token`); a role pinned to cores gets its slot's thread
  settings (:func:`cpu_env`).
* **The process group**: the role leads a new process group (its id is the role's pid) in its
  launcher's session, so everything it starts (a rollout's vLLM engine core and workers) can be
  found and ended with it (:func:`kill_role`, :func:`end_role_groups`), a
  terminal's Ctrl-C (sent to the foreground group) does not reach it, and the kernel schedules it
  with its launcher, as it does bare vLLM (a session of its own is a scheduling group of its own
  under autogroup: :mod:`laminar.proc.procfs` says what that cost). Its stdin is ``/dev/null``: a
  background group that read the terminal would be stopped.
* **Death with the launcher**: a role gets SIGTERM when the thread that started it ends
  (``PR_SET_PDEATHSIG``, armed by :func:`arm_parent_death` between fork and exec), so a launcher
  that dies without stopping its roles (``laminar run`` or a test killed with -9, or a test
  process ended by SIGTERM, which runs no teardown) leaves none running: each stops what it
  started, as on any SIGTERM. The signal follows the *thread*, so :func:`start` arms it only on
  the main thread, whose end is the process's.
* **The output** is read in chunks and split into lines of at most 64 KiB, never with
  ``readline``: a longer line is cut with a marker, and the reading goes on, so a chatty role never
  blocks on a full pipe (:class:`OutputLines` without an event loop, :func:`pump_lines` with one).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from laminar.proc import owned_dirs
from laminar.proc.cpus import CpuSlot
from laminar.proc.linesplit import LineSplitter
from laminar.proc.procfs import KEEP_ENVIRON, MARK_ENV, GroupEnd, end_groups
from laminar.runtime.config import new_token, token_problem
from laminar.runtime.errors import ConfigError, LaminarError
from laminar.runtime.service import READY_PREFIX

#: Bytes read from a role's output at a time.
CHUNK = 1 << 16

try:  # resolved now, never between fork and exec: loading a library there, in a process with
    # other threads, can deadlock on the loader's lock
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None
_PR_SET_PDEATHSIG = 1
_SIGTERM = int(signal.SIGTERM)

# -- the order roles stop in -----------------------------------------------------------------------

#: Roles that others call, by when they stop: after everything else, the data role (a rollout
#: stopping hands it its partial trajectories, the trainer samples from it) and the relays
#: (rollouts follow their weight streams, the trainer publishes to them), then the manager
#: (every member leaves it on the way out).
_LAST = {"data": 1, "relay": 1, "manager": 2}


def stop_stages(roles: Mapping[str, str]) -> list[list[str]]:
    """The instances of ``roles`` (instance name -> role) in the order they stop, as stages
    that stop together: the callers first, each callee after everything that calls it. With the data
    role stopped beside them, rollouts spend their stop retrying an unreachable peer and outlive
    their grace period (a whole grace period of every test cluster's teardown, and a SIGKILL to the
    vLLM engine of each rollout at the end of ``laminar run``). Empty stages are left out."""
    stages: list[list[str]] = [[] for _ in range(max(_LAST.values()) + 1)]
    for name, role in roles.items():
        stages[_LAST.get(role, 0)].append(name)
    return [stage for stage in stages if stage]


# -- the command line ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeSpec:
    """What one ``laminar serve`` is started with."""

    role: str  # manager, ..., or module:Class / file.py:Class
    instance: str
    config: str | Path
    section: str | None = None  # its config section, when it is not the role's name
    join: str | None = None  # the manager's address: every role but the manager joins one
    standalone: bool = False  # serve without joining a manager (tests, debugging)
    sets: tuple[str, ...] = ()  # ``--set KEY=VALUE`` overrides, in order: a later one wins
    bind: str | None = None  # a pinned listen address (a restarted manager keeps its port)
    args: tuple[str, ...] = ()  # more arguments, last and verbatim
    prefix: tuple[str, ...] = ()  # wraps the command (``ip netns exec NS``); it must exec it
    python: str = sys.executable


def serve_command(spec: ServeSpec) -> list[str]:
    """The argv that starts ``spec``; a clear error for a member with no manager to join."""
    if spec.role != "manager" and spec.join is None and not spec.standalone:
        raise LaminarError(
            f"{spec.instance}: start the manager first (a {spec.role} joins it), "
            "or serve it standalone"
        )
    cmd = [*spec.prefix, spec.python, "-m", "laminar", "serve", "--role", spec.role]
    cmd += ["--config", str(spec.config), "--instance", spec.instance]
    if spec.section is not None:
        cmd += ["--section", spec.section]
    if spec.role != "manager":
        cmd += ["--standalone"] if spec.standalone else ["--join", str(spec.join)]
    sets = list(spec.sets)
    if spec.bind is not None:
        sets.append(f"{spec.section or spec.role}.bind={spec.bind}")
    for item in sets:
        cmd += ["--set", item]
    return [*cmd, *spec.args]


def config_sets(prefix: str, value: Any) -> list[str]:
    """``--set`` items that give a config section (``prefix``) the values of ``value``, a nested
    dict, one leaf each (``rollout.engine.max_tokens=64``; values as JSON)."""
    if isinstance(value, dict):
        out: list[str] = []
        for key, sub in value.items():
            out += config_sets(f"{prefix}.{key}", sub)
        return out
    return [f"{prefix}={json.dumps(value)}"]


# -- the environment -------------------------------------------------------------------------------


def launch_env(
    base: Mapping[str, str], extra: Mapping[str, str] | None = None
) -> tuple[dict[str, str], str]:
    """The environment of every role of one launch, and its mark (``NAME=value``, for the group
    helpers of :mod:`laminar.proc.procfs`): ``base`` and ``extra`` (which wins), unbuffered output,
    and the launch's own mark, kept readable through ``setproctitle``."""
    mark = uuid.uuid4().hex
    env = {
        **base,
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
        **KEEP_ENVIRON,
        MARK_ENV: mark,
    }
    return env, f"{MARK_ENV}={mark}"


def ensure_token(env: dict[str, str], token_env: str) -> None:
    """One cluster token for every role of a launch: the one ``env`` holds, checked now (a weak one
    is refused before anything starts, not by each role in turn, restarts and all), or, when there
    is none, a new random one put in ``env``."""
    value = env.get(token_env)
    if not value:
        env[token_env] = new_token()
        return
    problem = token_problem(value)
    if problem is not None:
        make = f"`export {token_env}=$(python -c 'import secrets; print(secrets.token_hex(16))')`"
        raise ConfigError(
            f"the cluster token in {token_env} {problem}; make a random one, e.g. {make}"
        )


def cpu_env(env: Mapping[str, str], slot: CpuSlot | None, role: str) -> dict[str, str]:
    """``env`` for a process on ``slot``: its thread count and cores, and for a rollout the cores
    vLLM binds its OpenMP threads to (:mod:`laminar.proc.cpus`)."""
    return dict(env) if slot is None else {**env, **slot.env(role)}


# -- the ready line --------------------------------------------------------------------------------


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The info of a ``LAMINAR_READY`` line (address, pid, ...: :func:`laminar.runtime.service.
    print_ready`); None for any other line; an error naming the line if its payload is not a JSON
    object."""
    if not line.startswith(READY_PREFIX):
        return None
    payload = line[len(READY_PREFIX) :]
    try:
        info = json.loads(payload)
    except ValueError as exc:
        raise LaminarError(f"malformed ready line {line[:200]!r}: {exc}") from None
    if not isinstance(info, dict):
        raise LaminarError(f"malformed ready line {line[:200]!r}: not a JSON object")
    return info


# -- starting and ending ---------------------------------------------------------------------------


def arm_parent_death(parent: int) -> None:
    """In a child between fork and exec (no imports, no library loading): SIGTERM when the thread
    that forked it ends; exit at once if ``parent`` (the launcher's pid) is already gone, since
    the signal armed after that would never come. A no-op where ``prctl`` is missing."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGTERM)
        if os.getppid() != parent:
            os._exit(1)


def start(
    argv: list[str],
    env: Mapping[str, str],
    *,
    stderr: IO[Any] | int = subprocess.PIPE,
    cwd: str | Path | None = None,
) -> subprocess.Popen[str]:
    """Start ``argv`` in a process group of its own (its id is the pid), stdout piped: read it with
    :class:`OutputLines` (through its file descriptor, never through ``proc.stdout``). Started
    from the main thread, it gets SIGTERM when this process ends (see the module docstring)."""
    parent = os.getpid()
    on_main = threading.current_thread() is threading.main_thread()
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        process_group=0,
        preexec_fn=(lambda: arm_parent_death(parent)) if on_main else None,
    )


async def start_async(
    argv: list[str],
    env: Mapping[str, str],
    *,
    preexec_fn: Callable[[], None] | None = None,
) -> asyncio.subprocess.Process:
    """:func:`start` on the event loop, stdout and stderr piped (read them with
    :func:`pump_lines`). ``preexec_fn`` runs in the child before exec: no imports in it."""

    def setup() -> None:  # uvloop takes no ``process_group``: the child moves itself
        os.setpgid(0, 0)
        if preexec_fn is not None:
            preexec_fn()

    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env),
        preexec_fn=setup,
    )


def kill_role(proc: subprocess.Popen[Any], mark: str, grace: float = 5.0) -> None:
    """SIGKILL the role's own process, then end what its group still holds (SIGTERM, SIGKILL
    after ``grace``). A grace period even after SIGKILL: a shared-memory tracker
    (multiprocessing's resource tracker ignores SIGTERM) unlinks its segments once its clients are
    gone, unless it is killed with them."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    end_role_groups([proc.pid], grace, mark)


def end_role_groups(
    gids: list[int] | set[int], grace: float, mark: str | None, *, settle: float = 0.0
) -> dict[int, GroupEnd]:
    """End what is left of role process groups (:func:`laminar.proc.procfs.end_groups`), then
    remove the directories of vLLM's socket files whose owners are gone
    (:func:`laminar.proc.owned_dirs.sweep`). Every launcher ends its roles' groups here.

    Why here: a rollout removes its engine's directory when it closes the engine, and the
    engine's owner watch removes it when the rollout dies first; a rollout SIGKILLed (a stop that
    outlived its grace, :func:`kill_role`) and its group ended at once leaves neither time to,
    and its directory of sockets would stay in ``/tmp`` until the next engine start on the host
    swept it."""
    ended = end_groups(gids, grace, mark, settle=settle)
    owned_dirs.sweep()
    return ended


# -- the output ------------------------------------------------------------------------------------


class OutputLines:
    """A started role's stdout as lines, for a caller without an event loop: :meth:`until_ready`,
    then :meth:`drain` (in a thread) for the rest, nothing lost between them."""

    def __init__(self, proc: subprocess.Popen[Any]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self._fd = proc.stdout.fileno()
        self._split = LineSplitter()
        self._lines: deque[str] = deque()  # read, not yet handed out
        self._ended = False

    def _read(self) -> None:
        try:
            chunk = os.read(self._fd, CHUNK)
        except OSError:  # closed under us: as good as the end
            chunk = b""
        if chunk:
            self._lines.extend(self._split.feed(chunk))
        else:
            self._lines.extend(self._split.close())
            self._ended = True

    def until_ready(self, timeout: float, on_line: Callable[[str], None]) -> dict[str, Any] | None:
        """Read until the ready line; its info, or None if the output ended, the process exited or
        ``timeout`` passed first. Every line read (the ready line too) goes to ``on_line``."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._fd, selectors.EVENT_READ)
            while True:
                while self._lines:
                    line = self._lines.popleft()
                    on_line(line)
                    info = parse_ready_line(line)
                    if info is not None:
                        return info
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    return None
                if sel.select(timeout=min(0.1, left)):
                    self._read()
                elif self.proc.poll() is not None:
                    return None

    def drain(self, on_line: Callable[[str], None]) -> None:
        """Hand every further line to ``on_line`` until the output ends (blocks: a thread's)."""
        while True:
            while self._lines:
                on_line(self._lines.popleft())
            if self._ended:
                return
            self._read()


def read_ready_line(
    proc: subprocess.Popen[Any], timeout: float, on_line: Callable[[str], None]
) -> dict[str, Any] | None:
    """Read ``proc``'s stdout until its ``LAMINAR_READY`` line; its info, or None if the process
    exited or ``timeout`` passed first. Every line read (the ready line too) goes to ``on_line``,
    with its newline."""
    return OutputLines(proc).until_ready(timeout, lambda line: on_line(line + "\n"))


async def pump_lines(stream: asyncio.StreamReader, on_line: Callable[[str], None]) -> None:
    """Hand each line of ``stream`` to ``on_line`` until it ends."""
    lines = LineSplitter()
    while chunk := await stream.read(CHUNK):
        for text in lines.feed(chunk):
            on_line(text)
    for text in lines.close():
        on_line(text)
