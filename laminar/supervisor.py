"""``laminar run``: every role of a config as a supervised process on this machine (dev mode).

The manager starts first; its ``LAMINAR_READY`` line gives the address every other role joins.
Each child's output is prefixed with its instance name in a stable colour.

A role's processes live and die together. Each child runs in its own session (so a terminal's
Ctrl-C reaches only the supervisor, which shuts them down in order), and whatever it starts (a
rollout's vLLM engine core and workers) stays in that session. The supervisor notices a child's
exit on a pidfd of the child, not by its output closing: processes the child started inherit its
stdout and stderr, so after a kill -9 the pipes stay open as long as they live. Then it ends the
child's session: SIGTERM to what is left, SIGKILL after ``run.shutdown_grace_s``, and says so
(:mod:`laminar.launch` has the session helpers, and the same policy for tests and benchmarks).
The child is reported and, by its role's ``restart`` policy, started again (``on-failure``: any
non-zero exit or a signal, kill -9 included; ``max_restarts`` times, with a growing pause; the
manager keeps its port across restarts so members find it again).

Ctrl-C or SIGTERM stops everything: SIGTERM to each child's own process (members first, the
manager last), its session ended as above once it exits, and SIGKILL to the whole session of any
child still there after ``run.shutdown_grace_s``; last, any session not yet seen empty is killed,
so no process of the run outlives it. Only processes started with the run's ``LAMINAR_LAUNCH``
value in their environment are signalled, so a recycled session id never hits someone else's.
Children die with the supervisor if it is killed (``PR_SET_PDEATHSIG``: SIGTERM, and each then
stops what it started; a vLLM engine also kills itself when its rollout is gone, see
:mod:`laminar.engines.vllm_worker`).

Each run gets its own directory (:mod:`laminar.rundir`; ``--resume`` continues one), every
child's output is kept in ``<run_dir>/logs/<name>.log``, the cores are divided between the
processes that compute (:mod:`laminar.cpus`), progress is displayed and recorded while the run
lasts (:mod:`laminar.runview`), and the plots are drawn when it ends (:mod:`laminar.plots`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from .config import LaminarConfig, RoleSpec, new_token
from .cpus import CpuSlot, available_cores, plan_cpus
from .errors import ConfigError
from .launch import MARK_ENV, session_members, signal_session
from .roles_registry import load_role
from .rundir import prepare_run_dir
from .runview import RunView
from .service import READY_PREFIX
from .tracking import TrackingPlan, plan_for_run

# A child line worth showing even when children's output goes only to their log files.
ALARMS = ("Traceback", "[error", "[critical", "Error:", "error:")

COLOURS = [
    "cyan",
    "magenta",
    "green",
    "yellow",
    "blue",
    "bright_red",
    "bright_cyan",
    "bright_magenta",
    "bright_green",
    "bright_yellow",
]


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
    log: Any = None  # the open log file
    pidfd: int | None = None  # of the current process, until its exit is seen
    # Set once the child's own process has exited, and once its session is empty as well.
    exited: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))
    ended: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _child_setup(cpus: tuple[int, ...]) -> Any:
    def setup() -> None:  # between fork and exec: only async-signal-safe-ish calls
        _die_with_parent()
        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cpus)

    return setup


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _until(check: Callable[[], bool], timeout: float) -> bool:
    """Poll ``check`` until it holds or ``timeout`` passes (``/proc`` has no events to wait on;
    a scan takes a few milliseconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def _processes(pids: list[int]) -> str:
    return f"{len(pids)} process{'es' if len(pids) != 1 else ''} (pid {', '.join(map(str, pids))})"


def _describe(code: int) -> str:
    if code >= 0:
        return f"code {code}"
    with contextlib.suppress(ValueError):
        return f"signal {-code} ({signal.Signals(-code).name})"
    return f"signal {-code}"


def _flatten(prefix: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        out: list[str] = []
        for key, sub in value.items():
            out += _flatten(f"{prefix}.{key}", sub)
        return out
    return [f"{prefix}={json.dumps(value)}"]


class Supervisor:
    def __init__(
        self,
        config: LaminarConfig,
        overrides: list[str],
        console: Console | None = None,
        resume: bool | str = False,
    ) -> None:
        if config.source is None:
            raise ConfigError("laminar run needs a config file")
        self.config = config
        self.overrides = overrides
        self.console = console or Console(highlight=False)
        self.children: list[Child] = []
        self.stopping = asyncio.Event()
        self.exit_code = 0
        # Session ids (a child's pid) not yet seen empty: swept before the supervisor returns.
        self.sessions: set[int] = set()
        self.manager_address: str | None = None
        self.run_dir = Path(config.run.run_dir)
        self.resume = resume
        base = Path(config.source).parent
        index = 0
        for spec in config.run.roles:
            role_cls = load_role(spec.role, base)  # fail before starting anything
            section = spec.section or role_cls.role
            config.role_config(section, role_cls.config_model, spec.config)  # validate early
            for i in range(spec.count):
                self.children.append(
                    Child(f"{section}-{i}", spec.role, section, spec, COLOURS[index % len(COLOURS)])
                )
                index += 1
        managers = [c for c in self.children if c.role == "manager"]
        if len(managers) != 1:
            raise ConfigError(f"run.roles must start exactly one manager (found {len(managers)})")
        self.children.sort(key=lambda c: c.role != "manager")
        self.env = dict(os.environ)
        token_env = config.cluster.token_env
        if not self.env.get(token_env):
            self.env[token_env] = new_token()
        self.env["PYTHONUNBUFFERED"] = "1"
        # Marks every process of this run, whoever its parent becomes: only those are signalled
        # by session (a session id can be recycled once the session is empty).
        self.env[MARK_ENV] = new_token()
        self.mark = f"{MARK_ENV}={self.env[MARK_ENV]}"
        if config.run.cpus == "auto":
            plan = plan_cpus(available_cores(), [(c.name, c.section) for c in self.children])
            for child in self.children:
                child.cpu = plan[child.name]
        mode = config.run.display
        if mode == "auto":
            mode = "live" if self.console.is_terminal else "lines"
        self.display = mode

    # -- output --

    def say(self, message: str, style: str = "bold") -> None:
        self.console.print(Text("supervisor | ", style="bold white") + Text(message, style=style))

    def _echo(self, child: Child, line: str) -> None:
        if child.log is not None:
            child.log.write(line + "\n")
            child.log.flush()
        if self.display == "logs" or (self.display == "lines" and any(a in line for a in ALARMS)):
            self.console.print(Text(f"{child.name:>12} | ", style=child.colour) + Text(line))

    # -- processes --

    def _command(self, child: Child) -> list[str]:
        assert self.config.source is not None
        cmd = [
            sys.executable,
            "-m",
            "laminar",
            "serve",
            "--role",
            child.role,
            "--config",
            self.config.source,
            "--instance",
            child.name,
            "--section",
            child.section,
        ]
        if child.role != "manager":
            assert self.manager_address is not None
            cmd += ["--join", self.manager_address]
        sets = list(self.overrides) + _flatten(child.section, child.spec.config)
        if child.pinned_bind:
            sets.append(f"{child.section}.bind={child.pinned_bind}")
        for item in sets:
            cmd += ["--set", item]
        return cmd

    async def _start(self, child: Child) -> None:
        child.ready.clear()
        env = self.env if child.cpu is None else {**self.env, **child.cpu.env(child.section)}
        if child.log is None:
            logs = self.run_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            child.log = (logs / f"{child.name}.log").open("a")
        child.process = await asyncio.create_subprocess_exec(
            *self._command(child),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # the session id is its pid
            preexec_fn=_child_setup(child.cpu.cpus if child.cpu else ()),
        )
        child.exited.clear()
        child.ended.clear()
        self.sessions.add(child.process.pid)
        try:
            # Unless the event loop has reaped it already (then its returncode is set), the pid
            # still names this very process: we are its parent.
            child.pidfd = os.pidfd_open(child.process.pid)
        except ProcessLookupError:
            child.pidfd = None
        if child.pidfd is not None and child.process.returncode is not None:
            os.close(child.pidfd)
            child.pidfd = None

    async def _exit_code(self, child: Child) -> int | None:
        """Wait for the child's process to exit; its exit status (negative: the signal), or None
        if the event loop reaped it before we could read it."""
        proc = child.process
        assert proc is not None
        if child.pidfd is None:
            return proc.returncode
        try:
            await _readable(child.pidfd)  # readable once it has exited, whatever holds its pipes
            # It has exited, so this does not block (WNOHANG all the same); WNOWAIT leaves the
            # reaping to the event loop's child watcher, which owns it.
            flags = os.WEXITED | os.WNOWAIT | os.WNOHANG
            try:
                info = os.waitid(os.P_PIDFD, child.pidfd, flags)  # noqa: ASYNC222
            except ChildProcessError:
                info = None
        finally:
            os.close(child.pidfd)
            child.pidfd = None
        if info is None or info.si_pid == 0:
            return proc.returncode
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    async def _end_session(self, child: Child, sid: int) -> None:
        """Stop what the child left in its session: SIGTERM, SIGKILL after the grace period."""
        grace = self.config.run.shutdown_grace_s
        # A moment for what ends by itself once its parent is gone (multiprocessing's resource
        # tracker, a vLLM engine watching its rollout): only the rest is worth a word.
        await _until(lambda: not session_members(sid, self.mark), 1.0)
        left = signal_session(sid, signal.SIGTERM, self.mark)
        if left:
            await _until(lambda: not session_members(sid, self.mark), grace)
            killed = signal_session(sid, signal.SIGKILL, self.mark)
            await _until(lambda: not signal_session(sid, signal.SIGKILL, self.mark), 10.0)
            how = f"{len(killed)} needed SIGKILL after {grace:g} s" if killed else "SIGTERM"
            them = "it" if len(left) == 1 else "them"
            message = f"{child.name} left {_processes(left)} behind; stopped {them} ({how})"
            self.say(message, "yellow")
        if not session_members(sid, self.mark):
            self.sessions.discard(sid)

    async def _pump(self, child: Child, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            if text.startswith(READY_PREFIX):
                with contextlib.suppress(ValueError):
                    child.info = json.loads(text[len(READY_PREFIX) :])
                    child.ready.set()
                continue
            self._echo(child, text)

    async def _watch(self, child: Child) -> None:
        """Own one child for the whole run: start, relay output, end its session when it exits,
        restart it per policy."""
        while True:
            await self._start(child)
            proc = child.process
            assert proc is not None and proc.stdout is not None and proc.stderr is not None
            pumps = [asyncio.create_task(self._pump(child, s)) for s in (proc.stdout, proc.stderr)]
            restart: bool | None = None  # decided (and said) as soon as the exit status is known
            try:
                code = await self._exit_code(child)
                child.exited.set()
                if code is not None and not self.stopping.is_set():
                    restart = self._decide(child, code)
                await self._end_session(child, proc.pid)
                # The session is gone, so are the pipes' writers (bar one that left the session)
                await asyncio.wait(pumps, timeout=2.0)
                if code is None:  # reaped by the event loop first: it has the status
                    with contextlib.suppress(TimeoutError):
                        code = await asyncio.wait_for(proc.wait(), 5.0)
            finally:
                for pump in pumps:
                    pump.cancel()
                child.exited.set()
                child.ended.set()
            if self.stopping.is_set():
                return
            if restart is None:
                restart = self._decide(child, -1 if code is None else code)
            if not restart:
                if child.role == "manager":
                    self.exit_code = 1
                    self.stopping.set()
                return
            await asyncio.sleep(min(0.5 * 2 ** (child.restarts - 1), 5.0))
            if self.stopping.is_set():
                return

    def _decide(self, child: Child, code: int) -> bool:
        """Whether the child is started again, by its restart policy; says which."""
        how = _describe(code)
        policy = child.spec.restart
        wanted = policy == "always" or (policy == "on-failure" and code != 0)
        if not wanted or child.restarts >= child.spec.max_restarts:
            self.say(
                f"{child.name} exited with {how}; not restarting "
                f"(policy {policy}, {child.restarts} restarts)",
                "bold red",
            )
            return False
        child.restarts += 1
        self.say(
            f"{child.name} exited with {how}; restarting "
            f"({child.restarts}/{child.spec.max_restarts})",
            "bold yellow",
        )
        return True

    async def _stop_all(self) -> None:
        # Members first, so they leave the manager cleanly; the manager last.
        await self._stop([c for c in self.children if c.role != "manager"])
        await self._stop([c for c in self.children if c.role == "manager"])

    async def _stop(self, children: list[Child]) -> None:
        """SIGTERM each child's own process (it stops what it started); its watcher sees it exit
        and ends its session. A child not gone after the grace period: SIGKILL to its session."""
        grace = self.config.run.shutdown_grace_s
        live = [c for c in children if c.process is not None and not c.ended.is_set()]
        for child in live:
            assert child.process is not None
            if not child.exited.is_set():
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace):
                await asyncio.gather(*(c.exited.wait() for c in live))
        except TimeoutError:
            for child in live:
                if not child.exited.is_set():
                    assert child.process is not None
                    self.say(
                        f"{child.name} (pid {child.process.pid}) did not stop {grace:g} s after "
                        "SIGTERM; killing its processes",
                        "bold red",
                    )
                    signal_session(child.process.pid, signal.SIGKILL, self.mark)
        # Their watchers end what their sessions still hold (with a grace period of its own).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace + 15.0):
                await asyncio.gather(*(c.ended.wait() for c in live))

    def _sweep(self) -> None:
        """Kill whatever is left in the run's sessions (a child started while the run stopped,
        a watcher cancelled before its child's session was empty): nothing outlives the run."""
        for sid in sorted(self.sessions):
            left = signal_session(sid, signal.SIGKILL, self.mark)
            if left:
                self.say(f"killed {_processes(left)} left at the end of the run", "bold red")
        self.sessions.clear()

    # -- the run --

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        real, resumed = prepare_run_dir(self.run_dir, self.config.cluster.name, self.resume)
        self.say(f"{'resuming' if resumed else 'new'} run in {real} ({self.run_dir} links to it)")
        roles = [(c.role, c.section, c.spec.config) for c in self.children]
        tracking = plan_for_run(self.config, roles, real)
        for hint in tracking.hints():  # where to look: TensorBoard, W&B
            self.say(hint)
        if any(c.cpu and c.cpu.cpus for c in self.children):
            self.say("cores: " + ", ".join(
                f"{c.name} {','.join(map(str, c.cpu.cpus)) or 'shared'}/{c.cpu.threads} thr"
                for c in self.children if c.cpu and c.section in ("rollout", "trainer")
            ))  # fmt: skip
        view = self._view(tracking)
        watchers: list[asyncio.Task[None]] = []
        try:
            manager, members = self.children[0], self.children[1:]
            watchers.append(asyncio.create_task(self._watch(manager)))
            if not await self._wait_ready(manager, watchers[0]):
                self.say("the manager did not start; see its output above", "bold red")
                self.stopping.set()
                return 1
            self.manager_address = manager.info["address"]
            manager.pinned_bind = self.manager_address
            self._write_cluster_file()
            self.say(f"manager at {self.manager_address}; starting {len(members)} more")
            for child in members:
                watchers.append(asyncio.create_task(self._watch(child)))
            duration = self.config.run.duration_s
            deadline = loop.time() + duration if duration else None
            token = self.env[self.config.cluster.token_env].encode()
            await view.run(
                self.manager_address, token, self.config.cluster, self.stopping, deadline
            )
            if not self.stopping.is_set():
                self.say(f"run budget of {duration:g} s reached; stopping")
        finally:
            self.stopping.set()
            await self._stop_all()
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            self._sweep()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            for child in self.children:
                if child.log is not None:
                    child.log.close()
        view.final()
        self.say("all roles stopped")
        if self.config.run.plots:
            self._plots(view)
        return self.exit_code

    def _trainer_metrics(self) -> Path | None:
        """The trainer's metrics file, read from its config section (not its model: that would
        import torch into the supervisor)."""
        if not any(c.section == "trainer" for c in self.children):
            return None
        path = self.config.section("trainer").get("metrics_file", "runs/latest/trainer.jsonl")
        return Path(path) if path else None

    def _view(self, tracking: TrackingPlan | None = None) -> RunView:
        return RunView(
            run_dir=self.run_dir,
            trainer_metrics=self._trainer_metrics(),
            console=self.console,
            mode=self.display,
            interval_s=self.config.run.view_interval_s,
            progress_interval_s=self.config.run.progress_interval_s,
            title=self.config.cluster.name,
            tracking=tracking,
        )

    def _plots(self, view: RunView) -> None:
        from .plots import plot_run

        try:
            written = plot_run(self.run_dir, view.trainer.path if view.trainer else None)
        except Exception as exc:  # a plot must never turn a finished run into a failed one
            self.say(f"plots failed: {type(exc).__name__}: {exc}", "bold red")
            return
        self.say(f"plots: {', '.join(str(p) for p in written)}")

    async def _wait_ready(self, child: Child, watcher: asyncio.Task[None]) -> bool:
        ready = asyncio.create_task(child.ready.wait())
        await asyncio.wait({ready, watcher}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        return child.ready.is_set()

    def _write_cluster_file(self) -> None:
        token_env = self.config.cluster.token_env
        token_file = self.run_dir / "token"
        token_file.touch(mode=0o600)
        token_file.write_text(self.env[token_env])
        (self.run_dir / "cluster.json").write_text(
            json.dumps(
                {
                    "manager": self.manager_address,
                    "token_file": str(token_file.resolve()),
                    "token_env": token_env,
                    "config": self.config.source,
                },
                indent=2,
            )
        )
