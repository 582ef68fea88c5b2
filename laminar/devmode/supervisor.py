"""``laminar run``: every role of a config as a supervised process on the local machine (dev mode).

The manager starts first; its ``LAMINAR_READY`` line gives the address every other role joins.
Each child's output goes to ``<run_dir>/logs/<name>.log`` (and to the console, prefixed with its
instance name in a stable colour, by ``run.display``).

A role's processes live and die together (:mod:`laminar.proc.children` has the lifecycle of each
child's process). Each child runs in its own process group, so a terminal's Ctrl-C reaches only the
supervisor, which shuts them down in order, and whatever the child starts (a rollout's vLLM engine
core and workers) stays in that group. The supervisor notices a child's exit on a pidfd, not by
its output closing (what the child started inherits its pipes), ends what its group still holds
(SIGTERM, SIGKILL after ``run.shutdown_grace_s``, and says so), and restarts it by its role's
``restart`` policy (``on-failure``: any non-zero exit or a signal, kill -9 included;
``max_restarts`` times, with a growing pause; the manager keeps its port across restarts so
members find it again).

**When a role fails** (``docs/deploy.md``, *When a role fails*): each exit is said on the console
with the child's own error line (an OOM kill in those words), whatever ``run.display`` shows
(:mod:`laminar.proc.exits`). The run ends at once, with status 1 and the reason, when a role
cannot run: a child whose configuration was refused, one that fails the same way at every start
(:mod:`laminar.proc.restart`), the manager given up on, or the last live instance of a role given
up on after a failure (no data role, no trainer, no rollout left: nothing could make progress).
A run that lost only some instances of a role (one of two rollouts) goes on, and still exits with
status 1. Its last lines name every instance that ended dead, and how.

Ctrl-C or SIGTERM stops everything: SIGTERM to each child's own process (callers before what they
call: rollouts and trainer, then the data role and relays, then the manager), its group ended as
above once it exits, and SIGKILL to the whole group of any child still there after
``run.shutdown_grace_s``; last, any group not yet seen empty is killed, and anything else carrying
the run's mark, so no process of the run outlives it. Then the run's tracker is closed
(TensorBoard, W&B), so stopping the roles never waits on it. Only processes started with the run's
``LAMINAR_LAUNCH`` value in their environment are signalled, so a recycled group id never hits
someone else's; every child gets ``SPT_NOENV=1`` so that vLLM's process titles do not wipe that
value from ``/proc`` (:mod:`laminar.proc.procfs`). Children die with the supervisor if it is killed
(``PR_SET_PDEATHSIG``: SIGTERM, and each then stops what it started; a vLLM engine also kills
itself when its rollout is gone, see :mod:`laminar.engines.vllm_worker`).

**Private files.** The run directory is 0700; the token file, ``cluster.json`` and the logs are
0600; the supervisor and every child run with umask 077, so what the roles write (the data role's
SQLite file and its WAL, checkpoints) is this user's only. A token given in the environment is
checked before anything starts (:func:`laminar.runtime.config.token_problem`).

Each run gets its own directory (:mod:`laminar.devmode.rundir`; ``--resume`` continues one), the
cores are divided between the processes that compute (:mod:`laminar.proc.cpus`), progress is
displayed and recorded while the run lasts (:mod:`laminar.devmode.runview`), and the plots are drawn
when it ends (:mod:`laminar.devmode.plots`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
from pathlib import Path

from rich.console import Console
from rich.text import Text

from laminar.devmode import ALARMS
from laminar.devmode.rundir import prepare_run_dir
from laminar.devmode.runview import RunView
from laminar.proc.children import Child, ChildProcesses
from laminar.proc.cpus import available_cores, plan_cpus
from laminar.proc.gpus import gpus_wanted, plan_gpus, visible_gpus
from laminar.proc.spawn import (
    ServeSpec,
    config_sets,
    ensure_token,
    launch_env,
    serve_command,
    stop_stages,
)
from laminar.roles_registry import load_role_config
from laminar.runtime.config import LaminarConfig
from laminar.runtime.errors import ConfigError
from laminar.tracking import TrackingPlan, plan_for_run

#: How long the manager may take to say it is ready. A manager that exits is seen at once (its
#: watcher ends first), so this bounds only one that hangs, and generously: a healthy manager
#: started beside other processes that start vLLM engines on the same cores can take minutes.
MANAGER_READY_S = 300.0

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
        self.ended: str | None = None  # why the run ended early (a role could not run)
        self.manager_address: str | None = None
        self.run_dir = Path(config.run.run_dir)
        self.resume = resume
        base = Path(config.source).parent
        index = 0
        for spec in config.run.roles:
            role, model = load_role_config(spec.role, base)  # fail before starting anything
            section = spec.section or role
            config.role_config(section, model, spec.config)  # validate early
            for i in range(spec.count):
                self.children.append(
                    Child(f"{section}-{i}", spec.role, section, spec, COLOURS[index % len(COLOURS)])
                )
                index += 1
        managers = [c for c in self.children if c.role == "manager"]
        if len(managers) != 1:
            raise ConfigError(f"run.roles must start exactly one manager (found {len(managers)})")
        self.children.sort(key=lambda c: c.role != "manager")
        # Marks every process of this run, whoever its parent becomes: only those are signalled
        # by group (a group id can be recycled once the group is empty).
        self.env, self.mark = launch_env(os.environ)
        ensure_token(self.env, config.cluster.token_env)  # the user's own, or a new one
        if config.run.cpus == "auto":
            plan = plan_cpus(available_cores(), [(c.name, c.section) for c in self.children])
            for child in self.children:
                child.cpu = plan[child.name]
        self._plan_gpus(config)
        mode = config.run.display
        if mode == "auto":
            mode = "live" if self.console.is_terminal else "lines"
        self.display = mode
        self.processes = ChildProcesses(
            env=self.env,
            mark=self.mark,
            grace=config.run.shutdown_grace_s,
            log_dir=self.run_dir / "logs",
            stopping=self.stopping,
            command=self._command,
            echo=self._echo,
            say=self.say,
            gave_up=self._gave_up,
        )

    def _plan_gpus(self, config: LaminarConfig) -> None:
        """Each instance its own GPUs, on a machine with any (:mod:`laminar.proc.gpus`)."""
        gpus = visible_gpus(os.environ)
        if not gpus:
            return
        assert config.source is not None
        base = Path(config.source).parent
        wants = []
        for child in self.children:
            role, model = load_role_config(child.spec.role, base)
            section = config.role_config(child.section, model, child.spec.config)
            wants.append((child.name, gpus_wanted(role, section, True)))
        plan = plan_gpus(gpus, wants)
        for child in self.children:
            child.gpus = plan[child.name]

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
        """The child's ``laminar serve``: the run's overrides, then its own ``config`` from
        ``run.roles``; a restarted manager keeps its address (``pinned_bind``)."""
        assert self.config.source is not None
        spec = ServeSpec(
            child.role,
            child.name,
            self.config.source,
            section=child.section,
            join=None if child.role == "manager" else self.manager_address,
            sets=(*self.overrides, *config_sets(child.section, child.spec.config)),
            bind=child.pinned_bind or None,
        )
        return serve_command(spec)

    def _gave_up(self, child: Child) -> None:
        """A child will not be started again while the run goes on: end the run if it cannot
        go on without it (see the module docstring), else say what is left."""
        if child.role != "manager" and child.dead is None:  # it ended cleanly: nothing lost
            return
        self.exit_code = 1
        if child.role == "manager":
            reason = f"the manager ({child.name}) {child.dead or 'ended'}"
        elif child.fatal is not None:
            reason = child.fatal
        else:
            same = [c for c in self.children if c.role == child.role]
            left = [c for c in same if not c.done]
            if left:
                self.say(
                    f"the run goes on without {child.name} ({len(left)} of {len(same)} "
                    f"{child.role} instances left); it will end with status 1",
                    "bold yellow",
                )
                return
            gone = ", ".join(c.name for c in same if c.dead is not None)
            reason = f"no {child.role} instance left ({gone} ended dead)"
        if self.ended is None:
            self.ended = reason
            self.say(f"ending the run: {reason}", "bold red")
        self.stopping.set()

    def _verdict(self) -> None:
        """The last lines: every instance that ended dead, how, and why the run failed."""
        dead = [c for c in self.children if c.dead is not None]
        for child in dead:
            self.say(f"{child.name} ended dead: {child.dead}", "bold red")
        if self.exit_code:
            why = self.ended or f"{len(dead)} role instance(s) ended dead"
            self.say(f"run failed (exit status {self.exit_code}): {why}", "bold red")

    async def _stop_all(self) -> None:
        # Callers before what they call (stop_stages): rollouts and trainer, then the data role
        # and relays, then the manager, so each stops while its peers still answer.
        by_name = {c.name: c for c in self.children}
        for stage in stop_stages({c.name: c.role for c in self.children}):
            await self.processes.stop([by_name[name] for name in stage])

    # -- the run --

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        view: RunView | None = None
        watchers: list[asyncio.Task[None]] = []
        umask = os.umask(0o077)  # what the run writes here is this user's only (children: too)
        try:
            real, resumed = prepare_run_dir(self.run_dir, self.config.cluster.name, self.resume)
            how = "resuming" if resumed else "new"
            self.say(f"{how} run in {real} ({self.run_dir} links to it)")
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
            manager, members = self.children[0], self.children[1:]
            watchers.append(self.processes.supervise(manager))
            if await self._wait_ready(manager, watchers[0]):
                await self._members(view, manager, members, watchers)
            else:
                self.say("the manager did not start; see its output above", "bold red")
                self.ended = self.ended or "the manager did not start"
                self.exit_code = 1
        finally:
            try:
                self.stopping.set()
                await self._stop_all()
                for task in watchers:
                    task.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
                await self.processes.sweep()
                if view is not None and hasattr(view, "close_tracking"):
                    await view.close_tracking()  # after the roles: stopping them never waits
            finally:
                os.umask(umask)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
                for child in self.children:
                    if child.log is not None:
                        child.log.close()
        assert view is not None
        view.final()
        self.say("all roles stopped")
        if self.config.run.plots and self.manager_address is not None:
            self._plots(view)
        self._verdict()
        return self.exit_code

    async def _members(
        self,
        view: RunView,
        manager: Child,
        members: list[Child],
        watchers: list[asyncio.Task[None]],
    ) -> None:
        """Once the manager is ready: start every other role, then watch the run until it is
        stopped, its budget is spent, or a role it needs ended."""
        self.manager_address = manager.info["address"]
        manager.pinned_bind = self.manager_address
        self._write_cluster_file()
        self.say(f"manager at {self.manager_address}; starting {len(members)} more")
        for child in members:
            watchers.append(self.processes.supervise(child))
        duration = self.config.run.duration_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + duration if duration else None
        token = self.env[self.config.cluster.token_env].encode()
        await view.run(self.manager_address, token, self.config.cluster, self.stopping, deadline)
        if not self.stopping.is_set():
            self.say(f"run budget of {duration:g} s reached; stopping")

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
        from laminar.devmode.plots import plot_run

        try:
            written = plot_run(self.run_dir, view.trainer.path if view.trainer else None)
        except Exception as exc:  # a plot must never turn a finished run into a failed one
            self.say(f"plots failed: {type(exc).__name__}: {exc}", "bold red")
            return
        self.say(f"plots: {', '.join(str(p) for p in written)}")

    async def _wait_ready(self, child: Child, watcher: asyncio.Task[None]) -> bool:
        ready = asyncio.create_task(child.ready.wait())
        await asyncio.wait(
            {ready, watcher}, timeout=MANAGER_READY_S, return_when=asyncio.FIRST_COMPLETED
        )
        ready.cancel()
        return child.ready.is_set()

    def _write_cluster_file(self) -> None:
        token_env = self.config.cluster.token_env
        token_file = self.run_dir / "token"
        _write_private(token_file, self.env[token_env])
        info = {
            "manager": self.manager_address,
            "token_file": str(token_file.resolve()),
            "token_env": token_env,
            "config": self.config.source,
        }
        _write_private(self.run_dir / "cluster.json", json.dumps(info, indent=2))


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` readable by this user only (0600), whatever the umask, and whatever mode a
    file already there (a resumed run's) had: it is never readable by others, not even briefly.

    The text goes to a private temporary file beside ``path`` that then replaces it, so a reader
    polling for ``cluster.json`` (``laminar admin``, a script waiting for the run) sees no file or
    the whole file, never the empty one an in-place write shows between its open and its
    write."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, "w") as f:
            os.fchmod(fd, 0o600)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
