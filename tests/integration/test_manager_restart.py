"""A manager restart: the chain keeps healing and live rollouts keep their leases (issue 15).

In-process services over TCP, with the real clock. The manager is stopped and a new one started
at the same address, as a supervisor or Kubernetes restarts it; every other role stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from laminar.roles.data.api import DataApi, TakeRequest
from laminar.roles.data.service import DataConfig, DataService
from laminar.roles.manager import ManagerConfig, ManagerService
from laminar.roles.relay import RelayConfig, RelayService
from laminar.roles.relay.api import LatestRequest, RelayApi
from laminar.roles.trainer.publisher import WeightPublisher
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.errors import CallTimeout, PeerUnavailable, RemoteError
from laminar.runtime.membership import Heartbeat, JoinRequest, LeaveRequest, MembershipApi
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.service import ServiceHost
from laminar.weights.config import PublishConfig
from tests.support.poll import STOP_S, until
from tests.support.task import write_prompts, write_tokenizer

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster() -> ClusterConfig:
    # Fast heartbeats (members rejoin the new manager at once); a timeout long enough that the
    # data role reconnects (it retries every second) while the new manager's list is unsettled.
    return ClusterConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0, rpc_timeout_s=5.0)


class Manager:
    """A manager service in this event loop that can be stopped and started again at one port."""

    def __init__(self, cluster: ClusterConfig, options) -> None:  # type: ignore[no-untyped-def]
        self.cluster, self.options = cluster, options
        self.host: ServiceHost | None = None
        self.task: asyncio.Task[None] | None = None
        self.address = ""

    async def start(self, bind: str = "tcp://127.0.0.1:0") -> ManagerService:
        ctx = ServiceContext(
            role="manager",
            instance="manager",
            cluster=self.cluster,
            config=ManagerConfig(bind=bind, metrics=None, admin=None),
            options=self.options,
        )
        self.host = ServiceHost(ManagerService, ctx)
        self.task = asyncio.create_task(self.host.run())
        service = await self.host.started()
        assert isinstance(service, ManagerService) and ctx.address is not None
        self.address = ctx.address
        return service

    async def restart(self) -> ManagerService:
        await self.stop()
        return await self.start(self.address)

    async def stop(self) -> None:
        if self.host is not None and self.task is not None:
            self.host.stop()
            await asyncio.wait_for(self.task, STOP_S)
            self.host = self.task = None


@pytest.fixture
async def manager(cluster, options) -> AsyncIterator[Manager]:  # type: ignore[no-untyped-def]
    m = Manager(cluster, options)
    yield m
    await m.stop()


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layer.{i}.weight", torch.randn(4096, generator=g)) for i in range(4)]


async def test_trainer_and_relays_follow_the_chain_of_a_restarted_manager(
    serve, manager: Manager, options
):
    first = await manager.start()
    relays = {}
    for name in ("relay-0", "relay-1"):
        cfg = RelayConfig(bind="tcp://127.0.0.1:0", metrics=None, weights_bind="tcp://127.0.0.1:0")
        relays[name] = await serve(RelayService, instance=name, manager=manager.address, config=cfg)
    clients = [RpcClient(manager.address, options, timeout=5.0) for _ in range(2)]
    publisher = WeightPublisher(PublishConfig(chunks=4), options, manager=clients[0])
    pushing = asyncio.create_task(publisher.run())
    try:
        await until(lambda: _true(len(first._chain.relays) == 2), 10)
        members = remote(MembershipApi, clients[1])
        weights_at = {"weights": "tcp://127.0.0.1:1"}
        churn = JoinRequest(instance="relay-x", role="relay", address="tcp://127.0.0.1:1",
                            endpoints=weights_at)  # fmt: skip
        for _ in range(3):  # churn: the first manager's epoch runs ahead of the second's
            await members.join.call(churn)
            await members.leave.call(LeaveRequest(instance="relay-x"))
        await until(lambda: _true(publisher.view.epoch == first._chain.epoch == 8), 10)
        master = first._chain.relays[0].instance  # the trainer pushes here
        survivor = next(n for n in relays if n != master)

        second = await manager.restart()
        await until(lambda: _true(len(second._chain.relays) == 2), 10)  # both rejoined
        relays[master][0].stop()  # the master dies under the new manager (epoch 3 < 8)
        await until(lambda: _true([r.instance for r in second._chain.relays] == [survivor]), 10)

        await publisher.hand_off(publisher.stage(1, weights(1)))
        relay = relays[survivor][0].ctx.connect(RelayApi, relays[survivor][0].ctx.address)

        async def delivered() -> bool:
            shared = await relay.latest.call(LatestRequest())
            return shared.available and shared.version == 1

        await until(delivered, 15, interval=0.05)
        assert publisher.view.incarnation == second.incarnation
        assert publisher.acked == 1
    finally:
        pushing.cancel()
        await asyncio.gather(pushing, return_exceptions=True)
        for client in clients:
            await client.close()


async def _true(value: bool) -> bool:
    return value


class ManualRollout:
    """A rollout's membership done by hand, so the test decides when it rejoins a new manager."""

    def __init__(self, name: str, address: str, options) -> None:  # type: ignore[no-untyped-def]
        self.name = name
        self.client = RpcClient(address, options, timeout=1.0)
        self.api = remote(MembershipApi, self.client)
        self.may_rejoin = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def join_request(self) -> JoinRequest:
        return JoinRequest(instance=self.name, role="rollout", address="tcp://127.0.0.1:1")

    async def start(self) -> None:
        await self.api.join.call(self.join_request())
        self.task = asyncio.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(PeerUnavailable, CallTimeout, RemoteError):
                ack = await self.api.heartbeat.call(Heartbeat(instance=self.name))
                if ack.rejoin and self.may_rejoin.is_set():
                    await self.api.join.call(self.join_request())
            await asyncio.sleep(0.1)

    async def die(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.client.close()


async def test_manager_restart_keeps_the_leases_of_live_rollouts(
    serve, manager: Manager, options, tmp_path: Path
):
    await manager.start()
    cfg = DataConfig(
        bind="tcp://127.0.0.1:0",
        metrics=None,
        prompts=str(write_prompts(tmp_path / "prompts.jsonl", 8)),
        tokenizer=str(write_tokenizer(tmp_path / "tok")),
        reward="tests.support.task:reward_len",
        store=str(tmp_path / "data.sqlite"),
    )
    data_host, _ = await serve(DataService, instance="data-0", manager=manager.address, config=cfg)
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    live, dies = (ManualRollout(n, manager.address, options) for n in ("rollout-a", "rollout-b"))
    try:
        for rollout in (live, dies):
            await rollout.start()
            taken = await data.take.call(TakeRequest(rollout=rollout.name, max_count=3, version=0))
            assert len(taken.items) == 3

        second = await manager.restart()
        await dies.die()  # died while the manager was down: it will never rejoin
        # The data role is back on the new manager's membership stream, and the live rollout
        # has not rejoined yet (it does so only now, as if its heartbeats were slow).
        await until(lambda: _true(bool(second._watchers)), 15)
        live.may_rejoin.set()

        async def released() -> tuple[dict[str, int]] | None:
            leases = (await data.status.call()).leases
            return (leases,) if dies.name not in leases else None  # truthy even when empty

        (leases,) = await until(released, 15, interval=0.05)
        assert leases.get(live.name) == 3, leases  # kept: it rejoined within the settling time
        assert second.members[live.name].state == "alive"
    finally:
        await live.die()
        await dies.die()
