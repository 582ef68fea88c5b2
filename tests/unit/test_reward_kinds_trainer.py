"""A dict reward's extras, from the data role's worker to the trainer's per-version record.

The extras are stored beside the reward (a column older stores gain when opened), travel with the
trajectory to the trainer, and come out as each version's mean, ``reward/<name>``, in the metrics
line (and as ``train/reward/<name>`` in TensorBoard and W&B). The whole way, through a real data
role, and a TRL reward scored in batches by it, are
``tests/integration/test_reward_kinds_trainer.py``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from laminar.roles.data.store import Store
from laminar.roles.trainer.loop import reward_extras
from laminar.tracking import record_scalars
from laminar.trajectory import SamplingParams

from .test_data_store import make_store, traj

pytestmark = pytest.mark.timeout(120)


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
