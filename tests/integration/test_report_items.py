"""A report is judged item by item: one bad item is refused alone, never the whole report.

Before, one bad item (a gap in a trajectory's tokens, a completion of an unknown trajectory)
failed the whole report, and the rollout sent the same report again every flush interval,
forever, while nothing else it generated was stored.
"""

from __future__ import annotations

from pathlib import Path

from laminar.engines import SimEngineConfig
from laminar.engines.costmodel import CostModel
from laminar.roles.data.api import DataApi, FailedItem, Report, TakeRequest
from laminar.roles.data.service import DataConfig, DataService
from laminar.roles.rollout import RolloutConfig, RolloutService
from laminar.trajectory import PartialChunk, Trajectory
from tests.support.poll import until
from tests.support.task import write_prompts, write_tokenizer

FAST = CostModel(batch_points=[(1, 0.001), (256, 0.002)], prefill_s_per_token=0.0)


def data_config(tmp_path: Path, n: int) -> DataConfig:
    return DataConfig(
        metrics=None,
        prompts=str(write_prompts(tmp_path / "prompts.jsonl", n)),
        tokenizer=str(write_tokenizer(tmp_path / "tok")),
        reward="tests.support.task:reward_len",
        store=str(tmp_path / "data.sqlite"),
        samples_per_prompt=1,
    )


def traj(tid: str, logprob: float = -0.5) -> Trajectory:
    prompt_id, _, k = tid.rpartition("/")
    return Trajectory(
        trajectory_id=tid,
        prompt_id=prompt_id,
        sample_index=int(k),
        prompt_token_ids=[1],
        response_token_ids=[3, 4],
        logprobs=[-0.5, logprob],
        version=0,
        finish_reason="stop",
        queued_at=0.0,
        started_at=1.0,
        finished_at=2.0,
    )


def rejected_count(svc: DataService, item: str) -> float:
    return (
        svc.ctx.registry.get_sample_value(
            "laminar_data_report_items_rejected_total", {"item": item}
        )
        or 0.0
    )


async def test_bad_items_are_refused_alone_and_the_rest_is_stored(serve, tmp_path):
    # standalone: no manager, so no membership says that rollout "r" is not alive
    host, svc = await serve(DataService, config=data_config(tmp_path, 5))
    data = host.ctx.connect(DataApi, host.ctx.address)
    lease = (await data.take.call(TakeRequest(rollout="r", max_count=5, version=0))).items
    t = [a.trajectory_id for a in lease]
    report = Report(
        rollout="r",
        partials=[
            PartialChunk(trajectory_id=t[0], version=0, offset=0, token_ids=[5], logprobs=[-1]),
            PartialChunk(trajectory_id=t[1], version=0, offset=7, token_ids=[5], logprobs=[-1]),
        ],
        completed=[traj(t[2]), traj(t[3], logprob=float("nan")), traj("nope/0")],
        failed=[
            FailedItem(trajectory_id=t[4], reason="the prompt is too long"),
            FailedItem(trajectory_id="ghost/0", reason="x"),
        ],
    )
    for _ in range(2):  # a repeat changes nothing
        reply = await data.report.call(report)
        refused = {(r.trajectory_id, r.item) for r in reply.rejected}
        assert refused == {
            (t[1], "partial"),
            (t[3], "completed"),
            ("nope/0", "completed"),
            ("ghost/0", "failed"),
        }
    reasons = {r.trajectory_id: r.reason for r in reply.rejected}
    assert "gap" in reasons[t[1]] and "logprob of response token 1 is nan" in reasons[t[3]]
    assert "unknown trajectory" in reasons["nope/0"] and "unknown" in reasons["ghost/0"]
    # the good items were stored
    assert (await data.partial_lengths.call()).lengths == {t[0]: 1}
    assert (await data.completed_ids.call()).ids == [t[2]]
    status = await data.status.call()
    assert (status.failed, status.done, status.leased) == (2, 1, 2)  # t3 invalid, t4 refused
    assert sorted(kind for _, kind, _ in svc.store.failures()) == ["invalid", "refused"]
    assert rejected_count(svc, "completed") == 4 and rejected_count(svc, "partial") == 2


async def test_a_rollout_drops_refused_items_and_never_sends_them_again(serve, tmp_path):
    data_host, data_svc = await serve(DataService, config=data_config(tmp_path, 3))
    engine = SimEngineConfig(cost=FAST, lengths={"kind": "fixed", "value": 400})
    # flushes are driven by the test (one report at a time), not by the rollout's own timer
    _, svc = await serve(
        RolloutService,
        config=RolloutConfig(
            metrics=None,
            engine=engine,
            concurrency=2,
            flush_interval_s=3600,
            take_wait_s=0.2,
            data=data_host.ctx.address,
        ),
    )
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    svc.finished["nope/0"] = traj("nope/0")  # a completion the data role never queued

    async def acked():
        await svc._flush()
        return next((f for f in svc.flights.values() if 0 < f.acked < 300), None)

    flight = await until(acked, timeout=10)
    assert "nope/0" not in svc.finished  # refused once, dropped for good
    tid = flight.assignment.trajectory_id
    flight.acked += 2  # its next chunk skips two tokens the data role never got: a gap

    async def dropped():
        await svc._flush()
        return tid not in svc.flights or svc.flights[tid] is not flight

    await until(dropped, timeout=10)

    async def finished():
        await svc._flush()
        return (await data.status.call()).finished

    await until(finished, timeout=30)  # the dropped one came back (a resume) and finished
    assert sorted((await data.completed_ids.call()).ids) == ["p0/0", "p1/0", "p2/0"]
    assert rejected_count(data_svc, "completed") == 1 and rejected_count(data_svc, "partial") == 1
    assert not svc.finished and not svc.failed
