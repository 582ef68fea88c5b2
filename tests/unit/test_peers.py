"""Reaching other roles (``laminar.runtime.peers``): ``ctx.peer`` and ``ctx.follow`` on real services.

Every service here runs in one event loop over ``inproc://`` on a ``VirtualTimeLoop``, with a real
manager: finding a peer, its death, a newcomer joining and the back-offs between all take virtual
seconds, so the tests are deterministic and cost milliseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ClassVar, TypeVar

import pytest
import structlog
from pydantic import BaseModel, Field

from laminar.roles.manager import ManagerConfig, ManagerService
from laminar.runtime.clock import get_clock, run_virtual
from laminar.runtime.config import ClusterConfig, ServiceConfig
from laminar.runtime.context import ServiceContext, transport_options
from laminar.runtime.endpoint import stream
from laminar.runtime.errors import PeerUnavailable, RemoteError
from laminar.runtime.peers import Outage, RetryPolicy, follow_stream
from laminar.runtime.service import Service, ServiceHost
from tests.support.procs import TOKEN
from tests.support.roles import Calculator, Pair, Tag

T = TypeVar("T")

CLUSTER = ClusterConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, rpc_timeout_s=5.0)
OPTIONS = transport_options(CLUSTER, TOKEN.encode())


class Caller(Service):
    """The service whose context reaches the others (a role no other service here has)."""

    role: ClassVar[str] = "caller"


class Since(BaseModel):
    after: int = Field(ge=-1)


class Tick(BaseModel):
    i: int


class Ticker(Service):
    """A stream with a cursor: ``ticks(after)`` yields ticks ``after + 1`` to ``TICKS - 1``, then
    stays open. It breaks (once each) at the ticks in ``breaks``."""

    role: ClassVar[str] = "ticker"
    TICKS: ClassVar[int] = 12
    breaks: ClassVar[set[int]] = set()
    subscriptions: ClassVar[list[int]] = []  # the ``after`` of each subscription, in order

    @stream
    async def ticks(self, req: Since) -> AsyncIterator[Tick]:
        Ticker.subscriptions.append(req.after)
        for i in range(req.after + 1, self.TICKS):
            if i in Ticker.breaks:
                Ticker.breaks.discard(i)
                raise RuntimeError(f"broke before tick {i}")
            yield Tick(i=i)
        await asyncio.Event().wait()  # open until cancelled


class Cluster:
    """Services in this loop, stopped (newest first) when the block ends."""

    def __init__(self) -> None:
        self.hosts: list[tuple[ServiceHost, asyncio.Task[None]]] = []
        self.manager: str | None = None

    async def start(
        self, cls: type[Service], instance: str, *, config: ServiceConfig | None = None
    ) -> ServiceHost:
        ctx = ServiceContext(
            role=cls.role,
            instance=instance,
            cluster=CLUSTER,
            config=config or cls.config_model(bind="inproc://*", metrics=None),
            options=OPTIONS,
        )
        host = ServiceHost(cls, ctx, manager=self.manager)
        task = asyncio.create_task(host.run())
        self.hosts.append((host, task))
        await host.started()
        return host

    async def start_manager(self) -> None:
        config = ManagerConfig(bind="inproc://*", metrics=None, admin=None)
        host = await self.start(ManagerService, "manager", config=config)
        self.manager = host.ctx.address

    async def stop(self, host: ServiceHost) -> None:
        (task,) = [t for h, t in self.hosts if h is host]
        self.hosts.remove((host, task))
        host.stop()
        await task

    async def __aenter__(self) -> Cluster:
        await self.start_manager()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for host, _ in reversed(list(self.hosts)):
            await self.stop(host)


async def until(probe: Callable[[], bool], timeout: float = 30.0) -> None:
    """Virtual seconds pass while we wait (0.01 each look)."""
    async with asyncio.timeout(timeout):
        while not probe():  # noqa: ASYNC110 - a state of the services, no event to await
            await asyncio.sleep(0.01)


def virtual(main: Callable[[], Awaitable[T]]) -> T:
    async def run() -> T:
        async with asyncio.timeout(300):  # virtual seconds: a retry loop gone wrong fails fast
            return await main()

    return run_virtual(run())


# -- Peer ----------------------------------------------------------------------------------------


def test_a_peer_is_found_through_the_manager_then_found_again_when_it_dies():
    async def main() -> None:
        async with Cluster() as cluster:
            caller = await cluster.start(Caller, "caller")
            peer = caller.ctx.peer("calculator", Calculator)
            assert peer.address is None  # nothing resolved until first used

            # no calculator yet: the call waits (on the manager's member list) until one joins
            call = asyncio.create_task(peer.call(lambda c: c.add.call(Pair(a=1, b=2))))
            await asyncio.sleep(2.0)
            assert not call.done()
            first = await cluster.start(Calculator, "calculator-a")
            assert (await call).value == 3
            assert peer.address == first.ctx.address

            # it dies (and leaves); another joins at another address: the next call forgets
            # the dead one's address after one failure and finds the newcomer
            await cluster.stop(first)
            second = await cluster.start(Calculator, "calculator-b")
            assert second.ctx.address != first.ctx.address
            await peer.call(
                lambda c: c.note.call(Tag(tag="after the death")), RetryPolicy(backoff_s=0.5)
            )
            assert peer.address == second.ctx.address
            assert second.service is not None
            assert second.service.notes == ["after the death"]  # type: ignore[attr-defined]
            assert not peer.outage.down  # the success ended the outage

    virtual(main)


def test_a_configured_address_is_kept_and_attempts_are_bounded():
    async def main() -> None:
        async with Cluster() as cluster:
            caller = await cluster.start(Caller, "caller")
            calc = await cluster.start(Calculator, "calculator-a")
            assert calc.ctx.address is not None
            peer = caller.ctx.peer("calculator", Calculator, address=calc.ctx.address)
            assert (await peer.call(lambda c: c.add.call(Pair(a=2, b=2)))).value == 4
            await cluster.start(Calculator, "calculator-b")  # alive, but not the configured one
            await cluster.stop(calc)

            tries = 0

            async def add(c: Calculator) -> object:
                nonlocal tries
                tries += 1
                return await c.add.call(Pair(a=1, b=1))

            clock = get_clock()
            began = clock.time()
            with pytest.raises(PeerUnavailable):
                await peer.call(add, RetryPolicy(attempts=3, backoff_s=2.0))
            assert tries == 3
            assert clock.time() - began == pytest.approx(4.0)  # two back-offs, on the clock
            assert peer.address == calc.ctx.address  # configured: never looked up instead
            assert peer.outage.failures == 3

    virtual(main)


def test_a_call_no_longer_wanted_gives_up_after_its_backoff():
    async def main() -> None:
        async with Cluster() as cluster:
            caller = await cluster.start(Caller, "caller")
            calc = await cluster.start(Calculator, "calculator-a")
            assert calc.ctx.address is not None
            peer = caller.ctx.peer("calculator", Calculator, address=calc.ctx.address)
            await cluster.stop(calc)
            tries = 0

            async def add(c: Calculator) -> object:
                nonlocal tries
                tries += 1
                return await c.add.call(Pair(a=1, b=1))

            clock = get_clock()
            began = clock.time()
            with pytest.raises(PeerUnavailable):  # the last error, as when attempts run out
                await peer.call(add, RetryPolicy(backoff_s=1.0), give_up=lambda: tries >= 4)
            assert tries == 4  # asked before each retry, after its back-off
            assert clock.time() - began == pytest.approx(4.0)

    virtual(main)


def test_a_policy_of_no_attempts_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        RetryPolicy(attempts=0)


def test_an_error_the_caller_handles_is_raised_at_once_and_keeps_the_peer():
    async def main() -> None:
        async with Cluster() as cluster:
            caller = await cluster.start(Caller, "caller")
            calc = await cluster.start(Calculator, "calculator-a")
            peer = caller.ctx.peer("calculator", Calculator)
            tries = 0

            async def fail(c: Calculator) -> object:
                nonlocal tries
                tries += 1
                return await c.fail.call(Tag(tag="x"))

            with pytest.raises(RemoteError, match="refusing 'x'"):
                await peer.call(
                    fail, RetryPolicy(retry_on=(RemoteError,), unless=lambda e: "x" in str(e))
                )
            assert tries == 1
            assert peer.address == calc.ctx.address
            assert not peer.outage.down

    virtual(main)


# -- follow --------------------------------------------------------------------------------------


def test_follow_resubscribes_after_breaks_and_applies_every_item_once():
    """The stream breaks twice (the server's stream raises) and its server restarts once (the
    connection drops; the new one has more ticks): each time the follower subscribes again from
    the last tick applied."""

    async def main() -> None:
        Ticker.TICKS = 12
        Ticker.breaks = {3, 7}
        Ticker.subscriptions = []
        async with Cluster() as cluster:
            ticker = await cluster.start(Ticker, "ticker", config=ServiceConfig(
                bind="inproc://ticker-under-test", metrics=None))  # fmt: skip
            caller = await cluster.start(Caller, "caller")
            peer = caller.ctx.peer("ticker", Ticker)
            applied: list[int] = []

            async def subscribe() -> AsyncIterator[Tick]:
                api = await peer.api()
                return api.ticks.stream(Since(after=applied[-1] if applied else -1))

            async def apply(tick: Tick) -> None:  # async: awaited before the next item
                await asyncio.sleep(0.01)
                applied.append(tick.i)
                if tick.i == 9:  # the server restarts (at the same address) mid-stream
                    restart.set()

            restart = asyncio.Event()
            follower = caller.ctx.follow("ticks", subscribe, apply, backoff=0.5)
            await restart.wait()
            await cluster.stop(ticker)
            Ticker.TICKS = 16
            await cluster.start(Ticker, "ticker", config=ServiceConfig(
                bind="inproc://ticker-under-test", metrics=None))  # fmt: skip
            await until(lambda: len(applied) == 16)
            await asyncio.sleep(5.0)  # nothing more arrives, and nothing twice
            assert applied == list(range(16))
            # from the start, after each break, after what had arrived before the restart
            assert Ticker.subscriptions[:3] == [-1, 2, 6]
            assert len(Ticker.subscriptions) == 4 and Ticker.subscriptions[3] >= 9
            assert not follower.done()
        assert follower.cancelled()  # owned by the caller: cancelled when it stopped

    virtual(main)


def test_follow_reports_an_outage_once_and_its_end_once():
    """A peer down for many retries is one ``lost`` and one ``back``, not one per retry; a sync
    ``apply`` is called too."""

    async def main() -> None:
        Ticker.TICKS = 12
        Ticker.breaks = set()
        Ticker.subscriptions = []
        async with Cluster() as cluster:
            caller = await cluster.start(Caller, "caller")
            bind = "inproc://ticker-later"
            api = caller.ctx.connect(Ticker, bind)
            lost: list[Exception] = []
            back: list[int] = []
            applied: list[int] = []
            follower = asyncio.create_task(
                follow_stream(
                    lambda: api.ticks.stream(Since(after=applied[-1] if applied else -1)),
                    lambda tick: applied.append(tick.i),
                    backoff=1.0,
                    sleep=caller.ctx.clock.sleep,
                    outage=Outage(lost.append, back.append),
                )
            )
            await asyncio.sleep(10.5)  # nobody listens there: ten or eleven failed subscriptions
            assert len(lost) == 1 and isinstance(lost[0], PeerUnavailable)
            assert back == []
            await cluster.start(Ticker, "ticker", config=ServiceConfig(bind=bind, metrics=None))
            await until(lambda: len(applied) == Ticker.TICKS)
            assert len(lost) == 1
            assert len(back) == 1 and back[0] >= 10
            assert applied == list(range(Ticker.TICKS))
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    virtual(main)


def test_a_logged_outage_the_peer_announced_is_an_info_not_a_warning():
    """A run's clean stop: the manager's stream from the head relay ends after that relay left
    the cluster (``ManagerService._head_left``); that loss is said, as an info. Any other loss is
    a warning, and the recovery an info either way."""
    from structlog.testing import capture_logs

    log = structlog.get_logger("test")
    left = False
    outage = Outage.logged(log, "publishes: stream lost", "publishes: stream back", lambda: left)
    with capture_logs() as logs:
        outage.failed(PeerUnavailable("tcp://127.0.0.1:1", "peer closed the connection"))
        outage.ok()
        left = True
        outage.failed(PeerUnavailable("tcp://127.0.0.1:1", "peer closed the connection"))
    assert [(e["log_level"], e["event"]) for e in logs] == [
        ("warning", "publishes: stream lost"),
        ("info", "publishes: stream back"),
        ("info", "publishes: stream lost"),
    ]
    assert logs[0]["error"] == "peer tcp://127.0.0.1:1 unavailable: peer closed the connection"
