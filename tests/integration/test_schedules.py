"""Each schedule's defining property on a tiny emulated cluster (processes: manager, data, relay,
three sim rollouts, the sim trainer).

The checks are orderings of recorded events, never durations: trajectory start/finish times (the
rollouts'), weight loads (each rollout's ``weights`` history), and the sim trainer's train
intervals and publish times, all from the same machine's wall clock.

``sync`` runs here, over real processes, as the ground truth; every schedule (``sync`` too) runs
with the same checks (:func:`check_defining_property`) on the in-process cluster, on virtual time,
in ``test_inproc_schedules.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout import RolloutApi
from laminar.roles.trainer.sim import SimTrainerService
from laminar.trajectory import Trajectory

from ..support.clients import ClusterClients
from ..support.poll import until
from ..support.scenario import process_cluster, write_config
from ..support.task import write_prompts, write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROLLOUTS = ("rollout-0", "rollout-1", "rollout-2")
PROMPTS, SAMPLES, VERSIONS = 2, 2, 3  # a batch: 2 groups of 2


def config_sections(tmp: Path, kind: str) -> dict[str, Any]:
    return {
        "cluster": {
            "heartbeat_interval_s": 0.25,
            "heartbeat_timeout_s": 2.0,
            "rpc_timeout_s": 10.0,
            "log_level": "warning",
            "schedule": {"kind": kind, "round_prompts": PROMPTS, "over_launch": 1.5},
        },
        "data": {
            "prompts": str(write_prompts(tmp / "prompts.jsonl", 64)),
            "tokenizer": str(write_tokenizer(tmp / "tok")),
            "reward": "tests.support.task:reward_len",
            "samples_per_prompt": SAMPLES,
            "epochs": None,
            "store": str(tmp / "data.sqlite"),
            "sampling": {"max_tokens": 120},
            "metrics": None,
            "queue_ahead": 8,
        },
        "relay": {"weights_bind": "tcp://127.0.0.1:0", "metrics": None},
        "rollout": {
            "metrics": None,
            "concurrency": 4,
            "flush_interval_s": 0.1,
            "take_wait_s": 0.3,
            "engine": {
                "backend": "sim",
                "vocab_size": 64,
                "seed": 5,
                "lengths": {"kind": "lognormal", "median": 12, "sigma": 1.2, "max_length": 120},
                "cost": {"batch_points": [[1, 0.01], [64, 0.012]], "prefill_s_per_token": 0},
                "load_time_s": 0.05,
            },
        },
        "sim_trainer": {
            "metrics": None,
            "batch": {"prompts": PROMPTS, "samples": SAMPLES},
            "cost": {"gpus": 1, "base_s": 0.3, "time_scale": 1.0},
            "weight_bytes": 1 << 20,
            "max_versions": VERSIONS,
            "sample_wait_s": 1.0,
        },
    }


def config(tmp: Path, kind: str) -> Path:
    return write_config(tmp, config_sections(tmp, kind))


async def run(tmp: Path, kind: str) -> tuple[list[dict], list[Trajectory], dict[str, list], int]:
    """Run to VERSIONS versions; return trainer records, consumed trajectories, weight loads."""
    with process_cluster(tmp, config(tmp, kind)) as cluster:
        clients = ClusterClients(cluster)
        try:
            cluster.serve("manager", "manager")
            cluster.serve("data", "data")
            cluster.serve("relay", "relay")
            for name in ROLLOUTS:
                cluster.serve("rollout", name)
            cluster.serve("sim_trainer", "trainer")
            trainer = clients.proxy(SimTrainerService, "trainer")

            async def done() -> bool:
                status = await trainer.status.call()
                return len(status.published) >= VERSIONS

            await until(done, timeout=90, interval=0.2)
            records = (await trainer.status.call()).records
            data = clients.proxy(DataApi, "data")
            consumed = VERSIONS * PROMPTS * SAMPLES  # re-delivered from the start, in order
            trajectories = (await data.sample.call(SampleRequest(n=consumed, after=0))).items
            generated = (await data.status.call()).trajectories
            loads = {
                name: (await clients.proxy(RolloutApi, name).weights.call()).loads
                for name in ROLLOUTS
            }
        finally:
            await clients.close()
    assert len(trajectories) == VERSIONS * PROMPTS * SAMPLES
    return records, trajectories, loads, generated


def switched_after_the_slowest(trajectories: list[Trajectory], loads: dict[str, list]) -> bool:
    """No rollout loaded version v while a trajectory of an older version was still running."""
    for rollout_loads in loads.values():
        for load in rollout_loads:
            older = [t.finished_at for t in trajectories if t.version < load.version]
            if older and max(older) > load.loaded_at:
                return False
    return True


def published_at(records: list[dict], version: int) -> float:
    return next((r["published_at"] for r in records if r["version"] == version), float("-inf"))


@pytest.mark.parametrize("kind", ["sync"])  # the others: test_inproc_schedules.py
async def test_schedule_defining_property(tmp_path, kind):
    check_defining_property(kind, *await run(tmp_path, kind))


def check_defining_property(
    kind: str,
    records: list[dict],
    trajectories: list[Trajectory],
    loads: dict[str, list],
    generated: int,
) -> None:
    staleness = [r["staleness_max"] for r in records]
    if kind in ("sync", "tail_batching"):
        assert staleness == [0] * VERSIONS, records  # on-policy
        # colocated: no trajectory was being generated while the trainer trained
        for r in records:
            for t in trajectories:
                assert t.finished_at <= r["train_start"] or t.started_at >= r["train_end"], (t, r)
        assert switched_after_the_slowest(trajectories, loads)
        # a deferred prompt was queued before the version that finally generated it existed
        deferred = [t for t in trajectories if t.queued_at < published_at(records, t.version)]
        if kind == "sync":
            assert not deferred
        else:
            assert deferred, "no prompt was deferred to a later (long) round"
            assert all(t.version > 0 for t in deferred)
    elif kind == "one_step":
        assert staleness[0] == 0 and staleness[1:] == [1] * (VERSIONS - 1), records
        assert all(r["staleness_mean"] == r["staleness_max"] for r in records)
        assert switched_after_the_slowest(trajectories, loads)  # one global switch per version
        # generating the next round overlapped training: some trajectory ran during training
        assert any(
            t.started_at < r["train_end"] and t.finished_at > r["train_start"]
            for r in records
            for t in trajectories
        )
    else:  # laminar: no rounds, no barrier: generation runs ahead of training
        # (the rounds of the other schedules stop generation at each batch; here the rollouts
        # never wait, so more was generated than the trainer consumed)
        assert generated > VERSIONS * PROMPTS * SAMPLES, generated
        # rollouts switch on their own (one that stayed busy may not have switched at all)
        assert any(load.version > 0 for ls in loads.values() for load in ls), loads
