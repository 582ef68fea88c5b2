"""A rollout's migration endpoints against its phase: a real service, a sim engine, one loop.

A destination that is loading a newer version must refuse migrated trajectories: its engine's
version is about to change, and a sequence imported then would finish on weights it did not start
on (a trajectory never mixes versions). Before the phase machine, ``accept`` checked only the
version number, which a load in progress has not bumped yet.
"""

from __future__ import annotations

from laminar.engines import InflightSequence, SimEngineConfig
from laminar.engines.costmodel import CostModel
from laminar.roles.rollout import (
    Handoff,
    MigratedSequence,
    MigrateRequest,
    RolloutApi,
    RolloutConfig,
    RolloutService,
)
from laminar.roles.rollout.state import Phase
from laminar.trajectory import Assignment, SamplingParams

FAST = CostModel(batch_points=[(1, 0.001), (256, 0.002)], prefill_s_per_token=0.0)


def handoff(version: int) -> Handoff:
    params = SamplingParams(max_tokens=10_000)  # still running when the test looks
    a = Assignment(
        trajectory_id="p0/0",
        prompt_id="p0",
        sample_index=0,
        prompt_token_ids=[1, 2, 3],
        params=params,
        queued_at=0.0,
    )
    seq = InflightSequence(
        request_id="p0/0",
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        response_logprobs=[-0.5, -0.25],
        params=params,
        version=version,
    )
    m = MigratedSequence(assignment=a, version=version, started_at=0.0, acked=1, sequence=seq)
    return Handoff(source="rollout-x", version=version, sequences=[m])


async def test_a_rollout_loading_weights_refuses_migrated_trajectories(serve):
    config = RolloutConfig(
        metrics=None,
        engine=SimEngineConfig(cost=FAST),
        data="tcp://127.0.0.1:9",  # nobody: it takes no prompts, so its flight table stays ours
        take_wait_s=0.1,
    )
    host, svc = await serve(RolloutService, config=config)
    rollout = host.ctx.connect(RolloutApi, host.ctx.address)
    version = svc.engine.version
    svc.phases.newer_version()
    svc.phases.load(len(svc.flights))  # what the weight switcher does once drained

    reply = await rollout.accept.call(handoff(version))
    assert reply.accepted == [] and reply.refused == "not accepting: loading"
    assert "p0/0" not in svc.flights and svc.engine.stats().running == 0

    # and a migration out cannot start mid-load either (nor leave the flag set)
    report = await rollout.migrate.call(
        MigrateRequest(destination="rollout-x", address="tcp://127.0.0.1:9", version=version)
    )
    assert report.error == "loading a newer version" and not svc.phases.migrating

    svc.phases.switched()  # loaded (here: the same version): it accepts again
    assert svc.phases.phase is Phase.GENERATING
    reply = await rollout.accept.call(handoff(version))
    assert reply.accepted == ["p0/0"] and reply.refused == ""
    flight = svc.flights["p0/0"]
    assert flight.tokens[:2] == [4, 5] and flight.acked == 1
