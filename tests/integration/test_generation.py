"""Prompts become scored, versioned trajectories: manager + data + rollouts (sim engines).

In-process services over TCP with the real clock and fast cost models; the process-level test
with kill -9 and vLLM is scenario 2 of ``tests/slow/test_vllm_cluster.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from laminar.engines import SimEngineConfig
from laminar.engines.costmodel import CostModel
from laminar.engines.lengths import LongtailLength
from laminar.roles.data.api import DataApi, Report, SampleRequest, TakeRequest
from laminar.roles.data.service import DataConfig, DataService
from laminar.roles.data.store import Store
from laminar.roles.manager import ManagerConfig, ManagerService
from laminar.roles.rollout import RolloutConfig, RolloutService
from laminar.runtime.config import ClusterConfig
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.trajectory import PartialChunk
from tests.support.task import write_prompts, write_tokenizer


@pytest.fixture
def cluster() -> ClusterConfig:
    """A heartbeat timeout a loaded machine does not trip: these roles share one real-time event
    loop with the test, and the suite's vLLM starts stalled it past 0.7 s; every member was then
    declared dead at once, and a trajectory released twice that way was quarantined as poison.
    No test here needs a death noticed: the roles they stop, stop gracefully."""
    return ClusterConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0, rpc_timeout_s=5.0)


FAST = CostModel(batch_points=[(1, 0.001), (256, 0.002)], prefill_s_per_token=0.0)


def data_config(tmp_path: Path, n: int, reward: str = "tests.support.task:reward_len", **kw):
    return DataConfig(
        bind="tcp://127.0.0.1:0",
        metrics=None,
        prompts=str(write_prompts(tmp_path / "prompts.jsonl", n)),
        tokenizer=str(write_tokenizer(tmp_path / "tok")),
        reward=reward,
        store=str(tmp_path / "data.sqlite"),
        **kw,
    )


def rollout_config(seed: int, concurrency: int = 8) -> RolloutConfig:
    return RolloutConfig(
        bind="tcp://127.0.0.1:0",
        metrics=None,
        engine=SimEngineConfig(
            seed=seed, lengths=LongtailLength(median=20, max_length=200), cost=FAST
        ),
        concurrency=concurrency,
        flush_interval_s=0.05,
        take_wait_s=0.5,
    )


async def wait_finished(data: DataApi, timeout: float = 30.0):
    async with asyncio.timeout(timeout):
        while True:
            status = await data.status.call()
            if status.finished:
                return status
            await asyncio.sleep(0.1)


async def start_cluster(serve, tmp_path, n_prompts, rollouts=2, **data_kw):
    mgr_host, _ = await serve(
        ManagerService,
        config=ManagerConfig(bind="tcp://127.0.0.1:0", metrics=None, admin="127.0.0.1:0"),
    )
    manager = mgr_host.ctx.address
    data_host, data_svc = await serve(
        DataService,
        instance="data-0",
        manager=manager,
        config=data_config(tmp_path, n_prompts, **data_kw),
    )
    outs = []
    for i in range(rollouts):
        outs.append(
            await serve(
                RolloutService, instance=f"rollout-{i}", manager=manager, config=rollout_config(i)
            )
        )
    return manager, data_host, data_svc, outs


async def test_every_trajectory_arrives_once_scored_with_version_and_logprobs(serve, tmp_path):
    _, data_host, _, _ = await start_cluster(serve, tmp_path, 16, samples_per_prompt=4)
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    status = await wait_finished(data)
    assert status.trajectories == 64 and status.scored == 64 and status.reward_errors == 0
    ids = (await data.completed_ids.call()).ids
    assert sorted(ids) == sorted(f"p{i}/{k}" for i in range(16) for k in range(4))
    trajectories = (await data.sample.call(SampleRequest(n=64))).items
    assert len(trajectories) == 64
    for t in trajectories:
        assert t.version == 0
        assert len(t.logprobs) == len(t.response_token_ids) > 0
        assert all(lp < 0 for lp in t.logprobs)
        assert t.reward is not None and t.reward_error is None
        assert t.queued_at <= t.started_at <= t.finished_at
        assert t.rollout in ("rollout-0", "rollout-1")
    assert {t.rollout for t in trajectories} == {"rollout-0", "rollout-1"}
    # consumed trajectories are not handed out twice
    assert (await data.sample.call(SampleRequest(n=1))).items == []


async def test_reward_that_raises_or_hangs_is_recorded_not_fatal(serve, tmp_path):
    _, data_host, _, _ = await start_cluster(
        serve,
        tmp_path,
        8,
        samples_per_prompt=2,
        reward="tests.support.task:reward_flaky",
        reward_workers=2,
        reward_timeout_s=1.0,
    )
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    status = await wait_finished(data)
    assert status.trajectories == 16 and status.scored == 16
    got = {t.trajectory_id: t for t in (await data.sample.call(SampleRequest(n=16))).items}
    for k in range(2):
        assert got[f"p1/{k}"].reward is None
        assert got[f"p1/{k}"].reward_error == "timed out after 1.0s"
        for i in (0, 2, 4, 6):  # answer % 4 == 0 raises
            assert got[f"p{i}/{k}"].reward is None
            assert got[f"p{i}/{k}"].reward_error.startswith("raised ValueError: cannot score")
        for i in (3, 5, 7):
            assert got[f"p{i}/{k}"].reward == 1.0
    assert status.reward_errors == 10


async def test_a_dead_rollouts_trajectories_resume_elsewhere(serve, tmp_path):
    _, data_host, _, rollouts = await start_cluster(serve, tmp_path, 24, samples_per_prompt=4)
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    victim_host, victim = rollouts[1]
    async with asyncio.timeout(10):  # let it hold acknowledged partial tokens
        while not any(f.acked for f in victim.flights.values()):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    held = {tid: f.acked for tid, f in victim.flights.items() if f.acked}
    victim_host.stop()
    status = await wait_finished(data)
    assert status.trajectories == 96
    trajectories = {t.trajectory_id: t for t in (await data.sample.call(SampleRequest(n=96))).items}
    assert len(trajectories) == 96
    for tid, acked in held.items():
        t = trajectories[tid]
        if t.rollout == "rollout-0":  # resumed there: the acknowledged prefix was kept
            assert len(t.response_token_ids) >= acked


async def test_data_role_restart_keeps_completed_and_partials(serve, tmp_path, cluster, options):
    _, data_host, _, _ = await start_cluster(serve, tmp_path, 32, samples_per_prompt=4)
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    async with asyncio.timeout(10):
        while (await data.status.call()).trajectories < 20:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    done_before = set((await data.completed_ids.call()).ids)
    partial_before = (await data.partial_lengths.call()).lengths
    address = data_host.ctx.address
    data_host.stop()
    await asyncio.sleep(0.5)  # rollouts keep generating; their reports fail and pile up
    config = data_host.ctx.config.model_copy(update={"bind": address})
    # The old port was an ephemeral one: meanwhile a connection of this machine may have taken
    # it as its source port (a CI run saw EADDRINUSE). A restarted data role would wait for it
    # under a supervisor too; here, try again for a few seconds.
    for attempt in range(20):
        try:
            host2, _ = await serve(
                DataService, instance="data-0", manager=data_host.manager, config=config
            )
            break
        except Exception as exc:  # an ExceptionGroup from the host's task group
            if "address already in use" not in repr(exc) or attempt == 19:
                raise
            await asyncio.sleep(0.25)
    data2 = host2.ctx.connect(DataApi, host2.ctx.address)
    assert done_before <= set((await data2.completed_ids.call()).ids)
    status = await wait_finished(data2)
    assert status.trajectories == 128
    after = {t.trajectory_id: t for t in (await data2.sample.call(SampleRequest(n=128))).items}
    assert len(after) == 128
    for tid, n in partial_before.items():
        assert len(after[tid].response_token_ids) >= n


async def test_repeated_reports_are_idempotent(serve, tmp_path):
    # standalone: no manager, so no membership says that rollout "r" is not alive
    config = data_config(tmp_path, 2, samples_per_prompt=1)
    data_host, _ = await serve(DataService, config=config)
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    lease = (await data.take.call(TakeRequest(rollout="r", max_count=2, version=3))).items
    assert [a.trajectory_id for a in lease] == ["p0/0", "p1/0"] or len(lease) == 2
    tid = lease[0].trajectory_id
    chunk = PartialChunk(
        trajectory_id=tid, version=3, offset=0, token_ids=[5, 6], logprobs=[-1.0, -2.0]
    )
    longer = PartialChunk(
        trajectory_id=tid, version=3, offset=0, token_ids=[5, 6, 7], logprobs=[-1.0, -2.0, -3.0]
    )
    for c in (chunk, chunk, longer):  # a retry, then a retry that grew meanwhile
        await data.report.call(Report(rollout="r", partials=[c]))
    assert (await data.partial_lengths.call()).lengths == {tid: 3}
    # a lost take reply: asking again without holding it re-delivers the same lease, with tokens
    again = (await data.take.call(TakeRequest(rollout="r", max_count=1, version=3))).items
    assert again[0].trajectory_id == tid and again[0].resume_token_ids == [5, 6, 7]
    # another rollout's report for a lease it does not hold is refused (drop)
    reply = await data.report.call(Report(rollout="other", partials=[chunk]))
    assert reply.drop == [tid]


async def test_a_report_whose_sender_left_meanwhile_is_scored(serve, tmp_path, monkeypatch):
    """A rollout that stops right after sending its last report closes its connection while the
    data role stores that report, and the server cancels the call's handler (its task belongs to
    the connection). The store's write commits on its thread anyway; the trajectories it stored
    as done must still be queued for their rewards. They were not: the run waited for ever for
    a trajectory done and never scored (``test_a_dead_rollouts_trajectories_resume_elsewhere``
    timed out in about 1 run in 10 on a loaded machine)."""
    stored = threading.Event()
    complete = Store.complete

    def slow_complete(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = complete(self, *args, **kwargs)
        stored.set()
        time.sleep(0.5)  # committed; the sender leaves before the handler hears back
        return out

    monkeypatch.setattr(Store, "complete", slow_complete)
    data_host, _ = await serve(DataService, config=data_config(tmp_path, 1, samples_per_prompt=2))
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    lease = (await data.take.call(TakeRequest(rollout="r", max_count=2, version=0))).items
    from tests.integration.test_data_sample import finished  # it imports this module

    done = [finished(a, version=0) for a in lease]
    sender = RpcClient(data_host.ctx.address, data_host.ctx.options, timeout=10)
    call = asyncio.ensure_future(
        remote(DataApi, sender).report.call(Report(rollout="r", completed=done))
    )
    await asyncio.to_thread(stored.wait, 10)
    await sender.close()  # the rollout is gone
    await asyncio.gather(call, return_exceptions=True)
    async with asyncio.timeout(10):
        while (status := await data.status.call()).scored < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert status.trajectories == 2 and status.finished
