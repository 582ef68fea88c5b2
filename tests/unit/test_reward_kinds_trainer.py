"""A dict reward's extras, from the data role's worker to the trainer's per-version record.

The extras are stored beside the reward (a column older stores gain when opened), travel with the
trajectory to the trainer, and come out as each version's mean, ``reward/<name>``, in the metrics
line (and as ``train/reward/<name>`` in TensorBoard and W&B). A TRL reward is scored in batches
by the data role. Every service runs in this event loop with a real data role, a real relay and
the sim trainer; the test plays the rollout.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.data.service import DataService
from laminar.roles.data.store import Store
from laminar.roles.trainer.loop import reward_extras
from laminar.runtime.rpc.client import remote
from laminar.tracking import record_scalars
from laminar.trajectory import SamplingParams
from tests.support.poll import until

from .test_data_store import make_store, traj
from .test_trainer_loop import Hosted, Loop
from .test_trainer_schedule import start_sim_trainer, written

pytestmark = pytest.mark.timeout(120)

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


def test_reward_extras_are_averaged_over_the_trajectories_that_have_them() -> None:
    a = traj("p/0").model_copy(update={"reward": 1.0, "reward_extras": {"acc": 1.0, "len": 4.0}})
    b = traj("p/1").model_copy(update={"reward": 0.0, "reward_extras": {"acc": 0.0}})
    c = traj("p/2").model_copy(update={"reward": None, "reward_error": "raised"})
    assert reward_extras([a, b, c]) == {"reward/acc": 0.5, "reward/len": 4.0}
    assert reward_extras([c]) == {}


def test_extras_in_a_metrics_line_are_tracked_as_train_reward_names() -> None:
    line = {"version": 3, "reward_mean": 0.5, "reward/acc": 0.25, "reward/format": 1.0}
    scalars = record_scalars(line)
    assert scalars["train/reward/acc"] == 0.25 and scalars["train/reward/format"] == 1.0


def completed(store: Store, n: int) -> list[str]:
    store.refill(n, samples=1, seed=0, epochs=1)
    leased = [a.trajectory_id for a in store.lease("r", n, 0, set(), SamplingParams())]
    store.complete("r", [traj(t) for t in leased])
    return leased


def test_extras_are_stored_and_read_back_with_the_reward(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    first, second, third = completed(store, 3)
    store.set_rewards(
        [(first, 1.0, None), (second, None, "raised"), (third, 0.0, None)],
        {first: {"acc": 1.0, "len": 3.0}},
    )
    assert store.trajectory(first).reward_extras == {"acc": 1.0, "len": 3.0}
    assert store.trajectory(second).reward_extras == {}
    assert store.trajectory(third).reward_extras == {}
    consumed = [t.reward_extras for t in store.consume([first, second])]
    assert consumed == [{"acc": 1.0, "len": 3.0}, {}]
    again = [t.reward_extras for _, t in store.consumed_after(0, 10)]  # a trainer's resume
    assert again == consumed
    store.close()


def test_a_store_from_before_extras_opens_with_the_column_added(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    old, new = completed(store, 2)
    store.set_rewards([(old, 1.0, None)])
    store.close()
    db = sqlite3.connect(tmp_path / "s.sqlite")  # the table as an older release wrote it
    kept = [r[1] for r in db.execute("PRAGMA table_info(trajectories)") if r[1] != "reward_extras"]
    db.executescript(
        f"CREATE TABLE older AS SELECT {', '.join(kept)} FROM trajectories; "
        "DROP TABLE trajectories; ALTER TABLE older RENAME TO trajectories;"
    )
    db.close()
    store = Store(tmp_path / "s.sqlite")
    columns = {row[1] for row in store.db.execute("PRAGMA table_info(trajectories)")}
    assert "reward_extras" in columns
    assert store.trajectory(old).reward == 1.0 and store.trajectory(old).reward_extras == {}
    store.set_rewards([(new, 0.5, None)], {new: {"acc": 0.0}})
    assert store.trajectory(new).reward_extras == {"acc": 0.0}
    store.close()
