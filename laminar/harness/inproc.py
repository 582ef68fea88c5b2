"""A whole cluster in one event loop: every role over ``inproc://``, on virtual time, sim engines.

Why: the integration tests of repack, relay failure, rollout failure, data restart and schedules
used to start real processes and wait in real time (heartbeats, sim engine step times, trainer
sleeps), so each spent most of its time waiting and a loaded machine made them flaky. Here the same
role code runs as :class:`ServiceHost` s in one :class:`InprocLoop` (a :class:`VirtualTimeLoop`): a
minute of heartbeats and decode steps passes in the wall time the callbacks need, and a seed fixes
the run.

The loop (:mod:`.inproc_loop`) makes a run deterministic under a seed (every member's executors
run their calls on it); the fence
(:mod:`.inproc_fence`) makes :meth:`InprocCluster.kill` a ``kill -9``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import warnings
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from laminar.roles_registry import load_role
from laminar.runtime.config import LaminarConfig
from laminar.runtime.context import ServiceContext, transport_options
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.service import Service, ServiceHost

from .inproc_fence import Fence
from .inproc_loop import MEMBER, InprocLoop, run_inproc

TOKEN = "inproc-cluster-token"  # never leaves this process

__all__ = ["InprocCluster", "InprocLoop", "inproc_cluster", "run_inproc"]

S = TypeVar("S")

#: What every in-process cluster gets unless the test's sections say otherwise (the same values
#: as the process tests' ``scenario.write_config``).
CLUSTER_DEFAULTS = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 2.0, "rpc_timeout_s": 10.0}


@dataclass
class Member:
    name: str
    section: str
    host: ServiceHost
    task: asyncio.Task[None]
    overrides: dict[str, Any] = field(default_factory=dict)
    role: str | None = None  # ``run.roles[].role`` when it is not the section's name
    killed: bool = False


class InprocCluster:
    """Members started by section name (``start("rollout", "rollout-a")``), reachable by name."""

    def __init__(self, config: LaminarConfig, loop: InprocLoop) -> None:
        self.config = config
        self.loop = loop
        self.options = transport_options(config.cluster, TOKEN.encode())
        self.members: dict[str, Member] = {}
        self.manager: str | None = None
        self.fence = Fence()
        self._clients: dict[str, RpcClient] = {}

    def role_config(
        self, section: str, overrides: dict[str, Any] | None = None, role: str | None = None
    ) -> Any:
        """The validated config a member of ``section`` gets (binds on ``inproc://``)."""
        cls = load_role(role or section)
        over: dict[str, Any] = {"bind": "inproc://*", "metrics": None}
        if section == "relay":
            over["weights_bind"] = "inproc://*"
        if section == "manager":
            over["admin"] = None
        return self.config.role_config(section, cls.config_model, {**over, **(overrides or {})})

    async def start(
        self,
        section: str,
        name: str,
        overrides: dict[str, Any] | None = None,
        role: str | None = None,
    ) -> Service:
        """Start a member of ``section`` named ``name`` and wait until it is serving (``role``:
        the role to load when it is not the section's name, as in ``run.roles``)."""
        if name in self.members and not self.members[name].killed:
            raise RuntimeError(f"{name} is already running")
        cls = load_role(role or section)
        ctx = ServiceContext(
            role=section,
            instance=name,
            cluster=self.config.cluster,
            config=self.role_config(section, overrides, role),
            options=self.options,
            executors=self.loop.executor,  # blocking work on the loop, in order (inproc_loop)
        )
        manager = None if section == "manager" else self.manager
        if section != "manager" and manager is None:
            raise RuntimeError("start the manager first")
        host = ServiceHost(cls, ctx, manager=manager)
        context = contextvars.copy_context()
        context.run(MEMBER.set, name)
        task = self.loop.create_task(host.run(), name=f"{name}:host", context=context)
        self.members[name] = Member(name, section, host, task, dict(overrides or {}), role)
        started = asyncio.create_task(host.started())
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            started.cancel()
            task.result()  # raises the start-up error
            raise RuntimeError(f"{name} stopped while starting")
        if section == "manager":
            self.manager = ctx.address
        return started.result()

    def service(self, name: str) -> Any:
        """The member's service object (a killed member's too: its last state)."""
        service = self.members[name].host.service
        assert service is not None
        return service

    def address(self, name: str) -> str:
        address = self.members[name].host.ctx.address
        assert address is not None
        return address

    def proxy(self, cls: type[S], name: str) -> S:
        """A typed RPC proxy to the member ``name`` (its current incarnation)."""
        address = self.address(name)
        if address not in self._clients:
            self._clients[address] = RpcClient(address, self.options, timeout=10.0)
        return remote(cls, self._clients[address])

    async def kill(self, name: str) -> None:
        """Stop ``name`` abruptly (see the module docstring)."""
        member = self.members[name]
        self.fence.cut(name)
        for _ in range(10):  # a task may start another while it unwinds
            live = self.loop.live_tasks(name)
            if not live:
                break
            for task in live:
                task.cancel()
            await asyncio.wait(live)
        else:
            raise RuntimeError(f"{name} keeps starting tasks while being killed")
        member.killed = True
        if member.host.service is not None:
            _reclaim(member.host.service)

    async def restart(self, name: str) -> Service:
        """Start ``name`` again (after :meth:`kill` or :meth:`stop`), same section and config."""
        member = self.members[name]
        if not member.task.done():
            raise RuntimeError(f"{name} is still running")
        self.fence.lift(name)
        return await self.start(member.section, name, member.overrides, member.role)

    async def stop(self, name: str, timeout: float = 30.0) -> None:
        """A graceful stop: ``on_stop``, leave, close."""
        member = self.members[name]
        member.host.stop()
        async with asyncio.timeout(timeout):
            await asyncio.shield(member.task)

    async def close(self) -> None:
        """Stop every member (gracefully; killed if it hangs). A member that crashed while the
        test ran fails it; one that crashed while stopping is only warned about (a process test
        does not see an exit status at shutdown either)."""
        crashed = [m for m in self.members.values() if _crashed(m.task)]
        for client in self._clients.values():
            await client.close()
        running = [m for m in self.members.values() if not m.task.done()]
        managers = [m for m in running if m.section == "manager"]
        for group in ([m for m in running if m.section != "manager"], managers):
            for m in group:
                m.host.stop()
            if group:
                await asyncio.wait([m.task for m in group], timeout=60)
        for m in running:
            if not m.task.done():
                await self.kill(m.name)
            elif _crashed(m.task):
                warnings.warn(
                    f"{m.name} crashed while stopping: {m.task.exception()!r}", stacklevel=1
                )
        if crashed and (error := crashed[0].task.exception()) is not None:
            raise error


def _crashed(task: asyncio.Task[None]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is not None


def _reclaim(service: Service) -> None:
    """What the kernel takes from a killed process and its ``on_stop`` may not have released:
    the data role's SQLite connection, its reward workers (they watch their parent and die with
    it), a relay's shared memory (left in ``/dev/shm`` for a sweep by dead owner, which cannot
    find it here: this process lives on)."""
    store = getattr(service, "store", None)
    if store is not None:
        store.close()  # the data store's connection, or a relay's VersionStore
    rewards = getattr(service, "rewards", None)
    if rewards is not None:
        for worker in list(rewards._all):
            worker.kill_group()
            worker.finish()
        rewards._all.clear()
        rewards._closed = True


def cluster_config(sections: dict[str, Any], *, seed: int) -> LaminarConfig:
    """``sections`` as a cluster config, ``seed`` given to the data role and every sim engine."""
    data: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in sections.items()}
    data["cluster"] = {**CLUSTER_DEFAULTS, **data.get("cluster", {})}
    if "data" in data:
        data["data"]["seed"] = seed
    rollout = data.get("rollout")
    if rollout is not None and isinstance(rollout.get("engine"), dict):
        rollout["engine"] = {**rollout["engine"], "seed": seed}
    return LaminarConfig.model_validate(data)


@contextlib.asynccontextmanager
async def inproc_cluster(
    sections: dict[str, Any], *, seed: int, members: Sequence[tuple[str, str]] = ()
) -> AsyncIterator[InprocCluster]:
    """A manager, then ``members`` (``(section, name)`` pairs, in order), in this loop.

    Run it under :func:`run_inproc`. Every member is stopped (gracefully; killed if it hangs)
    when the block exits.
    """
    loop = asyncio.get_running_loop()
    if not isinstance(loop, InprocLoop):
        raise RuntimeError("inproc_cluster needs an InprocLoop: run it with run_inproc()")
    cluster = InprocCluster(cluster_config(sections, seed=seed), loop)
    with cluster.fence.installed():
        try:
            await cluster.start("manager", "manager")
            for section, name in members:
                await cluster.start(section, name)
            yield cluster
        finally:
            await cluster.close()
