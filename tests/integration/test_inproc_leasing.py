"""Leases held ahead of the engine (``rollout.lease_ahead``) on the in-process cluster: a rollout
keeps at most ``concurrency`` trajectories in its engine and ``lease_ahead`` more in hand, and a
drained rollout gives back the ones it has not started, which another rollout then generates,
also those that a take still waiting at the data role when the drain came brings back later."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from laminar.harness.inproc import inproc_cluster, run_inproc
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout import RolloutApi
from laminar.roles.rollout.api import DrainRequest

from ..support.poll import until
from .test_inproc_failures import _finished, sections

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def give_back_scenario(tmp: Path, seed: int) -> None:
    members = [("data", "data"), ("rollout", "rollout-0"), ("rollout", "rollout-1")]
    async with inproc_cluster(sections(tmp, 16, 2, 4), seed=seed, members=members) as cluster:
        data = cluster.proxy(DataApi, "data")
        drained = cluster.service("rollout-1")
        assert (drained.lease_ahead, drained.min_take) == (2, 1)  # the defaults for 4 slots
        most = {"rollout-0": (0, 0), "rollout-1": (0, 0)}
        watching = True

        async def watch() -> None:  # what each rollout holds, every step of virtual time
            while watching:
                for name in most:
                    svc = cluster.service(name)
                    held = (len(svc.flights), len(svc.ahead))
                    most[name] = tuple(map(max, most[name], held))  # type: ignore[assignment]
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())

        async def full() -> bool:
            return len(drained.ahead) == 2

        await until(full, timeout=30, interval=0.001)
        ahead = list(drained.ahead)
        await cluster.proxy(RolloutApi, "rollout-1").drain.call(DrainRequest(reason="test"))
        assert len(drained.ahead) == 0
        store = cluster.service("data").store
        for tid in ahead:  # back in the queue, or already leased to the other rollout
            state, holder, _ = store.holder(tid)
            assert (state, holder) in {("queued", None), ("leased", "rollout-0")}, (tid, state)

        status = await until(lambda: _finished(data), timeout=120)
        watching = False
        await watcher
        done = {t.trajectory_id: t for t in (await data.sample.call(SampleRequest(n=32))).items}
        assert status.trajectories == len(done) == 32
        assert all(done[tid].rollout == "rollout-0" for tid in ahead), ahead
        assert most["rollout-0"] == (4, 2), most  # never more than its slots and leases ahead
        assert most["rollout-1"][0] <= 4 and most["rollout-1"][1] <= 2, most


@pytest.mark.parametrize("seed", [0, 1])
def test_a_drained_rollout_gives_back_the_leases_it_has_not_started(
    tmp_path: Path, seed: int
) -> None:
    run_inproc(lambda: give_back_scenario(tmp_path, seed=seed), seed=seed)


async def take_in_flight_scenario(tmp: Path, seed: int) -> None:
    config = sections(tmp, 16, 2, 4)
    config["data"]["max_ahead"] = 8  # after 8 the pool is dry until some are taken
    members = [("data", "data"), ("rollout", "rollout-0")]
    async with inproc_cluster(config, seed=seed, members=members) as cluster:
        data = cluster.proxy(DataApi, "data")
        store = cluster.service("data").store
        rollout = cluster.service("rollout-0")

        async def waiting_take() -> bool:  # 8 done, and the next take waits at the data role
            return (await data.status.call()).scored == 8 and rollout._take_lock.locked()

        await until(waiting_take, timeout=60, interval=0.001)
        await cluster.proxy(RolloutApi, "rollout-0").drain.call(DrainRequest(reason="test"))
        first = (await data.sample.call(SampleRequest(n=8))).items  # room: the take is answered
        assert len(first) == 8

        async def nothing_leased() -> bool:
            return store.counts()["leased"] == 0 and not rollout._take_lock.locked()

        # the answer came to a drained rollout: it gave the leases back instead of holding them
        await until(nothing_leased, timeout=30, interval=0.001)
        assert len(rollout.ahead) == 0 and len(rollout.flights) == 0
        assert (await data.status.call()).scored == 8  # and started none

        await cluster.proxy(RolloutApi, "rollout-0").resume.call()
        rest = []
        while len(first) + len(rest) < 32:
            batch = await data.sample.call(SampleRequest(n=8, wait_s=30))
            assert batch.items, "the resumed rollout generates the rest"
            rest += batch.items
        ids = [t.trajectory_id for t in first + rest]
        assert len(ids) == len(set(ids)) == 32


@pytest.mark.parametrize("seed", [0, 1])
def test_a_drained_rollout_gives_back_what_a_take_in_flight_brings(
    tmp_path: Path, seed: int
) -> None:
    run_inproc(lambda: take_in_flight_scenario(tmp_path, seed=seed), seed=seed)
