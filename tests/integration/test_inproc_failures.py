"""Failure isolation on the in-process cluster (``laminar/harness/inproc.py``): a killed rollout's
trajectories continue elsewhere, and a killed data role restarts losing nothing.

The process-level ground truth for the data role is ``test_generation_processes.py`` (a real
``kill -9``, real SQLite durability across processes); these run the same checks in one event
loop on virtual time, where the kill lands at the same point of the run every time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from laminar.harness.inproc import inproc_cluster, run_inproc
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout import RolloutApi
from laminar.roles.rollout.api import DrainRequest
from laminar.trajectory import Trajectory

from ..support.poll import until
from ..support.task import write_prompts, write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def sections(tmp: Path, prompts: int, samples: int, concurrency: int) -> dict[str, Any]:
    return {
        "data": {
            "prompts": str(write_prompts(tmp / "prompts.jsonl", prompts)),
            "tokenizer": str(write_tokenizer(tmp / "tok")),
            "reward": "tests.support.task:reward_len",
            "samples_per_prompt": samples,
            "store": str(tmp / "data.sqlite"),
        },
        "rollout": {
            "concurrency": concurrency,
            "flush_interval_s": 0.1,
            "engine": {
                "backend": "sim",
                "lengths": {"kind": "longtail", "median": 60, "max_length": 600},
                "cost": {"batch_points": [[1, 0.004], [256, 0.008]], "prefill_s_per_token": 0},
            },
        },
    }


def outcome(trajectories: list[Trajectory]) -> list[tuple]:
    return sorted(
        (t.trajectory_id, t.rollout, t.version, len(t.response_token_ids), t.finished_at)
        for t in trajectories
    )


async def _finished(data: DataApi):  # type: ignore[no-untyped-def]
    status = await data.status.call()
    return status if status.finished else None


async def rollout_kill_scenario(tmp: Path, seed: int) -> list[tuple]:
    total = 24 * 4
    members = [("data", "data"), ("rollout", "rollout-0"), ("rollout", "rollout-1")]
    async with inproc_cluster(sections(tmp, 24, 4, 8), seed=seed, members=members) as cluster:
        data = cluster.proxy(DataApi, "data")
        victim = cluster.service("rollout-1")

        async def holding_acked_tokens() -> bool:
            return sum(1 for f in victim.flights.values() if f.acked) >= 4

        await until(holding_acked_tokens, timeout=30, interval=0.01)
        held = {tid: f.acked for tid, f in victim.flights.items() if f.acked}
        await cluster.kill("rollout-1")

        status = await until(lambda: _finished(data), timeout=120)
        assert status.trajectories == total and status.failed == 0, status
        done = (await data.sample.call(SampleRequest(n=total))).items
        by_id = {t.trajectory_id: t for t in done}
        assert len(by_id) == total
        resumed = [tid for tid in held if by_id[tid].rollout == "rollout-0"]
        assert resumed, "none of the killed rollout's trajectories continued elsewhere"
        for tid in resumed:  # the acknowledged prefix was kept, not generated again
            assert len(by_id[tid].response_token_ids) >= held[tid], tid
        assert all(t.version == 0 for t in done)
        return outcome(done)


def test_a_killed_rollouts_trajectories_continue_elsewhere(tmp_path: Path) -> None:
    run_inproc(lambda: rollout_kill_scenario(tmp_path, seed=0), seed=0)


async def data_kill_scenario(tmp: Path, seed: int) -> list[tuple]:
    """``tests/support/scenario.kill_data_midway``'s checks: no completed trajectory and no
    acknowledged partial token is lost by a kill of the data role."""
    total, kill_after = 48 * 4, 60
    members = [("data", "data"), ("rollout", "rollout-0"), ("rollout", "rollout-1")]
    async with inproc_cluster(sections(tmp, 48, 4, 16), seed=seed, members=members) as cluster:
        data = cluster.proxy(DataApi, "data")

        async def enough_done() -> bool:
            return (await data.status.call()).trajectories >= kill_after

        await until(enough_done, timeout=60)
        # The kill comes right after the snapshot: whatever was acknowledged by then must survive.
        done_before = set((await data.completed_ids.call()).ids)
        partial_before = (await data.partial_lengths.call()).lengths
        await cluster.kill("data")
        assert partial_before, "the kill should hit trajectories in flight"

        await cluster.restart("data")
        data = cluster.proxy(DataApi, "data")
        lost = done_before - set((await data.completed_ids.call()).ids)
        assert not lost, f"completed trajectories lost by the kill: {sorted(lost)[:5]}"
        status = await until(lambda: _finished(data), timeout=120)
        assert status.trajectories == total, status
        ids = (await data.completed_ids.call()).ids
        assert len(ids) == len(set(ids)) == total
        done = (await data.sample.call(SampleRequest(n=total))).items
        by_id = {t.trajectory_id: t for t in done}
        for tid, n in partial_before.items():  # acknowledged tokens were kept (resumed)
            assert len(by_id[tid].response_token_ids) >= n, (tid, n)
        assert {t.rollout for t in done} == {"rollout-0", "rollout-1"}
        for t in done:
            assert t.version == 0 and t.reward is not None
            assert len(t.logprobs) == len(t.response_token_ids) > 0
        return outcome(done)


def test_a_killed_data_role_restarts_losing_nothing(tmp_path: Path) -> None:
    run_inproc(lambda: data_kill_scenario(tmp_path, seed=0), seed=0)


async def drained_before_the_data_role_scenario(tmp: Path, seed: int) -> None:
    """A rollout drained while it waits for the data role to appear takes nothing when it does.

    Its pull loop was already waiting to find the data role when the drain came; it used to send
    the take it had prepared before the drain (and before any version change) once the data role
    joined, and generated a whole batch while drained."""
    members = [("rollout", "rollout-0"), ("rollout", "rollout-1")]
    async with inproc_cluster(sections(tmp, 4, 2, 8), seed=seed, members=members) as cluster:
        drained = cluster.proxy(RolloutApi, "rollout-1")
        await asyncio.sleep(1.0)  # virtual time: both rollouts are waiting for a data role
        await drained.drain.call(DrainRequest(reason="test"))
        await cluster.start("data", "data")
        data = cluster.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=60)
        done = (await data.sample.call(SampleRequest(n=status.trajectories))).items
        assert {t.rollout for t in done} == {"rollout-0"}
        assert (await drained.state.call()).in_flight == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_rollout_drained_before_the_data_role_joins_takes_nothing(
    tmp_path: Path, seed: int
) -> None:
    run_inproc(lambda: drained_before_the_data_role_scenario(tmp_path, seed=seed), seed=seed)
