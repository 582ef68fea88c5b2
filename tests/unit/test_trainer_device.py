"""The trainer's device, precision and activation checkpointing (issue 17, item 1), on CPU.

Two architecture families (Qwen2, Llama; tiny random configs made here), one GRPO step each:
* activation checkpointing recomputes instead of storing, so the update is the same (fp32);
* bf16 autocast trains with fp32 master weights and optimizer states (published weights stay
  fp32) and moves the weights the way the fp32 step does, within bf16's precision;
* ``device: auto`` is the CPU here, and ``cuda`` without a GPU is a clear error.
The GPU path itself runs in ``tests/gpu`` where a GPU exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laminar.rl import grpo_advantages, pack
from laminar.roles.trainer.compute import PolicyTrainer
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.device import resolve_device
from laminar.trajectory import Trajectory

from ..support.models import tiny_llama, tiny_qwen2

ARCHS = {"qwen2": tiny_qwen2, "llama": tiny_llama}


def batch(n: int = 8):  # type: ignore[no-untyped-def]
    trajectories = [
        Trajectory(
            trajectory_id=f"g{i // 4}/{i % 4}",
            prompt_id=f"g{i // 4}",
            sample_index=i % 4,
            prompt_token_ids=[5, 6, 7, 3 + i],
            response_token_ids=[8 + i, 9, 10, 11 + i % 3][: 2 + i % 3],
            logprobs=[-1.0, -2.0, -0.5, -1.5][: 2 + i % 3],
            version=0,
            finish_reason="stop",
            queued_at=0,
            started_at=0,
            finished_at=0,
            reward=float(i % 2),
        )
        for i in range(n)
    ]
    rewards = torch.tensor([t.reward for t in trajectories])
    adv = grpo_advantages(rewards, [t.prompt_id for t in trajectories])
    return pack(trajectories, adv.tolist())


def step(model: Path, **extra) -> tuple[PolicyTrainer, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    config = TrainerConfig(
        model=str(model),
        threads_per_rank=1,
        metrics_file=None,
        optim={"name": "adamw", "lr": 1e-3},
        batch={"micro_batch_rows": 3},  # three micro-batches add up before the step
        **extra,
    )
    trainer = PolicyTrainer(config)
    before = {k: v.clone() for k, v in trainer.named_weights()}
    result = trainer.train(batch())
    assert result.steps == 1 and result.skipped_steps == 0, result
    return trainer, {k: v - before[k] for k, v in trainer.named_weights()}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_activation_checkpointing_gives_the_same_update(tmp_path: Path, arch: str) -> None:
    model = ARCHS[arch](tmp_path / arch)
    _, plain = step(model)
    trainer, checkpointed = step(model, activation_checkpointing=True)
    assert trainer.model.is_gradient_checkpointing
    for name, delta in plain.items():
        torch.testing.assert_close(checkpointed[name], delta, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_trains_with_fp32_master_weights_like_fp32(tmp_path: Path, arch: str) -> None:
    model = ARCHS[arch](tmp_path / arch)
    _, fp32 = step(model)
    trainer, bf16 = step(model, precision="bf16")
    weights = dict(trainer.named_weights())
    assert all(w.dtype == torch.float32 for w in weights.values())
    states = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and all(t.dtype == torch.float32 for t in states)
    # the same step, in bf16's precision: the update points the same way and is as large
    a = torch.cat([d.flatten() for d in fp32.values()])
    b = torch.cat([bf16[k].flatten() for k in fp32])
    assert not torch.equal(a, b), "bf16 autocast changed nothing: was it on?"
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.9
    assert 0.8 < float(b.norm() / a.norm()) < 1.25


def test_auto_is_the_cpu_here_and_cuda_without_a_gpu_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu covers the cuda path")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"trainer\.device is cuda but torch sees no GPU"):
        resolve_device("cuda")


def test_compile_compiles_each_decoder_layer_in_place_and_keeps_the_names(tmp_path: Path) -> None:
    """``trainer.compile`` (checked without running a compiled step: that takes a minute of
    this CPU; ``tests/gpu`` runs one): every decoder layer, and nothing else, is compiled in
    place, so the parameter names (what versions and checkpoints carry) do not change."""
    model = tiny_qwen2(tmp_path / "qwen2")

    def trainer(compile: bool) -> PolicyTrainer:
        return PolicyTrainer(
            TrainerConfig(model=str(model), threads_per_rank=1, metrics_file=None, compile=compile)
        )

    plain, compiled = trainer(False), trainer(True)
    assert [n for n, _ in compiled.named_weights()] == [n for n, _ in plain.named_weights()]
    kinds = {
        type(m).__name__ for m in compiled.model.modules() if m._compiled_call_impl is not None
    }
    assert kinds == {"Qwen2DecoderLayer"}
    assert all(m._compiled_call_impl is None for m in plain.model.modules())


def test_auto_logprobs_are_full_on_cpu_and_an_explicit_method_is_kept(tmp_path: Path) -> None:
    model = tiny_qwen2(tmp_path / "qwen2")

    def method(**extra) -> str:  # type: ignore[no-untyped-def]
        config = TrainerConfig(model=str(model), threads_per_rank=1, metrics_file=None, **extra)
        return PolicyTrainer(config).logprobs_method()

    assert method() == "full"  # auto, on this CPU (chunked on CUDA: tests/gpu)
    assert method(logprobs="chunked") == "chunked" and method(logprobs="fused") == "fused"
