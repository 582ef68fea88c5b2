"""What the trainer must never learn from (issue 15, silent corruption).

* a trajectory whose reward failed (raised, timed out) is excluded, not trained as reward 0.0, and
  its group's advantages are computed over the members that remain;
* a trajectory with non-finite behaviour logprobs is excluded before the loss;
* an optimizer step whose loss or gradient norm is not finite is skipped (no weight, no optimizer
  moment moves), and data-parallel ranks skip the same steps
  (``tests/integration/test_trainer_integrity.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from laminar.rl import grpo_advantages, pack, screen_batch
from laminar.roles.trainer.compute import PolicyTrainer, prepare
from laminar.roles.trainer.config import TrainerConfig
from laminar.trajectory import Trajectory

from ..support.models import tiny_qwen2


def traj(
    group: str,
    sample: int,
    reward: float | None,
    *,
    error: str | None = None,
    logprobs: list[float] | None = None,
) -> Trajectory:
    lp = logprobs if logprobs is not None else [-1.0, -2.0, -0.5]
    return Trajectory(
        trajectory_id=f"{group}/{sample}",
        prompt_id=group,
        sample_index=sample,
        prompt_token_ids=[5, 6, 7],
        response_token_ids=[8 + sample, 9, 10][: len(lp)],
        logprobs=lp,
        version=0,
        finish_reason="stop",
        queued_at=0,
        started_at=0,
        finished_at=0,
        reward=reward,
        reward_error=error,
    )


def config(model: Path | str = "unused", **extra) -> TrainerConfig:  # type: ignore[no-untyped-def]
    return TrainerConfig(model=str(model), threads_per_rank=1, metrics_file=None, **extra)


# -- screening ------------------------------------------------------------------------------------


def test_failed_rewards_are_excluded_and_advantages_use_the_rest_of_the_group() -> None:
    batch = [
        traj("a", 0, 1.0),
        traj("a", 1, 0.0),
        traj("a", 2, None, error="reward timed out after 10 s"),
        traj("a", 3, 1.0),
        traj("b", 0, 0.0),
        traj("b", 1, 1.0),
        traj("b", 2, 0.5, error="raised after returning"),  # an error wins over a value
        traj("b", 3, float("nan")),  # a NaN reward is no reward
    ]
    screened, packed = prepare(batch, config())
    assert screened.excluded == {"reward_failed": ["a/2", "b/2", "b/3"]}
    assert [t.trajectory_id for t in screened.kept] == ["a/0", "a/1", "a/3", "b/0", "b/1"]
    assert packed is not None and packed.batch_size == 5
    # group a's baseline is the mean of its three scored members, not of four with a 0.0
    expected = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]), list("aaabb"))
    wrong = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), list("aaaa"))  # the old 0.0
    per_row = packed.advantages.sum(dim=1) / packed.loss_mask.sum(dim=1)
    torch.testing.assert_close(per_row, expected)
    assert not torch.allclose(per_row[:3], wrong[[0, 1, 3]])


def test_group_scope_leaves_out_the_whole_group() -> None:
    batch = [traj("a", i, float(i % 2)) for i in range(4)]
    batch += [traj("b", 0, None, error="raised"), *(traj("b", i, float(i % 2)) for i in (1, 2, 3))]
    screened = screen_batch(batch, "group")
    assert screened.excluded == {
        "reward_failed": ["b/0"],
        "group_of_excluded": ["b/1", "b/2", "b/3"],
    }
    assert {t.prompt_id for t in screened.kept} == {"a"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -1e300])
def test_nonfinite_behaviour_logprobs_are_excluded(bad: float) -> None:
    batch = [traj("a", 0, 1.0, logprobs=[-1.0, bad, -0.5]), traj("a", 1, 0.0), traj("a", 2, 1.0)]
    screened, packed = prepare(batch, config())
    assert screened.excluded == {"logprobs_nonfinite": ["a/0"]}
    assert packed is not None and torch.isfinite(packed.behaviour_logprobs).all()
    with pytest.raises(ValueError, match="a/0: non-finite behaviour logprobs"):
        pack(batch, [0.0, 0.0, 0.0])  # and pack names the trajectory if one ever gets there


def test_a_batch_with_nothing_trainable_packs_nothing() -> None:
    batch = [traj("a", i, None, error="worker died") for i in range(4)]
    screened, packed = prepare(batch, config())
    assert packed is None and screened.excluded_count == 4 and not screened.kept


# -- non-finite steps -----------------------------------------------------------------------------


def poisoned(rows: list[int], n: int = 8) -> tuple[list[Trajectory], object]:
    """``n`` rows in two groups; rows in ``rows`` get a NaN behaviour logprob *in the packed
    batch* (past the screen: the step guard must hold whatever reaches it)."""
    batch = [traj(f"g{i // 4}", i % 4, float(i % 2)) for i in range(n)]
    adv = grpo_advantages(torch.tensor([t.reward for t in batch]), [t.prompt_id for t in batch])
    packed = pack(batch, adv.tolist())
    for r in rows:
        packed.behaviour_logprobs[r, 4] = float("nan")  # a response position
    return batch, packed


def weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


# TIS: the behaviour logprobs enter the loss through the importance weight, so a NaN reaches it.
TIS = {"off_policy": "tis"}


def test_a_nonfinite_step_is_skipped_and_nothing_moves(tmp_path: Path) -> None:
    model = tiny_qwen2(tmp_path / "model")
    trainer = PolicyTrainer(config(model, loss=TIS, optim={"lr": 1e-3}))
    before = weights(trainer)
    _, packed = poisoned([2])
    result = trainer.train(packed)  # type: ignore[arg-type]
    assert (result.steps, result.skipped_steps, result.grad_norm) == (1, 1, None)
    assert same(weights(trainer), before), "a NaN step moved the weights"
    assert not trainer.optimizer.state, "a NaN step touched the optimizer's moments"
    assert all(math.isfinite(v) for v in result.stats.values())
    _, clean = poisoned([])  # training goes on normally afterwards
    result = trainer.train(clean)  # type: ignore[arg-type]
    assert result.skipped_steps == 0 and result.grad_norm is not None
    after = weights(trainer)
    assert all(torch.isfinite(v).all() for v in after.values()) and not same(after, before)


def test_only_the_poisoned_mini_batch_is_skipped(tmp_path: Path) -> None:
    model = tiny_qwen2(tmp_path / "model")
    cfg = config(model, loss=TIS, optim={"lr": 1e-3}, batch={"prompts": 2, "mini_batches": 2})
    trainer = PolicyTrainer(cfg)
    before = weights(trainer)
    _, packed = poisoned([6])  # the second mini-batch (rows 4..7)
    result = trainer.train(packed)  # type: ignore[arg-type]
    assert (result.steps, result.skipped_steps) == (2, 1)
    after = weights(trainer)
    assert not same(after, before) and all(torch.isfinite(v).all() for v in after.values())
