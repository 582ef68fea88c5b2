"""Data-parallel ranks (real processes) skip the same non-finite optimizer steps. What the trainer
must never learn from is ``tests/unit/test_trainer_integrity.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laminar.roles.trainer.compute import PolicyTrainer
from laminar.roles.trainer.dp import DataParallelGroup
from tests.unit.test_trainer_integrity import TIS, config, poisoned, same, weights

from ..support.models import tiny_qwen2


@pytest.mark.integration  # spawns the second rank
def test_data_parallel_ranks_agree_on_skipping(tmp_path: Path) -> None:
    """Only rank 1 sees the poisoned row (rank r takes rows r, r+2, ...): rank 0 must skip too,
    and afterwards the two replicas still train exactly like one rank."""
    model = tiny_qwen2(tmp_path / "model")
    cfg = config(model, loss=TIS, optim={"name": "sgd", "lr": 0.5}, data_parallel=2)
    group = DataParallelGroup(cfg, timeout_s=60)
    try:
        before = weights(group.trainer)
        _, packed = poisoned([1])
        result = group.train(packed)  # type: ignore[arg-type]
        assert result.skipped_steps == 1
        assert same(weights(group.trainer), before), "rank 0 stepped while rank 1 had a NaN loss"
        _, clean = poisoned([])
        group.train(clean)  # type: ignore[arg-type]
        two = weights(group.trainer)
    finally:
        group.close()
    single = PolicyTrainer(config(model, loss=TIS, optim={"name": "sgd", "lr": 0.5}))
    single.train(clean)  # type: ignore[arg-type]
    for name, value in weights(single).items():
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-6)
