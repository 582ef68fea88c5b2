"""The runtime every role shares: lifecycle, RPC serving, heartbeats, metrics. What a service
works with (its identity, clock, owned tasks, peers, executors) is its context
(:mod:`laminar.runtime.context`).

A role is a :class:`Service` subclass with endpoints (see :mod:`laminar.runtime.endpoint`). The
:class:`ServiceHost` runs one service:

1. binds its RPC listener (any transport) and its Prometheus ``/metrics`` endpoint,
2. calls ``on_start``, joins the manager and heartbeats to it (every role but the manager),
3. prints one ``LAMINAR_READY {json}`` line on stdout (how ``laminar run`` learns addresses),
4. on SIGTERM/SIGINT, or ``host.stop()``: ends the service's own tasks (work promised to a caller,
   ``run_to_end``, may finish first), calls ``on_stop``, leaves the manager, closes the listener
   and client connections, and returns. A signal that ends a start blocking the loop
   (:func:`signals_end_the_start`) ends the host there, as a stop.

Why the tasks end before ``on_stop``: ``on_stop`` closes what they work with (a rollout's engine,
the data role's store, a relay's weight store). A task still running meanwhile meets it half
closed: a rollout's output reader met a request vLLM failed as it shut down and crashed the stop;
a relay's chain follower could start a forwarder after ``on_stop`` had cancelled the last one.
Each role used to end its own tasks first, by hand; now the host does it for all of them, and
refuses new tasks from then on (an endpoint that would start one gets a clear error). Only the
membership task lives on, to send heartbeats until the service leaves.

Structured concurrency: every background task a service starts with ``spawn`` belongs to the
host's TaskGroup. If one crashes, the whole service stops with that error (the process exits
non-zero, and the supervisor decides about a restart): a half-dead service that keeps answering
heartbeats is worse than a dead one. The stop sequence of step 4 runs on that path too, and when
``run()`` is cancelled, so a crash releases what ``on_start`` acquired.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ClassVar, TypeVar

from .config import ServiceConfig
from .context import ServiceContext
from .endpoint import check_contracts, local_notifies
from .errors import RpcError, StartInterrupted
from .membership import Heartbeat, JoinRequest, LeaveRequest, MembershipApi
from .metrics import RpcMetrics, start_metrics_server
from .rpc.client import remote
from .rpc.server import RpcServer

T = TypeVar("T")

READY_PREFIX = "LAMINAR_READY "
#: How long ``on_stop`` may take.
ON_STOP_S = 10.0


class Service:
    """Base class of roles. Subclasses set ``role``, maybe ``config_model``, and add endpoints."""

    role: ClassVar[str] = "service"
    config_model: ClassVar[type[ServiceConfig]] = ServiceConfig
    #: Its own threads do the heavy work of a step (the trainer): ``laminar serve`` leaves its
    #: priority and cores alone instead of making it give way (:mod:`laminar.proc.placement`).
    computes: ClassVar[bool] = False
    #: Its threads feed engine processes of its own (a rollout): it gives way only once it has
    #: moved off their cores (:func:`laminar.proc.placement.niceness_for`).
    feeds_engine: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A role inherits its endpoint contract (``DataApi``) and overrides every stub: check the
        # overrides agree now, at import, rather than at a client's first call.
        super().__init_subclass__(**kwargs)
        check_contracts(cls)

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.log = ctx.log

    async def on_start(self) -> None:
        """Called once the RPC listener is bound, before the service joins the cluster."""

    async def on_stop(self) -> None:
        """Called once at shutdown, whatever ended the service (a stop, a crashed task, or
        cancellation), if ``on_start`` returned. It runs after the service's own tasks have
        ended (:meth:`ServiceContext.end_tasks`: release what they used, without ending them by
        hand) and before the service leaves the manager and its connections close."""

    def on_disconnect(self, connection_id: int) -> None:
        """A client connection closed (``rpc.current_call`` tells handlers their connection id)."""

    def stats(self) -> dict[str, float]:
        """Numbers sent to the manager with every heartbeat."""
        return {}

    def advertise(self) -> dict[str, str]:
        """Extra addresses announced when joining (e.g. a relay's ``weights`` listener)."""
        return {}

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        return self.ctx.spawn(coro, name=name)


@contextlib.contextmanager
def signals_end_the_start() -> Iterator[None]:
    """For the duration, SIGTERM and SIGINT raise :class:`StartInterrupted` wherever Python is,
    for a start that blocks the event loop (vLLM's engine start), which :class:`ServiceHost`
    takes as a stop.

    Why: ``AsyncLLM.from_engine_args`` blocks the loop for the whole start (long on a loaded
    machine: three interpreters import torch and vLLM), so the loop's own signal
    handling (the service's stop) waited for its end. A rollout stopped meanwhile outlived its
    stop's grace and was killed (a run stopped in its first minute), and one whose launcher was
    killed lived on until the start ended. vLLM waits for its engine in Python (a poll of its
    handshake socket), so a Python-level handler runs at once, and raising there is what Ctrl-C
    does to a vLLM script: vLLM's start shuts down the processes it started. The loop still
    hears the signal (asyncio's wakeup fd is written by the C-level handler, which this leaves
    alone). In the main thread only: Python runs signal handlers there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise StartInterrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not set from Python; nothing to put back
                signal.signal(sig, handler)


class ServiceHost:
    """Runs one service until it is stopped; see the module docstring for the sequence."""

    def __init__(
        self,
        service_cls: type[Service],
        ctx: ServiceContext,
        *,
        manager: str | None = None,
        ready: Callable[[dict[str, Any]], None] | None = None,
        handle_signals: bool = False,
    ) -> None:
        self.service_cls = service_cls
        self.ctx = ctx
        self.manager = manager
        ctx.manager = manager
        self.ready = ready
        self.handle_signals = handle_signals
        self.service: Service | None = None
        self.server: RpcServer | None = None
        self.metrics_address: str | None = None
        self._stopping: asyncio.Event | None = None
        self._started = asyncio.Event()
        # One membership call at a time (join, heartbeat, leave): a leave must reach the manager
        # after any join already on its way, or the manager takes the leave of a member it does
        # not know yet, then the join, then marks the member dead when its connection closes
        # (every rollout of a run stopped during its vLLM start, before this lock).
        self._membership_calls = asyncio.Lock()
        self._membership_task: asyncio.Task[None] | None = None

    async def started(self) -> Service:
        await self._started.wait()
        assert self.service is not None
        return self.service

    def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    @property
    def stopping(self) -> bool:
        """Asked to stop (a signal or :meth:`stop`): the service is on its way out."""
        return self._stopping is not None and self._stopping.is_set()

    async def run(self) -> None:
        ctx = self.ctx
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        if self.handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stopping.set)
        metrics_server = None
        try:
            async with asyncio.TaskGroup() as group, contextlib.AsyncExitStack() as stack:
                ctx.bind_tasks(group)
                service = self.service = self.service_cls(ctx)
                rpc_metrics = RpcMetrics(ctx.registry, ctx.role)
                self.server = RpcServer(
                    service,
                    ctx.options,
                    role=ctx.role,
                    instance=ctx.instance,
                    on_disconnect=service.on_disconnect,
                    observe=rpc_metrics.observe,
                    max_in_flight=ctx.cluster.rpc_max_in_flight,
                )
                listener = await self.server.listen(ctx.config.bind)
                ctx.address = listener.address
                metrics_address = None
                if ctx.config.metrics:
                    host, _, port = ctx.config.metrics.rpartition(":")
                    metrics_server = start_metrics_server(
                        ctx.registry, host or "127.0.0.1", int(port or 0)
                    )
                    metrics_address = self.metrics_address = metrics_server.address
                await service.on_start()
                # From here on_stop runs however the service ends: stopped, one of its tasks
                # crashed (the group then cancels this body), or run() itself cancelled; what
                # on_start set up (a relay's shared memory, the data role's store) must be
                # released on a crash too. Not before: on_stop may rely on on_start's work.
                stack.push_async_callback(self._shutdown, service)
                if self.manager is not None:
                    self._membership_task = ctx.spawn(
                        self._membership(self.manager, metrics_address), name="membership"
                    )
                info = {
                    "role": ctx.role,
                    "instance": ctx.instance,
                    "address": listener.address,
                    "metrics": metrics_address,
                    "pid": os.getpid(),
                }
                ctx.log.info("service ready", **info)
                if self.ready is not None:
                    self.ready(info)
                self._started.set()
                await self._stopping.wait()
                ctx.log.info("stopping")
        except* StartInterrupted as stopped:  # a stop that came while on_start held the loop
            ctx.log.info("stopped while starting", signal=str(stopped.exceptions[0]))
        finally:
            ctx.bind_tasks(None)
            if self.service is not None:
                await local_notifies(self.service).close()
            if self.server is not None:
                await self.server.close()
            await ctx.close_clients()
            ctx.close_executors()
            if metrics_server is not None:
                metrics_server.close()
            if self.handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

    async def _shutdown(self, service: Service) -> None:
        ctx = self.ctx
        await ctx.end_tasks(keep=self._membership_task)
        try:
            async with asyncio.timeout(ON_STOP_S):
                await service.on_stop()
        except Exception:
            ctx.log.exception("on_stop failed")
        if self.manager is not None:
            async with self._membership_calls:  # a join or heartbeat under way is answered first
                if self._membership_task is not None:
                    self._membership_task.cancel()  # and none follows the leave
                with contextlib.suppress(RpcError):
                    mgr = ctx.connect(MembershipApi, self.manager)
                    await mgr.leave.options(timeout=1.0).call(LeaveRequest(instance=ctx.instance))
        if self.server is not None:
            await self.server.close()
        ctx.cancel_tasks()

    async def _membership(self, manager: str, metrics: str | None) -> None:
        """Join the manager, then heartbeat; rejoin whenever the manager forgot us."""
        ctx = self.ctx
        interval = ctx.cluster.heartbeat_interval_s
        client = ctx.client(manager, timeout=max(interval * 2, 1.0))
        mgr = remote(MembershipApi, client)
        assert ctx.address is not None and self.service is not None
        join = JoinRequest(
            instance=ctx.instance,
            role=ctx.role,
            address=ctx.address,
            metrics=metrics,
            host=socket.gethostname(),
            pid=os.getpid(),
            endpoints=self.service.advertise(),
        )
        joined, complained = False, False
        while True:
            try:
                if not joined:
                    async with self._membership_calls:
                        reply = await mgr.join.call(join)
                    joined, complained = True, False
                    ctx.log.info(
                        "joined cluster",
                        manager=manager,
                        cluster=reply.cluster,
                        incarnation=reply.incarnation,
                    )
                else:
                    async with self._membership_calls:
                        ack = await mgr.heartbeat.call(
                            Heartbeat(instance=ctx.instance, stats=self.service.stats())
                        )
                    joined = not ack.rejoin
            except RpcError as exc:
                if not complained:
                    ctx.log.warning(
                        "manager unreachable; retrying", manager=manager, error=str(exc)
                    )
                    complained = True
            await ctx.clock.sleep(interval)


def print_ready(info: dict[str, Any]) -> None:
    """The one machine-readable line a supervisor waits for."""
    sys.stdout.write(READY_PREFIX + json.dumps(info) + "\n")
    sys.stdout.flush()
