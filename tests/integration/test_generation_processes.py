"""Manager + data + 2 rollouts (sim engines) as processes; the data role is killed with -9."""

from __future__ import annotations

import pytest

from tests.support.scenario import kill_data_midway, process_cluster, write_config
from tests.support.task import write_prompts, write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


async def test_kill_9_of_the_data_role_loses_nothing(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 48)
    tokenizer = write_tokenizer(tmp_path / "tok")
    config = write_config(
        tmp_path,
        {
            "data": {
                "prompts": str(prompts),
                "tokenizer": str(tokenizer),
                "reward": "tests.support.task:reward_len",
                "samples_per_prompt": 4,
                "store": str(tmp_path / "data.sqlite"),
                "metrics": None,
            },
            "rollout": {
                "metrics": None,
                "concurrency": 16,
                "flush_interval_s": 0.1,
                "engine": {
                    "backend": "sim",
                    "lengths": {"kind": "longtail", "median": 60, "max_length": 600},
                    "cost": {"batch_points": [[1, 0.004], [256, 0.008]], "prefill_s_per_token": 0},
                },
            },
        },
    )
    with process_cluster(tmp_path, config) as cluster:
        cluster.serve("manager", "manager")
        for i in range(2):
            cluster.serve("rollout", f"rollout-{i}")
        trajectories, figures = await kill_data_midway(
            cluster, total=192, kill_after=60, timeout=90
        )
    assert figures["done_before_kill"] >= 60
    assert figures["partials_before_kill"] > 0  # the kill hit trajectories in flight
    assert {t.rollout for t in trajectories} == {"rollout-0", "rollout-1"}
    for t in trajectories:
        assert t.version == 0 and t.reward is not None
        assert len(t.logprobs) == len(t.response_token_ids) > 0
