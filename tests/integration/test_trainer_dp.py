"""Data parallelism changes nothing: 2 ranks produce the same update as 1 rank on one batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from laminar.rl import grpo_advantages, pack
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.device import load_policy
from laminar.roles.trainer.dp import DataParallelGroup
from laminar.trajectory import Trajectory

from ..support.models import tiny_qwen2

pytestmark = pytest.mark.integration


def batch(seed: int, groups: int = 4, samples: int = 4, vocab: int = 64) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        for s in range(samples):
            n = rng.randint(1, 20)  # ragged: padding and token-level aggregation both matter
            out.append(
                Trajectory(
                    trajectory_id=f"p{g}/{s}",
                    prompt_id=f"p{g}",
                    sample_index=s,
                    prompt_token_ids=prompt,
                    response_token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n)],
                    version=0,
                    finish_reason="length",
                    queued_at=0,
                    started_at=0,
                    finished_at=0,
                    reward=float(rng.random() < 0.5),
                )
            )
    return out


def update(
    model_dir: Path,
    world: int,
    trajectories: list[Trajectory],
    optimizer: str,
    epochs: int = 1,
    sharding: str = "replicate",
) -> dict[str, torch.Tensor]:
    config = TrainerConfig(
        model=str(model_dir),
        data_parallel=world,
        sharding=sharding,
        threads_per_rank=1,
        # 2 optimizer steps of 8 rows, micro-batches of 3 rows: uneven splits on purpose
        batch={
            "prompts": 4,
            "samples": 4,
            "mini_batches": 2,
            "micro_batch_rows": 3,
            "epochs": epochs,
        },
        optim={"name": optimizer, "lr": 1e-3 if optimizer == "adamw" else 0.5},
        # a second epoch also exercises sequence-mean aggregation across ranks and micro-batches
        loss={"off_policy": "tis", "aggregation": "seq_mean" if epochs > 1 else "token_mean"},
    )
    adv = grpo_advantages(
        torch.tensor([t.reward for t in trajectories]), [t.prompt_id for t in trajectories]
    )
    group = DataParallelGroup(config, timeout_s=60)
    try:
        result = group.train(pack(trajectories, adv.tolist()))
        assert result.tokens == sum(len(t.response_token_ids) for t in trajectories)
        return {k: v.clone() for k, v in group.weights()}  # sharded: gathered
    finally:
        group.close()


@pytest.mark.parametrize(
    ("optimizer", "epochs", "sharding"),
    [
        ("sgd", 1, "replicate"),
        ("adamw", 1, "replicate"),
        ("sgd", 2, "replicate"),
        # FSDP2 on gloo
        ("adamw", 1, "fsdp"),
        ("sgd", 2, "fsdp"),
    ],
)
def test_two_ranks_equal_one(tmp_path: Path, optimizer: str, epochs: int, sharding: str) -> None:
    model_dir = tiny_qwen2(tmp_path / "model")
    # 14 rows (as after screening two out): steps of 7, so rank 0 gets 4 rows (2 micro-batches
    # of at most 3) and rank 1 gets 3 (1): sharded, rank 1 must run a padding micro-batch
    trajectories = batch(0)[:14]
    before = load_policy(str(model_dir)).state_dict()
    one = update(model_dir, 1, trajectories, optimizer, epochs)
    two = update(model_dir, 2, trajectories, optimizer, epochs, sharding)
    for name in one:
        step_one, step_two = one[name] - before[name], two[name] - before[name]
        assert step_one.abs().max() > 1e-5, f"{name} did not move"
        if optimizer == "sgd":  # the update is linear in the all-reduced gradient
            # (float32 rounding of the summed gradients compounds over the second epoch's steps)
            torch.testing.assert_close(step_two, step_one, rtol=1e-4, atol=3e-7 * epochs**2)
        else:
            # Adam divides by sqrt(v): where a gradient is ~0 its rounding noise is amplified
            # towards +-lr, so compare the update to a small fraction of the learning rate.
            assert (step_two - step_one).abs().max() < 0.02 * 1e-3, name


def test_a_group_that_cannot_form_leaves_no_rank_and_no_meeting_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fails to join its local ranks (here at once; for real after ``timeout_s``): the
    caller gets the error and no group to close, so the group ends the ranks it started and
    removes the directory they were to meet in before it raises."""
    import multiprocessing

    from laminar.roles.trainer import dp

    made: list[Path] = []
    rendezvous = dp.local_rendezvous

    def recorded() -> tuple[str, Path]:
        address, directory = rendezvous()
        made.append(directory)
        return address, directory

    def refuse(*args: object) -> None:
        raise RuntimeError("the group did not form")

    monkeypatch.setattr(dp, "local_rendezvous", recorded)
    monkeypatch.setattr(dp, "init_group", refuse)
    config = TrainerConfig(
        model=str(tiny_qwen2(tmp_path / "model")), data_parallel=2, threads_per_rank=1
    )
    with pytest.raises(RuntimeError, match="did not form"):
        DataParallelGroup(config, timeout_s=5)
    assert len(made) == 1 and not made[0].exists()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("trainer-rank")]
