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


def test_chunked_logprobs_match_the_full_log_softmax_under_bf16_on_cuda(tmp_path: Path) -> None:
    """The default (chunked) logprobs against the whole log-softmax, on the GPU, in bf16
    autocast: the same logprobs and the same gradients on the fp32 master weights."""
    from laminar.rl import token_logprobs

    trainer = PolicyTrainer(config(tiny_qwen2(tmp_path / "qwen2")))
    part = batch().to(trainer.device)
    grads = {}
    for method in ("full", "chunked"):
        trainer.model.zero_grad()
        logp, ent = token_logprobs(
            trainer._run(trainer.model), part, temperature=0.8, with_entropy=True, method=method
        )
        assert ent is not None
        ((logp * part.advantages).sum() + 0.01 * ent.sum()).backward()
        grads[method] = (
            logp.detach(),
            {n: p.grad.clone() for n, p in trainer.model.named_parameters()},
        )
    torch.testing.assert_close(grads["chunked"][0], grads["full"][0], atol=1e-4, rtol=1e-4)
    for name, want in grads["full"][1].items():
        torch.testing.assert_close(grads["chunked"][1][name], want, atol=1e-4, rtol=1e-2)


def test_compiled_layers_and_fused_logprobs_train_like_the_plain_trainer(tmp_path: Path) -> None:
    """``trainer.compile`` and ``logprobs: fused`` on CUDA: the same parameter names, and one
    bf16 step lands where the plain trainer's does (to bf16 kernel differences, times lr)."""
    model = tiny_qwen2(tmp_path / "qwen2")
    plain = PolicyTrainer(config(model))
    fused = PolicyTrainer(config(model, compile=True, logprobs="fused"))
    assert [n for n, _ in plain.named_weights()] == [n for n, _ in fused.named_weights()]
    a, b = plain.train(batch()), fused.train(batch())
    assert a.steps == b.steps == 1 and b.skipped_steps == 0
    for (name, x), (_, y) in zip(plain.named_weights(), fused.named_weights(), strict=True):
        assert torch.isfinite(y).all(), name
        assert (x - y).abs().max() < 5e-3, name  # lr 1e-3: at most a few steps' worth apart
