"""The trainer's ``sample`` endpoint: consume cursor, whole groups and the staleness bound.

One standalone data role (in process, over TCP); the test plays the rollout (``take`` +
``report``) and the trainer (``sample``), so which trajectories exist, and their versions, are
known exactly.
"""

from __future__ import annotations

import asyncio

import pytest

from laminar.roles.data.api import DataApi, Report, SampleRequest, TakeRequest
from laminar.roles.data.service import DataService, StalenessConfig
from laminar.runtime.errors import RemoteError
from laminar.trajectory import Trajectory
from tests.integration.test_generation import data_config


def finished(assignment, version: int) -> Trajectory:
    return Trajectory(
        trajectory_id=assignment.trajectory_id,
        prompt_id=assignment.prompt_id,
        sample_index=assignment.sample_index,
        prompt_token_ids=assignment.prompt_token_ids,
        response_token_ids=[3, 4, 5],
        logprobs=[-0.5] * 3,
        version=version,
        finish_reason="stop",
        queued_at=assignment.queued_at,
        started_at=assignment.queued_at,
        finished_at=assignment.queued_at,
    )


async def start(serve, tmp_path, prompts: int, **kw) -> tuple[DataApi, list]:
    data_host, _ = await serve(DataService, config=data_config(tmp_path, prompts, **kw))
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    n = prompts * kw.get("samples_per_prompt", 4)
    lease = (await data.take.call(TakeRequest(rollout="r", max_count=n, version=0))).items
    assert len(lease) == n
    return data, lease


async def report(data: DataApi, assignments, version: int = 0) -> None:
    await data.report.call(
        Report(rollout="r", completed=[finished(a, version) for a in assignments])
    )


async def wait_scored(data: DataApi, scored: int) -> None:
    async with asyncio.timeout(20):
        while (await data.status.call()).scored < scored:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_a_restarted_trainer_resumes_from_its_cursor_with_whole_groups(serve, tmp_path):
    data, lease = await start(serve, tmp_path, 3, samples_per_prompt=2)
    groups = [lease[i : i + 2] for i in range(0, 6, 2)]
    await report(data, [groups[0][0], groups[1][0], groups[1][1]])  # group 1 completes first
    await wait_scored(data, 3)
    with pytest.raises(RemoteError, match="multiple of samples_per_prompt"):
        await data.sample.call(SampleRequest(n=3, whole_groups=True))
    got = await data.sample.call(SampleRequest(n=4, whole_groups=True))
    assert [t.trajectory_id for t in got.items] == [a.trajectory_id for a in groups[1]]
    assert got.seqs == [1, 2] and got.cursor == 2 and got.redelivered == 0
    # every trajectory scored since the last sample is reported, taken or not (same text: same r)
    r = got.items[0].reward
    assert got.scored == 3 and got.scored_reward_sum == pytest.approx(3 * r)

    # a trainer waiting for two groups gets them once they complete (and are scored)
    waiting = asyncio.ensure_future(
        data.sample.call(SampleRequest(n=4, whole_groups=True, wait_s=20))
    )
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await report(data, [groups[0][1], *groups[2]])
    lost = await waiting
    assert [t.trajectory_id for t in lost.items] == [a.trajectory_id for a in groups[0] + groups[2]]
    assert lost.seqs == [3, 4, 5, 6] and lost.cursor == 6 and lost.scored == 3

    # the trainer crashed after committing cursor 2: it gets exactly what it had not committed
    again = await data.sample.call(SampleRequest(n=4, after=got.cursor, whole_groups=True))
    assert [t.trajectory_id for t in again.items] == [t.trajectory_id for t in lost.items]
    assert again.seqs == lost.seqs and again.redelivered == 4 and again.scored == 0
    empty = await data.sample.call(SampleRequest(n=2, after=again.cursor))
    assert empty.items == [] and empty.cursor == 6
    status = await data.status.call()
    assert status.consumed == 6 and status.cursor == 6


@pytest.mark.parametrize("action", ["drop", "hold"])
async def test_the_staleness_bound_drops_or_holds(serve, tmp_path, action):
    staleness = StalenessConfig(bound=1, action=action)
    data, lease = await start(serve, tmp_path, 4, samples_per_prompt=1, staleness=staleness)
    for version, a in enumerate(lease):  # versions 0, 1, 2, 3
        await report(data, [a], version)
    await wait_scored(data, 4)
    got = await data.sample.call(SampleRequest(n=4, trainer_version=3))
    assert sorted(t.version for t in got.items) == [2, 3]
    status = await data.status.call()
    if action == "drop":
        assert status.stale_dropped == 2 and status.evicted == 2 and status.held == 0
    else:
        assert status.stale_dropped == 0 and status.evicted == 0 and status.held == 2
        older = await data.sample.call(SampleRequest(n=4, trainer_version=1))
        assert sorted(t.version for t in older.items) == [0, 1]
