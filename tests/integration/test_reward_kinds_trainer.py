"""A dict reward's extras and a TRL reward's batches through a real data role (its reward workers
are processes), a real relay and the sim trainer, every service in this event loop; the test
plays the rollout. The store's part is ``tests/unit/test_reward_kinds_trainer.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.data.service import DataService
from laminar.runtime.rpc.client import remote
from tests.support.poll import until

from .test_trainer_loop import Hosted, Loop
from .test_trainer_schedule import start_sim_trainer, written

DICT_REWARD = """
def reward(record, response):
    odd = len(response) % 2 == 1
    return {"score": float(odd), "odd": odd, "length": len(response), "text": response}
"""


TRL_REWARD = """
import json


def reward(completions, id, **kwargs):
    with open(__file__ + ".calls", "a") as f:
        f.write(json.dumps(id) + "\\n")
    return [{"reward": float(len(c) % 2), "length": len(c)} for c in completions]
"""


def loop_with_reward(tmp: Path, source: str, **data: Any) -> Loop:
    """The trainer tests' data role and relay, the data role scoring with ``source`` (written
    over the reward file it loads when it starts) and these ``data`` settings."""
    lp = Loop(tmp, bind="inproc://*")
    (tmp / "reward.py").write_text(source)
    config = lp.data.host.ctx.config.model_copy(update=data)
    lp.data = Hosted(DataService, "data", "data", config, lp.cluster)
    return lp


async def test_dict_extras_reach_the_trainers_record_for_each_version(tmp_path: Path) -> None:
    lp = loop_with_reward(tmp_path, DICT_REWARD)
    await lp.start()
    try:
        metrics = tmp_path / "trainer.jsonl"
        await lp.generate(2, lambda i: [3] * (i + 1))  # responses of 1 to 4 tokens
        await start_sim_trainer(lp, metrics)
        record = await written(metrics, 1)
        data = remote(DataApi, lp.client(lp.data.address))
        batch = (await data.sample.call(SampleRequest(n=8, after=0))).items  # re-delivered
    finally:
        await lp.close()
    assert len(batch) == 8
    for t in batch:
        assert t.reward is not None and set(t.reward_extras) == {"odd", "length"}
        assert t.reward_extras["odd"] == t.reward  # the bool, as 0/1
    lengths = [t.reward_extras["length"] for t in batch]
    assert sorted(set(lengths)) == [1.0, 2.0, 3.0, 4.0]
    assert record["reward/length"] == pytest.approx(sum(lengths) / 8)
    assert record["reward/odd"] == pytest.approx(record["reward_mean"])
    assert 0.0 < record["reward/odd"] < 1.0
    assert "reward/text" not in record  # text is not a number


async def test_a_trl_reward_is_scored_in_batches_by_the_data_role(tmp_path: Path) -> None:
    lp = loop_with_reward(tmp_path, TRL_REWARD, reward_batch=3)
    await lp.start()
    try:
        await lp.generate(4, lambda i: [3] * (i + 1))  # 16 trajectories in one report
        data = remote(DataApi, lp.client(lp.data.address))

        async def scored() -> list[Any] | None:
            items = (await data.sample.call(SampleRequest(n=16, after=0, wait_s=0.2))).items
            return items if len(items) == 16 else None

        batch = await until(scored, 60)
    finally:
        await lp.close()
    calls = [json.loads(line) for line in (tmp_path / "reward.py.calls").read_text().splitlines()]
    assert sum(len(ids) for ids in calls) == 16
    assert all(1 <= len(ids) <= 3 for ids in calls)  # what was waiting, up to reward_batch
    assert any(len(ids) > 1 for ids in calls)  # 16 arrived at once: some calls were batched
    for t in batch:
        assert t.reward_error is None
        assert t.reward == t.reward_extras["length"] % 2
