"""A version through a chain of 4 relays on the in-process cluster, and a killed middle relay.

The checks of ``test_relay_chain.py`` (which stays as the ground truth: real processes, a real
``kill -9``, 256 MiB over TCP, the dead relay's segments swept by its pid), in one event loop on
virtual time: the kill lands while version 2 is part-way through the victim, at the same point
of every run, so the weights can be small.
"""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import pytest

from laminar.harness.inproc import InprocCluster, inproc_cluster, run_inproc
from laminar.roles.manager.api import ChainView, RelayChainApi
from laminar.roles.relay.api import LatestRequest, RelayApi, RelayStatus
from laminar.roles.trainer.publisher import WeightPublisher
from laminar.runtime.clock import get_clock
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.transport.shm import map_segment
from laminar.weights.config import PublishConfig
from laminar.weights.manifest import WeightManifest

from ..support.poll import until
from .test_relay_chain import verified, weights

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NAMES = [f"relay-{i}" for i in range(4)]


async def statuses(cluster: InprocCluster, names: list[str]) -> dict[str, RelayStatus]:
    return {n: await cluster.proxy(RelayApi, n).status.call() for n in names}


async def check_bytes(cluster: InprocCluster, name: str, expected: WeightManifest) -> None:
    """The relay's manifest is the trainer's, and the bytes in its segment match every CRC."""
    shared = await cluster.proxy(RelayApi, name).latest.call(LatestRequest())
    assert shared.available and shared.manifest == expected, name
    view = map_segment(shared.segment, 0, expected.total_bytes)
    for t in expected.tensors:
        assert zlib.crc32(view[t.offset : t.offset + t.nbytes]) == t.crc32, (name, t.name)


async def chain_scenario(seed: int) -> tuple:
    sections = {"relay": {"keep": 2}}
    members = [("relay", name) for name in NAMES]
    async with inproc_cluster(sections, seed=seed, members=members) as cluster:
        assert cluster.manager is not None
        manager = RpcClient(cluster.manager, cluster.options, timeout=10.0)
        publisher = WeightPublisher(
            PublishConfig(chunks=128),
            cluster.options,
            manager=manager,
            executor=cluster.loop.executor("publish", 1),
        )
        pushing = asyncio.create_task(publisher.run())
        try:

            async def whole_chain() -> ChainView | None:
                view = await remote(RelayChainApi, manager).chain.call()
                return view if len(view.relays) == 4 else None

            order = [r.instance for r in (await until(whole_chain, 10)).relays]

            async def all_verified(version: int, among: list[str]) -> bool:
                return all(verified(s, version) for s in (await statuses(cluster, among)).values())

            # 1. a clean broadcast: every relay holds the trainer's bytes
            v1 = publisher.stage(1, weights(seed, total_mib=8))
            await publisher.hand_off(v1)
            await until(lambda: all_verified(1, NAMES), 60, 0.1)
            for name in NAMES:
                await check_bytes(cluster, name, v1.manifest)

            # 2. kill the middle relay while version 2 is on its way through it
            victim = order[1]
            v2 = publisher.stage(2, weights(seed + 1, total_mib=8))
            await publisher.hand_off(v2)
            store = cluster.service(victim).store
            async with asyncio.timeout(60):
                while (v := store.versions.get(2)) is None or v.received == 0:  # noqa: ASYNC110
                    await asyncio.sleep(0)  # the transfer moves in zero virtual time
            assert not v.verified, "the broadcast finished before the kill"
            received_at_kill = v.received
            epoch_before = (await remote(RelayChainApi, manager).chain.call()).epoch
            killed_at = get_clock().wall()  # virtual: the same in every run
            await cluster.kill(victim)
            survivors = [n for n in order if n != victim]

            async def rebuilt() -> dict[str, RelayStatus] | None:
                states = await statuses(cluster, survivors)
                return (
                    states if all(s.chain_epoch > epoch_before for s in states.values()) else None
                )

            states = await until(rebuilt, 10, 0.02)
            rebuild_s = max(s.chain_applied_at for s in states.values()) - killed_at
            view = await remote(RelayChainApi, manager).chain.call()
            assert [r.instance for r in view.relays] == survivors
            assert states[order[0]].downstream == order[2]  # the dead relay is routed around
            await until(lambda: all_verified(2, survivors), 60, 0.1)
            for name in survivors:
                await check_bytes(cluster, name, v2.manifest)
            # routed around on the lost connection, not after a heartbeat timeout (2 s)
            assert rebuild_s < 1.0, f"chain rebuild took {rebuild_s:.3f} s"
            return (tuple(order), victim, received_at_kill, rebuild_s, view.epoch)
        finally:
            pushing.cancel()
            await asyncio.gather(pushing, return_exceptions=True)
            await manager.close()


def test_chain_delivers_and_heals_around_a_killed_relay(tmp_path: Path) -> None:
    run_inproc(lambda: chain_scenario(seed=1), seed=1)
