"""Each schedule's defining property on the in-process cluster (``laminar/harness/inproc.py``):
manager, data, relay, three sim rollouts and the sim trainer in one event loop on virtual time.

The checks of ``test_schedules.py`` (orderings of recorded events, never durations), whose
``sync`` case stays there as the ground truth over real processes and one machine's wall clock.
Here every timestamp is the virtual clock's, the same for all members, so the orderings are
exact and the same in every run of a seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from laminar.harness.inproc import inproc_cluster, run_inproc
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout import RolloutApi
from laminar.roles.trainer.sim import SimTrainerService
from laminar.trajectory import Trajectory

from ..support.poll import until
from .test_schedules import (
    PROMPTS,
    ROLLOUTS,
    SAMPLES,
    VERSIONS,
    check_defining_property,
    config_sections,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def run(tmp: Path, kind: str, seed: int) -> tuple[list[dict], list[Trajectory], dict, int]:
    """Run to VERSIONS versions; return trainer records, consumed trajectories, weight loads."""
    sections: dict[str, Any] = config_sections(tmp, kind)
    members = [("data", "data"), ("relay", "relay")]
    members += [("rollout", name) for name in ROLLOUTS] + [("sim_trainer", "trainer")]
    async with inproc_cluster(sections, seed=seed, members=members) as cluster:
        trainer = cluster.proxy(SimTrainerService, "trainer")

        async def done() -> bool:
            return len((await trainer.status.call()).published) >= VERSIONS

        await until(done, timeout=90, interval=0.2)
        records = (await trainer.status.call()).records
        data = cluster.proxy(DataApi, "data")
        consumed = VERSIONS * PROMPTS * SAMPLES  # re-delivered from the start, in order
        trajectories = (await data.sample.call(SampleRequest(n=consumed, after=0))).items
        generated = (await data.status.call()).trajectories
        loads = {
            name: (await cluster.proxy(RolloutApi, name).weights.call()).loads for name in ROLLOUTS
        }
    assert len(trajectories) == VERSIONS * PROMPTS * SAMPLES
    return records, trajectories, loads, generated


@pytest.mark.parametrize("kind", ["sync", "one_step", "tail_batching", "laminar"])
def test_schedule_defining_property(tmp_path: Path, kind: str) -> None:
    records, trajectories, loads, generated = run_inproc(
        lambda: run(tmp_path, kind, seed=0), seed=0
    )
    check_defining_property(kind, records, trajectories, loads, generated)
