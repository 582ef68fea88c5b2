"""``data.focus``: prompts queued by how informative their class's recent groups were."""

from __future__ import annotations

import json

import pytest

from laminar.roles.data.buffer import SAMPLERS, ExperienceBuffer, KeepAll, make_policy
from laminar.roles.data.config import DataConfig, FocusConfig
from laminar.roles.data.focus import MISSING, Focus
from laminar.roles.data.service import DataService
from laminar.roles.data.store import Store
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.errors import ConfigError
from laminar.runtime.schedules import ScheduleConfig
from laminar.trajectory import SamplingParams

from .test_data_store import traj

PARAMS = SamplingParams(max_tokens=8)


def test_a_class_is_admitted_by_its_recent_informative_rate_never_below_the_floor():
    focus = Focus("steps", window=4, floor=0.1)
    easy, hard = {"steps": 1}, {"steps": 6}
    assert focus.admit_probability(focus.class_of(easy)) == 1.0  # nothing seen yet
    for _ in range(4):
        focus.observe(easy, informative=False)
    assert focus.admit_probability("1") == pytest.approx(1 / 6)  # (0 + 1) / (4 + 2)
    focus.observe(hard, informative=True)
    assert focus.admit_probability("6") == pytest.approx(2 / 3)
    for _ in range(20):  # the window forgets: only the last 4 count
        focus.observe(easy, informative=False)
    assert focus.admit_probability("1") == pytest.approx(1 / 6)
    floored = Focus("steps", window=100, floor=0.1)
    for _ in range(100):
        floored.observe(easy, informative=False)
    assert floored.admit_probability("1") == 0.1
    for _ in range(4):
        focus.observe(easy, informative=True)  # it became learnable again
    assert focus.admit_probability("1") == pytest.approx(5 / 6)
    assert focus.rates() == {"1": 0.833, "6": 0.667}


def test_classes_are_values_of_the_key_and_records_without_it_share_one():
    focus = Focus("level")
    assert focus.class_of({"level": "hard"}) == "hard"
    assert focus.class_of({"level": 3}) == "3" and focus.class_of({"level": [1, 2]}) == "[1, 2]"
    assert focus.class_of({"other": 1}) == focus.class_of({}) == MISSING


def test_admission_draws_are_seeded_and_follow_the_probability():
    a, b = Focus("k", window=8, seed=3), Focus("k", window=8, seed=3)
    for f in (a, b):
        for _ in range(8):
            f.observe({"k": 1}, informative=False)  # p = 1/10, at the floor
    draws = [a.admit({"k": 1}, epoch=0, pos=i) for i in range(4000)]
    assert draws == [b.admit({"k": 1}, epoch=0, pos=i) for i in range(4000)]
    assert 0.08 < sum(draws) / len(draws) < 0.12
    assert a.skipped == 4000 - sum(draws) and a.admitted == sum(draws)
    other = Focus("k", window=8, seed=4)
    for _ in range(8):
        other.observe({"k": 1}, informative=False)
    assert [other.admit({"k": 1}, epoch=0, pos=i) for i in range(4000)] != draws
    assert all(a.admit({"k": 2}, epoch=0, pos=i) for i in range(100))  # unseen: always


@pytest.mark.parametrize("window,floor", [(0, 0.1), (4, 0.0), (4, 1.5)])
def test_bad_settings_are_refused(window, floor):
    with pytest.raises(ValueError):
        Focus("k", window=window, floor=floor)
    with pytest.raises(ValueError):
        FocusConfig(key="k", window=window, floor=floor)


def _store(tmp_path, steps):
    store = Store(tmp_path / "s.sqlite")
    store.load_prompts(
        ((f"p{i}", {"id": f"p{i}", "steps": s}, [1, 2, i]) for i, s in enumerate(steps)), "fp"
    )
    return store


def test_refill_skips_what_admit_refuses_and_still_fills_the_queue(tmp_path):
    store = _store(tmp_path, [1, 5] * 10)
    seen = []

    def admit(record, epoch, pos):
        seen.append((record["steps"], epoch, pos))
        return record["steps"] == 5

    assert store.refill(8, samples=2, seed=0, epochs=None, admit=admit) == 8
    queued = {a.prompt_id for a in store.lease("r", 100, 0, set(), PARAMS)}
    records = {
        pid: json.loads(r) for pid, r in store.db.execute("SELECT prompt_id, record FROM prompts")
    }
    assert len(queued) == 4 and all(records[p]["steps"] == 5 for p in queued)
    assert [pos for _, _, pos in seen] == list(range(len(seen)))  # every draw asked once, in order
    # a finite run: what is refused is not queued in that epoch, and the epoch ends
    once = _store(tmp_path / "once", [1, 5] * 10)
    assert once.refill(100, samples=1, seed=0, epochs=1, admit=admit) == 10
    assert once.exhausted(1)


def _group_buffer(tmp_path, rewards, **kw):
    """Two-sample groups p0, p1, ... finished and scored with ``rewards`` (one pair per group)."""
    store = _store(tmp_path, [i + 1 for i in range(len(rewards))])
    store.refill(2 * len(rewards), samples=2, seed=0, epochs=1)
    leased = [a.trajectory_id for a in store.lease("r", 100, 0, set(), PARAMS)]
    store.complete("r", [traj(t) for t in leased])
    by_prompt = {f"p{i}": pair for i, pair in enumerate(rewards)}
    store.set_rewards([(t, by_prompt[t.split("/")[0]][int(t.split("/")[1])], None) for t in leased])
    told: list[tuple[int, bool]] = []
    sampler = make_policy("fifo", SAMPLERS, {})
    buffer = ExperienceBuffer(
        store,
        sampler,
        KeepAll(),
        group_size=2,
        on_group=lambda tid, informative: told.append((store.record_of(tid)["steps"], informative)),
        **kw,
    )
    return buffer, told


def test_the_buffer_tells_each_whole_group_once_when_it_leaves(tmp_path):
    # steps 1: all right, 2: mixed, 3: all wrong, 4: mixed
    rewards = [(1.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.0, 1.0)]
    buffer, told = _group_buffer(tmp_path, rewards, drop_constant_groups=True)
    assert buffer.sample(6, 0, whole_groups=True, partial=False) is None  # only 2 informative
    assert sorted(told) == [(1, False), (3, False)]  # the filtered ones, told as they left
    told.clear()
    assert len(buffer.sample(4, 0, whole_groups=True).items) == 4
    assert sorted(told) == [(2, True), (4, True)]  # consumed now, told once
    told.clear()
    assert buffer.sample(4, 0, whole_groups=True).items == [] and told == []
    # without the filter, a constant group is trained on and told as uninformative
    buffer, told = _group_buffer(tmp_path / "b", rewards[:2])
    assert len(buffer.sample(4, 0, whole_groups=True).items) == 4
    assert sorted(told) == [(1, False), (2, True)]


def test_focus_with_round_schedules_is_a_config_error(options):
    cluster = ClusterConfig(schedule=ScheduleConfig(kind="sync", round_prompts=2))
    config = DataConfig(
        metrics=None,
        prompts="x.jsonl",
        tokenizer="tok",
        reward="tests.support.task:reward_len",
        focus=FocusConfig(key="steps"),
    )
    ctx = ServiceContext(
        role="data", instance="data-x", cluster=cluster, config=config, options=options
    )
    try:
        with pytest.raises(ConfigError, match=r"data\.focus does not work with the sync schedule"):
            DataService(ctx)
    finally:
        ctx.close_executors()


@pytest.mark.parametrize("kind", ["sync", "one_step", "tail_batching"])
def test_dropping_constant_groups_under_rounds_is_a_config_error(options, kind):
    """A round ends with its groups complete; dropping the constant ones would leave the trainer
    short of a batch while the next round waits for the trainer: the run would stall forever."""
    cluster = ClusterConfig(schedule=ScheduleConfig(kind=kind, round_prompts=2))
    config = DataConfig(
        metrics=None,
        prompts="x.jsonl",
        tokenizer="tok",
        reward="tests.support.task:reward_len",
        drop_constant_groups=True,
    )
    ctx = ServiceContext(
        role="data", instance="data-x", cluster=cluster, config=config, options=options
    )
    try:
        with pytest.raises(
            ConfigError, match=rf"drop_constant_groups does not work with the {kind}"
        ):
            DataService(ctx)
    finally:
        ctx.close_executors()
