"""Chain followers and a restarted manager: views compare by (manager incarnation, epoch).

A restarted manager counts epochs from 1 again. Followers that compared epochs alone ignored
every view of the new manager until its count passed the old one (issue 15).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from laminar.roles.manager import ManagerConfig, ManagerService
from laminar.roles.manager.api import ChainView, RelayInfo, follow_chain
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import ServiceContext, transport_options
from laminar.runtime.membership import JoinRequest, LeaveRequest, MembershipApi
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.service import ServiceHost
from tests.support.poll import STOP_S, until
from tests.support.procs import TOKEN

# A long heartbeat timeout: the relays below join by hand and never heartbeat.
CLUSTER = ClusterConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=60.0, rpc_timeout_s=5.0)
OPTIONS = transport_options(CLUSTER, TOKEN.encode())


def view(incarnation: str, epoch: int) -> ChainView:
    relay = RelayInfo(instance="relay-0", address="tcp://127.0.0.1:1", weights="tcp://127.0.0.1:2")
    return ChainView(incarnation=incarnation, epoch=epoch, relays=[relay])


def test_a_new_incarnation_supersedes_any_epoch():
    assert view("B", 1).supersedes(view("A", 10))
    assert view("A", 11).supersedes(view("A", 10))
    assert not view("A", 10).supersedes(view("A", 10))
    assert not view("A", 9).supersedes(view("A", 10))
    assert view("A", 1).supersedes(ChainView())  # a follower that has seen nothing


class Manager:
    """A manager service in this event loop that can be stopped and started again at one port."""

    def __init__(self) -> None:
        self.host: ServiceHost | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self, bind: str = "tcp://127.0.0.1:0") -> ManagerService:
        ctx = ServiceContext(
            role="manager",
            instance="manager",
            cluster=CLUSTER,
            config=ManagerConfig(bind=bind, metrics=None, admin=None),
            options=OPTIONS,
        )
        self.host = ServiceHost(ManagerService, ctx)
        self.task = asyncio.create_task(self.host.run())
        service = await self.host.started()
        assert isinstance(service, ManagerService)
        return service

    @property
    def address(self) -> str:
        assert self.host is not None and self.host.ctx.address is not None
        return self.host.ctx.address

    async def stop(self) -> None:
        if self.host is not None and self.task is not None:
            self.host.stop()
            await asyncio.wait_for(self.task, STOP_S)
            self.host = self.task = None


@pytest.fixture
async def manager() -> AsyncIterator[Manager]:
    m = Manager()
    yield m
    await m.stop()


def relay(name: str) -> JoinRequest:
    return JoinRequest(
        instance=name, role="relay", address="tcp://127.0.0.1:1",
        endpoints={"weights": f"tcp://127.0.0.1:9/{name}"},
    )  # fmt: skip


async def applied(views: list[ChainView], want: Callable[[ChainView], bool]) -> ChainView:
    async def probe() -> ChainView | None:
        return next((v for v in reversed(views) if want(v)), None)

    return await until(probe, 10, interval=0.02)


async def test_follower_takes_a_restarted_managers_views(manager: Manager):
    first = await manager.start()
    address = manager.address
    views: list[ChainView] = []
    follower_client = RpcClient(address, OPTIONS, timeout=5.0)
    members_client = RpcClient(address, OPTIONS, timeout=5.0)
    follower = asyncio.create_task(
        follow_chain(
            follower_client,
            views.append,
            retry_s=0.05,
            on_error=lambda _: None,
            sleep=asyncio.sleep,
        )
    )
    try:
        members = remote(MembershipApi, members_client)
        await members.join.call(relay("relay-0"))
        for i in range(1, 6):  # churn: the first manager's epoch reaches 11
            await members.join.call(relay(f"relay-{i}"))
            await members.leave.call(LeaveRequest(instance=f"relay-{i}"))
        old = await applied(views, lambda v: v.epoch == 11)
        assert old.incarnation == first.incarnation
        assert [r.instance for r in old.relays] == ["relay-0"]
        assert [v.epoch for v in views] == list(range(1, 12))  # each once, in order

        await manager.stop()
        second = await manager.start(address)  # the same address, a new incarnation
        assert second.incarnation != first.incarnation
        await members.join.call(relay("relay-7"))  # the client reconnects by itself
        new = await applied(views, lambda v: v.incarnation == second.incarnation)
        assert new.epoch == 1
        assert [r.instance for r in new.relays] == ["relay-7"]
        # its later views (epoch 2 and on) are taken too, and none twice
        await members.join.call(relay("relay-8"))
        later = await applied(views, lambda v: v.incarnation == second.incarnation and v.epoch == 2)
        assert [r.instance for r in later.relays] == ["relay-7", "relay-8"]
        seen = [(v.incarnation, v.epoch) for v in views]
        assert len(seen) == len(set(seen))
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await follower_client.close()
        await members_client.close()
