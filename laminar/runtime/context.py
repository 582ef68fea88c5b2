"""What a service gets from its host (:class:`ServiceContext`): identity, config, clock, logs,
metrics, owned tasks, peers and executors for blocking work.

The tasks are the context's because their lifetime is the service's: ``spawn`` puts one in the
host's TaskGroup (a crash stops the service), ``run_to_end`` runs work promised to a caller past
the caller's cancellation, and ``end_tasks`` is the first step of every stop (:mod:`.service`:
``ServiceHost``), so that ``on_stop`` never closes what a task is still using.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog
from prometheus_client import CollectorRegistry

from laminar.transport import Limits, TransportOptions

from .clock import Clock, get_clock
from .config import ClusterConfig, ServiceConfig
from .errors import STREAM_ERRORS, CallTimeout, PeerUnavailable
from .executor import Executor, ExecutorFactory, ThreadExecutor
from .membership import Member, MembershipApi
from .peers import Outage, Peer, follow_stream
from .rpc.client import RpcClient, remote

S = TypeVar("S")
T = TypeVar("T")

#: How long a stop waits for work promised to a caller (``run_to_end``), and then for cancelled
#: tasks to unwind, before it goes on without them.
FINISH_S = 5.0


def transport_options(cluster: ClusterConfig, token: bytes) -> TransportOptions:
    return TransportOptions(
        token=token,
        limits=Limits(
            max_frame_bytes=cluster.max_frame_mib * 1024 * 1024,
            max_payload_bytes=cluster.max_payload_mib * 1024 * 1024,
        ),
        handshake_timeout=cluster.handshake_timeout_s,
        peer_timeout=cluster.peer_timeout,
    )


class ServiceContext:
    """What a service gets from its host: identity, config, clock, logs, metrics, tasks, peers,
    and executors for blocking work (``executors`` makes them: threads unless a harness says
    otherwise; :mod:`laminar.runtime.executor`)."""

    def __init__(
        self,
        *,
        role: str,
        instance: str,
        cluster: ClusterConfig,
        config: ServiceConfig,
        options: TransportOptions,
        clock: Clock | None = None,
        executors: ExecutorFactory = ThreadExecutor,
    ) -> None:
        self.role = role
        self.instance = instance
        self.cluster = cluster
        self.config = config
        self.options = options
        self.clock = clock or get_clock()
        self.log = structlog.get_logger(role).bind(role=role, instance=instance)
        self.registry = CollectorRegistry()
        self.address: str | None = None  # the RPC address, once bound
        self.manager: str | None = None  # the manager's address (None: standalone)
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._promised: set[asyncio.Task[Any]] = set()  # run_to_end's, a subset of _tasks
        # the stop has begun (end_tasks): no new run_to_end work, then no new task at all
        self._no_new_work = self._no_new_tasks = False
        self._clients: dict[str, RpcClient] = {}
        self._make_executor = executors
        self._executors: dict[str, tuple[int, Executor]] = {}  # name -> (workers, executor)

    def executor(self, name: str, *, workers: int = 1) -> Executor:
        """The service's executor ``name`` (made on first use, the same one after; closed when
        the service stops). Blocking calls go through one: ``await ex.run(fn, *args)``. One
        worker runs its calls one at a time, in order (what an owner of a connection needs)."""
        if name not in self._executors:
            self._executors[name] = (workers, self._make_executor(name, workers))
        made, executor = self._executors[name]
        if made != workers:
            raise ValueError(f"executor {name!r} has {made} workers, not {workers}")
        return executor

    def close_executors(self) -> None:
        executors, self._executors = list(self._executors.values()), {}
        for _, executor in executors:
            executor.close()

    def bind_tasks(self, group: asyncio.TaskGroup | None) -> None:
        """Where :meth:`spawn` starts tasks: the host's task group while the service runs (None
        once it has ended: spawning is refused from then on)."""
        self._group = group

    def cancel_tasks(self) -> None:
        """Cancel every task still owned (the host's last step, after the group is gone)."""
        for task in list(self._tasks):
            task.cancel()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Run ``coro`` as a task owned by the service: cancelled at stop, fatal if it raises."""
        if self._group is None:
            coro.close()
            raise RuntimeError("spawn() is only available while the service runs")
        self._refuse(coro, name, self._no_new_tasks)
        task = self._group.create_task(coro, name=f"{self.instance}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _refuse(self, coro: Coroutine[Any, Any, Any], name: str, refused: bool) -> None:
        if refused:
            coro.close()
            raise RuntimeError(f"{self.instance} is stopping: {name} not started")

    async def run_to_end(self, coro: Coroutine[Any, Any, T], *, name: str) -> T:
        """Run ``coro`` to its end even if the caller is cancelled meanwhile; its result.

        An endpoint's task belongs to its connection and is cancelled when that closes
        (:mod:`laminar.runtime.rpc.server`): a rollout that stops, or is killed, right after
        sending its last
        report. A handler that writes to a store on another thread and then updates what the loop
        holds (the data role queues each new trajectory for its reward) must not be cut between
        the two: the write commits whatever the caller does, and the rest would be lost (a
        trajectory stored as done and never scored). Here the work is the service's: a stop lets
        it finish (for up to ``FINISH_S``: :meth:`end_tasks`) before it ends anything else, and
        an error with no caller left to take it is logged. Not the service's task group: an
        error is the caller's answer, not a reason to stop the service."""
        self._refuse(coro, name, self._no_new_work)
        task = asyncio.ensure_future(coro)
        task.set_name(f"{self.instance}:{name}")
        for owned in (self._tasks, self._promised):
            owned.add(task)
            task.add_done_callback(owned.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._log_unclaimed)  # at once if it has ended meanwhile
            raise

    async def end_tasks(self, *, keep: asyncio.Task[Any] | None = None) -> None:
        """The first step of a stop: work promised to a caller (``run_to_end``) finishes, for
        up to ``FINISH_S``, and no new such work starts; then no new task starts, and every
        owned task but ``keep`` is cancelled and awaited (up to ``FINISH_S`` again), so none
        runs on into what ``on_stop`` closes. What outlives either wait is named in the log
        and cancelled again at the end of the stop. (Promised work may start tasks while it
        finishes: a migrated episode that waits for its environment's answer.)"""
        self._no_new_work = True
        promised = [t for t in self._promised if not t.done()]
        await self._wait(promised, "stopping before work promised to a caller finished")
        self._no_new_tasks = True
        others = [t for t in self._tasks if t is not keep and not t.done()]
        for task in others:
            task.cancel()
        await self._wait(others, "tasks still running after they were cancelled")

    async def _wait(self, tasks: list[asyncio.Task[Any]], late: str) -> None:
        """Wait up to ``FINISH_S`` for ``tasks``; name those still running, as ``late``."""
        if tasks:
            _, running = await asyncio.wait(tasks, timeout=FINISH_S)
            if running:
                self.log.warning(late, tasks=sorted(t.get_name() for t in running))

    def _log_unclaimed(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            self.log.warning(
                "failed after its caller left", task=task.get_name(), error=repr(error)
            )

    def client(self, address: str, *, timeout: float | None = None) -> RpcClient:
        """A shared, lazily connected client for ``address`` (closed when the service stops)."""
        client = self._clients.get(address)
        if client is None:
            client = RpcClient(address, self.options, timeout=timeout or self.cluster.rpc_timeout_s)
            self._clients[address] = client
        return client

    def connect(self, cls: type[S], address: str) -> S:
        """A typed proxy of the service of class ``cls`` at ``address``."""
        return remote(cls, self.client(address))

    async def members(self, role: str | None = None) -> list[Member]:
        """Alive members of the cluster (of one ``role``), as the manager sees them now."""
        if self.manager is None:
            raise PeerUnavailable("the manager", f"{self.instance} runs standalone: none to ask")
        status = await self.connect(MembershipApi, self.manager).status.call()
        return [
            m for m in status.members if m.state == "alive" and (role is None or m.role == role)
        ]

    async def find(self, role: str, *, poll_s: float = 0.5) -> str:
        """The address of an alive member of ``role``, waiting until one has joined."""
        while True:
            with contextlib.suppress(PeerUnavailable, CallTimeout):
                found = await self.members(role)
                if found:
                    return found[0].address
            await self.clock.sleep(poll_s)

    def peer(self, role: str, api_cls: type[S], *, address: str | None = None) -> Peer[S]:
        """A member of ``role`` (typed as ``api_cls``): at ``address`` if given, else found through
        the manager when first used, and found again after a call to it fails (:class:`Peer`)."""
        return Peer(self, role, api_cls, address=address)

    def follow(
        self,
        name: str,
        open_stream: Callable[[], AsyncIterator[T] | Awaitable[AsyncIterator[T]]],
        apply: Callable[[T], Awaitable[None] | None],
        *,
        backoff: float,
        errors: tuple[type[Exception], ...] = STREAM_ERRORS,
        expected: Callable[[], bool] | None = None,
    ) -> asyncio.Task[None]:
        """An owned task (``spawn``) applying every item of ``open_stream()``, subscribing again
        after ``backoff`` seconds when the stream fails or ends (:func:`follow_stream`); the
        failures are logged once per outage, as ``name`` (a warning, or an info where
        ``expected()`` says the peer announced it: :meth:`Outage.logged`)."""
        outage = Outage.logged(
            self.log, f"{name}: stream lost; subscribing again", f"{name}: stream back", expected
        )
        return self.spawn(
            follow_stream(
                open_stream,
                apply,
                backoff=backoff,
                sleep=self.clock.sleep,
                outage=outage,
                errors=errors,
            ),
            name=name,
        )

    async def close_clients(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
