"""The torch trainer on CUDA: bf16 autocast over fp32 master weights, one GRPO step (tiny random
Qwen2), and FSDP2 over NCCL on two GPUs against one replicated rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laminar.roles.trainer.compute import PolicyTrainer
from laminar.roles.trainer.config import TrainerConfig

from ..support.models import tiny_qwen2
from ..unit.test_trainer_device import batch
from .conftest import gpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def config(model: Path, **extra) -> TrainerConfig:  # type: ignore[no-untyped-def]
    return TrainerConfig(
        model=str(model),
        device="cuda",
        precision="bf16",
        threads_per_rank=1,
        metrics_file=None,
        optim={"name": "adamw", "lr": 1e-3},
        batch={"micro_batch_rows": 3},
        **extra,
    )


def test_one_bf16_step_on_cuda_changes_the_fp32_weights_and_stays_finite(tmp_path: Path) -> None:
    trainer = PolicyTrainer(config(tiny_qwen2(tmp_path / "qwen2")))
    weights = dict(trainer.named_weights())
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())
    before = {k: v.detach().clone() for k, v in weights.items()}
    result = trainer.train(batch())
    assert result.steps == 1 and result.skipped_steps == 0, result
    after = dict(trainer.named_weights())
    assert all(torch.isfinite(v).all() for v in after.values())
    moved = [k for k in before if not torch.equal(before[k].cpu(), after[k].detach().cpu())]
    assert len(moved) > len(before) // 2, moved


@gpus(2)
def test_fsdp2_on_nccl_matches_one_rank_and_halves_the_state(tmp_path: Path) -> None:
    from laminar.roles.trainer.dp import DataParallelGroup

    model = tiny_qwen2(tmp_path / "qwen2")
    one = PolicyTrainer(config(model, precision="fp32"))
    one.train(batch())
    group = DataParallelGroup(
        config(model, precision="fp32", data_parallel=2, sharding="fsdp"), timeout_s=120
    )
    try:
        group.train(batch())
        sharded, replicated = group.state_bytes(), one.state_bytes()
        for kind in ("params", "grads", "optimizer"):
            assert sharded[kind] <= 0.55 * replicated[kind], (kind, sharded, replicated)
        ref = {k: v.detach().cpu() for k, v in one.named_weights()}
        got = {k: v.detach().cpu() for k, v in group.weights()}
        assert got.keys() == ref.keys()
        for name in ref:  # the all-reduced mean in another order: fp32 rounding, times lr
            assert (got[name] - ref[name]).abs().max() < 0.02 * 1e-3, name
    finally:
        group.close()
