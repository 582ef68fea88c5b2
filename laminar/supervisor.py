"""``laminar run``: every role of a config as a supervised process on this machine (dev mode).

The manager starts first; its ``LAMINAR_READY`` line gives the address every other role joins.
Each child's output is prefixed with its instance name in a stable colour. A child that exits is
reported and, by its role's ``restart`` policy, started again (the manager keeps its port across
restarts so members find it again). Ctrl-C or SIGTERM stops everything: SIGTERM to each child, and
SIGKILL after ``run.shutdown_grace_s``. Children run in their own session (so a terminal's Ctrl-C
reaches only the supervisor, which shuts them down in order) and die with the supervisor if it is
killed (``PR_SET_PDEATHSIG``).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from .config import LaminarConfig, RoleSpec, new_token
from .cpus import CpuSlot, available_cores, plan_cpus
from .errors import ConfigError
from .roles_registry import load_role
from .rundir import prepare_run_dir
from .runview import RunView
from .service import READY_PREFIX

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
            start_new_session=True,
            preexec_fn=_child_setup(child.cpu.cpus if child.cpu else ()),
        )

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
        """Own one child for the whole run: start, relay output, restart per policy."""
        while True:
            await self._start(child)
            proc = child.process
            assert proc is not None and proc.stdout is not None and proc.stderr is not None
            pumps = [asyncio.create_task(self._pump(child, s)) for s in (proc.stdout, proc.stderr)]
            code = await proc.wait()
            await asyncio.gather(*pumps, return_exceptions=True)
            if self.stopping.is_set():
                return
            how = f"signal {-code}" if code < 0 else f"code {code}"
            policy = child.spec.restart
            wanted = policy == "always" or (policy == "on-failure" and code != 0)
            if not wanted or child.restarts >= child.spec.max_restarts:
                self.say(
                    f"{child.name} exited with {how}; not restarting "
                    f"(policy {policy}, {child.restarts} restarts)",
                    "bold red",
                )
                if child.role == "manager":
                    self.exit_code = 1
                    self.stopping.set()
                return
            child.restarts += 1
            self.say(
                f"{child.name} exited with {how}; restarting "
                f"({child.restarts}/{child.spec.max_restarts})",
                "bold yellow",
            )
            await asyncio.sleep(min(0.5 * 2 ** (child.restarts - 1), 5.0))

    async def _stop_all(self) -> None:
        # Members first, so they leave the manager cleanly; the manager last.
        await self._stop([c for c in self.children if c.role != "manager"])
        await self._stop([c for c in self.children if c.role == "manager"])

    async def _stop(self, children: list[Child]) -> None:
        grace = self.config.run.shutdown_grace_s
        live = [c.process for c in children if c.process and c.process.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace):
                await asyncio.gather(*(p.wait() for p in live))
        except TimeoutError:
            for proc in live:
                if proc.returncode is None:
                    self.say(
                        f"pid {proc.pid} ignored SIGTERM for {grace:g} s; killing it", "bold red"
                    )
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            await asyncio.gather(*(p.wait() for p in live))

    # -- the run --

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        real, resumed = prepare_run_dir(self.run_dir, self.config.cluster.name, self.resume)
        self.say(f"{'resuming' if resumed else 'new'} run in {real} ({self.run_dir} links to it)")
        if any(c.cpu and c.cpu.cpus for c in self.children):
            self.say("cores: " + ", ".join(
                f"{c.name} {','.join(map(str, c.cpu.cpus)) or 'shared'}/{c.cpu.threads} thr"
                for c in self.children if c.cpu and c.section in ("rollout", "trainer")
            ))  # fmt: skip
        view = self._view()
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

    def _view(self) -> RunView:
        return RunView(
            run_dir=self.run_dir,
            trainer_metrics=self._trainer_metrics(),
            console=self.console,
            mode=self.display,
            interval_s=self.config.run.view_interval_s,
            progress_interval_s=self.config.run.progress_interval_s,
            title=self.config.cluster.name,
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
