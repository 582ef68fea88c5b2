"""``laminar run CONFIG --launcher ray``: the same run, each role instance in a Ray actor.

Many RL teams already run Ray clusters; this launcher puts Laminar's roles on one without a
second scheduler. Everything but *where the processes run* is the local supervisor's
(:class:`laminar.devmode.supervisor.Supervisor`, subclassed here): the run directory, the cluster
token, the manager first and its ``LAMINAR_READY`` line giving the join address (written to
``cluster.json``), the progress view, the tracking, the plots, and stopping on Ctrl-C or SIGTERM
(callers first, then the data role and relays, the manager last). Each instance's process is the
same ``laminar serve`` with the same command line and environment (:mod:`laminar.proc.spawn`), run
by the same child lifecycle (:mod:`laminar.proc.children`) inside its actor
(:mod:`laminar.devmode.ray_actor`), and restarted by the same policy (:mod:`laminar.proc.restart`),
decided here on the driver from the exit the actor reports (its status, the child's own error
line, an OOM kill: :class:`laminar.proc.exits.Exit`), so a failure is said, a failure that will
repeat ends the run, and the run's exit status is decided exactly as with the local launcher. An
actor that dies (its machine lost) counts as an exit with an unknown status: the policy decides,
and a new actor takes the instance's place in its bundle.

**Placement** (:mod:`laminar.devmode.ray_place`): one placement group per machine, a relay per
machine that runs rollouts, rollouts packed by GPU count. On more than one machine every role
binds its machine's own address (``tcp://IP:0``) and each relay's weights listener too
(``relay.weights_host``), since a loopback or wildcard address cannot be dialled from elsewhere.
``run.cpus`` (core pinning) is the local launcher's only: Ray's CPUs are counted, not pinned.

**The Ray cluster** (:mod:`laminar.devmode.ray_cluster`): the one ``RAY_ADDRESS`` names, left
running, or a local one started for the run and shut down with it. Each actor's children die with
it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from laminar.devmode.ray_actor import RoleProcess
from laminar.devmode.ray_cluster import RayCluster, require_ray, result
from laminar.devmode.ray_place import (
    Demand,
    Machine,
    MachinePlan,
    cpus_wanted,
    gpus_wanted,
    plan_placement,
)
from laminar.devmode.supervisor import COLOURS, Supervisor
from laminar.proc.children import SETTLE_S, Child, processes
from laminar.proc.exits import Exit
from laminar.proc.procfs import kill_group
from laminar.proc.restart import decide, keep_running
from laminar.roles_registry import load_role_config
from laminar.runtime.config import LaminarConfig


@dataclass(frozen=True)
class Place:
    """Where one instance runs: its machine, its placement group and bundle."""

    machine: Machine
    group: Any
    index: int
    demand: Demand


class RayProcesses:
    """The role instances' processes, each in its own actor: what :class:`Supervisor` asks of
    :class:`laminar.proc.children.ChildProcesses` (``supervise``, ``stop``, ``sweep``)."""

    def __init__(
        self,
        *,
        ray: Any,
        places: dict[str, Place],
        home: str,
        env: dict[str, str],
        mark: str,
        grace: float,
        log_dir: Path,
        stopping: asyncio.Event,
        command: Any,
        echo: Any,
        say: Any,
        gave_up: Any,
    ) -> None:
        self.ray = ray
        self.places = places
        self.home = home
        self.env = env
        self.mark = mark
        self.grace = grace
        self.log_dir = log_dir
        self.stopping = stopping
        self.command = command
        self.echo = echo
        self.say = say
        self.gave_up = gave_up
        self.actor_class = ray.remote(RoleProcess)
        self.actors: dict[str, Any] = {}
        self.pids: dict[str, int] = {}  # each instance's latest process (for the last resort)

    def supervise(self, child: Child) -> asyncio.Task[None]:
        child.watcher = asyncio.create_task(
            keep_running(
                child,
                self._life,
                stopping=self.stopping,
                say=self.say,
                gave_up=self.gave_up,
                kill=self._kill,
            ),
            name=f"watch:{child.name}",
        )
        return child.watcher

    def _actor(self, child: Child) -> Any:
        actor = self.actors.get(child.name)
        if actor is None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            place = self.places[child.name]
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=place.group, placement_group_bundle_index=place.index
            )
            actor = self.actor_class.options(
                num_cpus=place.demand.cpus,
                num_gpus=place.demand.gpus,
                scheduling_strategy=strategy,
                max_restarts=0,  # the restart policy is ours
            ).remote(
                child.name,
                child.role,
                child.section,
                child.spec,
                env=self.env,
                mark=self.mark,
                grace=self.grace,
                log_dir=str(self.log_dir),
                cwd=os.getcwd(),
                gpus=place.demand.gpus,
            )
            self.actors[child.name] = actor
        return actor

    async def _ready(self, child: Child, actor: Any) -> None:
        try:
            info = await result(actor.ready.remote())
        except self.ray.exceptions.RayError:  # the actor is gone: _life says so
            return
        if info is not None:
            child.info = info
            self.pids[child.name] = int(info.get("pid", 0)) or self.pids.get(child.name, 0)
            child.ready.set()

    async def _life(self, child: Child) -> bool:
        """One incarnation in the child's actor; whether to start it again (decided and said as
        soon as its exit status is known, as the local supervisor does)."""
        actor = self._actor(child)
        child.ready.clear()
        child.exit = asyncio.get_running_loop().create_future()
        life = asyncio.ensure_future(result(actor.once.remote(self.command(child))))
        ready = asyncio.create_task(self._ready(child, actor))
        try:
            try:
                exit = Exit.from_wire(await result(actor.exited.remote()))
            except self.ray.exceptions.RayError as exc:  # the actor is gone: a new one next time
                self.actors.pop(child.name, None)
                exit = Exit(None, error=f"its Ray actor failed: {_first_line(exc)}")
            child.exit.set_result(exit.code)
            restart = not self.stopping.is_set() and decide(child, exit, self.say)
            try:
                outcome = await life
            except self.ray.exceptions.RayError:
                self.actors.pop(child.name, None)
                outcome = None
            if outcome is not None:
                self.pids[child.name] = outcome["pid"] or self.pids.get(child.name, 0)
                for line in outcome["alarms"]:
                    self.echo(child, line)
                for message, style in outcome["notes"]:
                    self.say(message, style)
            return restart
        finally:
            ready.cancel()
            life.cancel()
            if not child.exit.done():
                child.exit.set_result(None)

    async def _kill(self, child: Child) -> None:
        actor = self.actors.get(child.name)
        try:
            if actor is None:
                raise LookupError(child.name)
            async with asyncio.timeout(15.0):
                await result(actor.kill.remote())
        except (LookupError, TimeoutError, self.ray.exceptions.RayError):
            await self._kill_here(child.name)

    async def _kill_here(self, name: str) -> None:
        """The last resort when an actor cannot be reached: kill the instance's group from
        here, if it ran on the local machine (its pid and the run's mark name it)."""
        pid = self.pids.get(name)
        if pid and self.places[name].machine.node_id == self.home:
            left = await asyncio.to_thread(kill_group, pid, self.mark)
            if left:
                self.say(f"{name}: killed {processes(left)} from the driver", "bold red")

    async def stop(self, children: list[Child]) -> None:
        """SIGTERM each child's own process; SIGKILL to the group of one still running after
        the grace period; returns once their watchers are done (as the local one does)."""
        grace = self.grace
        live = [c for c in children if c.watcher is not None and not c.watcher.done()]
        for child in live:
            actor = self.actors.get(child.name)
            if actor is not None:
                actor.stop.remote()
        running = [c.exit for c in live if c.exit is not None and not c.exit.done()]
        if running:
            await asyncio.wait(running, timeout=grace)
        for child in live:
            if child.exit is not None and not child.exit.done():
                self.say(
                    f"{child.name} did not stop {grace:g} s after SIGTERM; killing its processes",
                    "bold red",
                )
                await self._kill(child)
        watchers = [c.watcher for c in live if c.watcher is not None]
        if watchers:
            await asyncio.wait(watchers, timeout=grace + SETTLE_S + 15.0)

    async def sweep(self) -> None:
        """Each actor kills what is left in the groups it started; then the actors go."""
        for name, actor in list(self.actors.items()):
            try:
                async with asyncio.timeout(30.0):
                    notes = await result(actor.sweep.remote())
            except (TimeoutError, self.ray.exceptions.RayError):
                notes = []
                await self._kill_here(name)
            for message, style in notes:
                self.say(message, style)
            self.ray.kill(actor)
        self.actors.clear()


class RaySupervisor(Supervisor):
    """:class:`Supervisor` with its processes in Ray actors (see the module docstring)."""

    def __init__(
        self,
        config: LaminarConfig,
        overrides: list[str],
        console: Console | None = None,
        resume: bool | str = False,
    ) -> None:
        self.ray = require_ray()  # before anything: a clear error without Ray
        super().__init__(config, overrides, console, resume)
        for child in self.children:
            child.cpu = None  # run.cpus plans the local machine's cores; Ray places on many

    async def run(self) -> int:
        cluster = RayCluster(self.ray)
        try:
            self.say(cluster.connect())
            home = cluster.home()
            plans = self._plan(cluster.machines(), home)
            groups = await cluster.reserve(plans, f"laminar-{self.mark.split('=')[-1][:8]}")
            places = {
                d.name: Place(plan.machine, group, i, d)
                for plan, group in zip(plans, groups, strict=True)
                for i, d in enumerate(plan.demands)
            }
            for plan in plans:
                names = ", ".join(
                    d.name + (f" ({d.gpus:g} GPU)" if d.gpus else "") for d in plan.demands
                )
                self.say(f"placement on {plan.machine.ip}: {names}")
            self.processes = RayProcesses(  # type: ignore[assignment]
                ray=self.ray,
                places=places,
                home=home,
                env=self.env,
                mark=self.mark,
                grace=self.config.run.shutdown_grace_s,
                log_dir=Path.cwd() / self.run_dir / "logs",
                stopping=self.stopping,
                command=self._command,
                echo=self._echo,
                say=self.say,
                gave_up=self._gave_up,
            )
            return await super().run()
        finally:
            cluster.close()

    def _plan(self, machines: list[Machine], home: str) -> list[MachinePlan]:
        """Place every instance; one relay per rollout machine (the relay children are made
        again to match); on several machines, bind each role to its machine's address."""
        assert self.config.source is not None
        base = Path(self.config.source).parent
        has_gpus = any(m.gpus for m in machines)
        demands: list[Demand] = []
        relays: list[Demand] = []
        relay_children: list[Child] = []
        for child in self.children:
            kind, model = load_role_config(child.spec.role, base)
            section_config = self.config.role_config(child.section, model, child.spec.config)
            d = Demand(child.name, kind, cpus_wanted(kind), gpus_wanted(kind, section_config,
                                                                        has_gpus))  # fmt: skip
            if kind == "relay":
                relays.append(d)
                relay_children.append(child)
            else:
                demands.append(d)
        plans = plan_placement(machines, demands, relays, home)
        where = {d.name: plan.machine for plan in plans for d in plan.demands}
        if relay_children:
            named = [d.name for plan in plans for d in plan.demands if d.role == "relay"]
            relay_children = self._replace(relay_children, named)
        if len(plans) > 1:
            for child in self.children:
                ip = where[child.name].ip
                child.pinned_bind = f"tcp://{ip}:0"
            for child in relay_children:
                config = {**child.spec.config, "weights_host": where[child.name].ip}
                child.spec = child.spec.model_copy(update={"config": config})
        return plans

    def _replace(self, old: list[Child], names: list[str]) -> list[Child]:
        """Replace the config's relay children by the ones the plan named (one per machine),
        where the first of them was; the new ones."""
        first = old[0]
        at = next(i for i, c in enumerate(self.children) if c is first)
        new = [
            Child(name, first.role, first.section, first.spec, COLOURS[(at + k) % len(COLOURS)])
            for k, name in enumerate(names)
        ]
        gone = {id(c) for c in old}
        kept = [c for c in self.children if id(c) not in gone]
        self.children = kept[:at] + new + kept[at:]
        return new


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__
