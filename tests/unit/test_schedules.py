"""The schedule decisions (laminar.runtime.schedules): who generates which round, when versions go out."""

from __future__ import annotations

import pytest

from laminar.engines.costmodel import TrainCostModel
from laminar.runtime.config import ClusterConfig, load_config
from laminar.runtime.errors import ConfigError
from laminar.runtime.schedules import (
    RoundPlan,
    ScheduleConfig,
    may_lease,
    may_publish,
    plan_round,
    round_over,
    round_version,
    split_round,
    staleness_bound,
)


def test_default_is_laminar_and_round_schedules_need_a_size() -> None:
    assert ClusterConfig().schedule.kind == "laminar"
    assert not ClusterConfig().schedule.rounds
    with pytest.raises(ValueError, match="round_prompts"):
        ScheduleConfig(kind="sync")
    assert ScheduleConfig(kind="one_step", round_prompts=8).rounds


def test_unknown_schedule_is_a_config_error_naming_the_key(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cluster:\n  schedule:\n    kind: lockstep\n")
    with pytest.raises(ConfigError, match=r"cluster\.schedule\.kind"):
        load_config(path)


def test_round_versions_follow_the_staleness_of_each_schedule() -> None:
    assert [round_version("sync", r) for r in range(4)] == [0, 1, 2, 3]
    assert [round_version("tail_batching", r) for r in range(3)] == [0, 1, 2]
    assert [round_version("one_step", r) for r in range(4)] == [0, 0, 1, 2]
    assert round_version("laminar", 5) is None
    assert (staleness_bound("sync"), staleness_bound("one_step")) == (0, 1)
    assert staleness_bound("laminar") is None


def test_only_the_rounds_version_may_lease() -> None:
    assert may_lease("sync", 2, 2)
    assert not may_lease("sync", 2, 1)  # an old version: must wait for the new one
    assert not may_lease("one_step", 3, 3)  # one_step round 3 is version 2's
    assert may_lease("one_step", 3, 2)
    assert may_lease("laminar", 7, 0)


def test_one_step_holds_a_version_until_its_own_batch_is_whole() -> None:
    # version v is trained on batch v - 1; one_step may release it only after batch v is sampled
    assert not may_publish("one_step", 1, 1)
    assert may_publish("one_step", 1, 2)
    for kind in ("laminar", "sync", "tail_batching"):
        assert may_publish(kind, 1, 1)


def test_tail_batching_plans_short_rounds_then_a_long_one() -> None:
    short = plan_round("tail_batching", 0, 8, 1.25, deferred_waiting=0)
    assert (short.kind, short.fresh, short.deferred, short.keep) == ("short", 10, 0, 8)
    assert plan_round("tail_batching", 3, 8, 1.25, deferred_waiting=7).kind == "short"
    long = plan_round("tail_batching", 4, 8, 1.25, deferred_waiting=9)
    assert (long.kind, long.fresh, long.deferred, long.keep) == ("long", 0, 8, 8)
    plain = plan_round("sync", 0, 8, 1.25, deferred_waiting=0)
    assert (plain.kind, plain.launched, plain.keep) == ("plain", 8, 8)
    with pytest.raises(ValueError):
        plan_round("laminar", 0, 8, 1.25, 0)


def test_a_short_round_keeps_the_first_groups_and_defers_the_rest() -> None:
    plan = RoundPlan(0, "short", 5, 0, 3)
    launched = ["a", "b", "c", "d", "e"]
    assert not round_over(plan, 2)
    assert round_over(plan, 3)
    kept, deferred = split_round(plan, ["d", "a", "e"], launched)
    assert kept == ["d", "a", "e"] and deferred == ["b", "c"]
    # two groups completing in one report: the extra one is deferred, never mixed into a batch
    kept, deferred = split_round(plan, ["d", "a", "e", "b"], launched)
    assert kept == ["d", "a", "e"] and deferred == ["b", "c"]


def test_train_cost_model_scales_with_tokens_and_gpus() -> None:
    model = TrainCostModel(gpus=8, base_s=0.0)
    assert 5_000 < model.tokens_per_s() / 8 < 6_000  # ~5.7k tokens/s per H800 at 35% MFU
    assert model.train_time(0) == 0.0
    assert model.train_time(2000) == pytest.approx(2 * model.train_time(1000))
    assert TrainCostModel(gpus=16, base_s=0.0).train_time(1000) == pytest.approx(
        model.train_time(1000) / 2
    )
    scaled = TrainCostModel(gpus=8, base_s=0.5, time_scale=4.0)
    assert scaled.train_time(1000) == pytest.approx(0.5 + 4 * model.train_time(1000))
