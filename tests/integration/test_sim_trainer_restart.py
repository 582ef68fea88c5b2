"""A restarted sim trainer resumes from its ``state_file`` (version, cursor), as the torch trainer
resumes from its checkpoint: the data role re-delivers only what was taken and not yet trained,
so a kill of the trainer makes no trajectory trained twice (issue 15's chaos benchmark counts
``duplicated``). Without the state file it started again at cursor 0 and trained everything
again."""

from __future__ import annotations

import pytest

from laminar.roles.trainer.sim import SimTrainerConfig, SimTrainerService, SimTrainerStatus
from tests.support.poll import until

from .test_trainer_loop import Hosted, Loop, loop  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


def sim_trainer(lp: Loop, max_versions: int) -> Hosted:
    config = SimTrainerConfig(
        batch={"prompts": 2, "samples": 4},
        cost={"base_s": 0.0, "time_scale": 1e-6},
        weight_bytes=4096,
        max_versions=max_versions,
        sample_wait_s=0.3,
        publish={"master": lp.relay_service.advertise()["weights"], "chunks": 1},
        data=lp.data.address,
        state_file=str(lp.tmp / "sim-trainer.json"),
        metrics=None,
    )
    return Hosted(SimTrainerService, "sim_trainer", "trainer", config)


async def done(service: SimTrainerService, version: int) -> SimTrainerStatus:
    async def probe() -> SimTrainerStatus | None:
        s = await service.status()
        return s if s.version >= version and version in s.published else None

    return await until(probe, 60)


async def test_a_restarted_sim_trainer_trains_each_trajectory_once(loop: Loop) -> None:  # noqa: F811
    await loop.generate(6, lambda i: [3] * (i + 1))  # 6 groups: 3 batches of 2 groups
    first = sim_trainer(loop, max_versions=2)
    status = await done(await first.start(), 2)
    cursor = status.records[-1]["cursor"]
    await first.stop()

    second = sim_trainer(loop, max_versions=3)
    service = await second.start()
    try:
        status = await done(service, 3)
        # resumed at version 2 and trained only the third batch
        assert [r["version"] for r in status.records] == [3]
        assert status.records[0]["trajectories"] == 8
        assert status.records[0]["cursor"] > cursor
        assert status.published == [3]
    finally:
        await second.stop()
