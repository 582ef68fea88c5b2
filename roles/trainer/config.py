"""The trainer's settings (the torch trainer's, the emulated one's, a rank's): validated once, at
startup, with the reason in every error.

No torch here, nor anything that imports it: ``laminar run`` and ``laminar doctor`` validate every
role's config before starting anything (``laminar.roles_registry.load_role_config``), and a typo
should be answered in a second, not after a torch import."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from laminar.engines.costmodel import TrainCostModel
from laminar.rl.config import ExcludeScope, PolicyLossConfig
from laminar.roles.manager.api import MAX_SEAT_WAIT_S
from laminar.runtime.config import ServiceConfig, Strict
from laminar.tracking import TrackingConfig
from laminar.weights.config import PublishConfig


class BatchConfig(Strict):
    prompts: Annotated[int, Field(ge=1)] = Field(8, description="Prompt groups per global batch.")
    samples: Annotated[int, Field(ge=1)] = Field(
        4, description="Samples per prompt (the data role's samples_per_prompt)."
    )
    mini_batches: Annotated[int, Field(ge=1)] = Field(
        1, description="Optimizer steps per global batch (each on 1/mini_batches of the rows)."
    )
    epochs: Annotated[int, Field(ge=1)] = Field(
        1, description="Passes over each global batch (PPO epochs): epochs x mini_batches steps."
    )
    micro_batch_rows: Annotated[int, Field(ge=1)] = Field(
        16, description="Rows per forward/backward pass (gradient accumulation bounds memory)."
    )

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    @model_validator(mode="after")
    def _divisible(self) -> BatchConfig:
        if self.prompts % self.mini_batches:
            raise ValueError(
                f"prompts ({self.prompts}) must be a multiple of mini_batches "
                f"({self.mini_batches}): a mini-batch holds whole groups"
            )
        return self


class OptimConfig(Strict):
    name: Literal["adamw", "sgd"] = Field("adamw", description="The torch optimizer.")
    lr: Annotated[float, Field(gt=0)] = Field(1e-5, description="Learning rate.")
    weight_decay: Annotated[float, Field(ge=0)] = Field(0.0, description="Weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's betas.")
    eps: Annotated[float, Field(gt=0)] = Field(1e-8, description="AdamW's epsilon.")
    grad_clip: Annotated[float, Field(gt=0)] | None = Field(
        1.0, description="Clip the global gradient norm (unset: no clipping)."
    )


class CheckpointConfig(Strict):
    dir: str = Field("runs/latest/checkpoints", description="Where checkpoints are written.")
    every: Annotated[int, Field(ge=1)] = Field(1, description="Checkpoint every N versions.")
    keep: Annotated[int, Field(ge=1)] = Field(2, description="Checkpoints kept on disk.")


class EvalConfig(Strict):
    """Held-out accuracy of the live policy, measured by the trainer itself (greedy decoding of
    its in-memory model between versions, so what is measured is exactly what was published)."""

    task: str = Field(description="Task module (`path/to/task.py`, a directory with task.py).")
    n: Annotated[int, Field(ge=1)] = Field(200, description="Held-out records per evaluation.")
    seed: int = Field(0, description="Which held-out records (the task's test split, this seed).")
    data: str | None = Field(None, description="A JSONL file of records instead of the split.")
    every_s: Annotated[float, Field(gt=0)] = Field(
        120.0, description="Evaluate when this long has passed since the last evaluation."
    )
    at_start: bool = Field(True, description="Evaluate the starting weights before training.")
    batch_size: Annotated[int, Field(ge=1)] = Field(50, description="Records per generate call.")


class TrainerConfig(ServiceConfig):
    model: str = Field(description="HF model directory (the initial policy).")
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    normalize_advantages: bool = Field(
        True, description="GRPO: divide by the group's reward std (false: Dr.GRPO, mean only)."
    )
    exclude_scope: ExcludeScope = Field(
        "trajectory",
        description="A trajectory without a reward (it failed) or with non-finite logprobs is "
        "not trained on; `group`: its whole GRPO group is left out too (laminar/rl/screen.py).",
    )
    temperature: Annotated[float, Field(gt=0)] = Field(
        1.0, description="The rollouts' sampling temperature (logprobs are of that distribution)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the policy trains: `cuda` (rank r on GPU r mod the visible count), "
        "`cpu`, or `auto` (cuda when torch sees a GPU, else cpu).",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="`bf16`: forward and backward under bf16 autocast; weights, gradients and "
        "optimizer states stay fp32 (the master copy); versions are published in "
        "publish.dtype.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward instead of keeping "
        "them (HF gradient checkpointing): less memory for about one more forward pass.",
    )
    compile: bool = Field(
        False,
        description="Compile each decoder layer with torch.compile (dynamic shapes; needs Triton "
        "on CUDA, a C++ compiler on CPU): fewer, fused kernels, for a compilation of seconds "
        "to a minute at start.",
    )
    logprobs: Literal["auto", "chunked", "fused", "full"] = Field(
        "auto",
        description="How token logprobs and entropies are taken from the logits: `chunked` "
        "works through them a few hundred positions at a time in float32 (for a model whose "
        "logits are a plain linear head, the head too, so the logits never exist whole; else "
        "only the logits are kept for backward); `fused`: the same with its chunk functions "
        "compiled by torch.compile (needs Triton on CUDA, a C++ compiler on CPU); `full` "
        "upcasts and log-softmaxes the whole [batch, length, vocab] at once (several float32 "
        "copies alive until backward; on a CPU with a small vocabulary the fastest); `auto`: "
        "chunked on CUDA and for vocabularies of 32768 or more, else full. Same numbers "
        "(laminar/rl/logprobs.py).",
    )
    data_parallel: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="Data-parallel ranks (processes; gloo on CPU, NCCL on GPU)."
    )
    sharding: Literal["replicate", "fsdp"] = Field(
        "replicate",
        description="`replicate`: every rank holds the whole model and optimizer (gradients "
        "all-reduced); `fsdp`: FSDP2, each of the data_parallel ranks holds 1/W of the "
        "parameters, gradients and optimizer states (roles/trainer/sharding.py).",
    )
    ranks: Literal["spawn", "serve"] = Field(
        "spawn",
        description="Where ranks 1..data_parallel-1 run: `spawn`: child processes of the "
        "trainer, on its host; `serve`: each its own `laminar serve --role trainer_rank` "
        "process on any host, meeting through the manager (docs/training.md).",
    )
    threads_per_rank: Annotated[int, Field(ge=1)] | None = Field(
        None, description="torch threads per rank (default: cores / ranks)."
    )
    seed: int = Field(0, description="torch's manual seed.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)
    max_versions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Stop after publishing this version (unset: run until data ends)."
    )
    sample_wait_s: Annotated[float, Field(gt=0, le=600)] = Field(
        2.0, description="How long one batch request waits at the data role for trajectories."
    )
    data: str | None = Field(None, description="The data role's address (default: ask manager).")
    eval: EvalConfig | None = Field(
        None, description="Periodic held-out accuracy (unset: none); lines with `eval` in metrics."
    )
    metrics_file: str | None = Field(
        "runs/latest/trainer.jsonl", description="One JSON line per version (unset: none)."
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="The metrics file's lines as TensorBoard/W&B scalars (docs/training.md).",
    )


class SimTrainerConfig(ServiceConfig):
    batch: BatchConfig = Field(default_factory=BatchConfig)
    cost: TrainCostModel = Field(default_factory=TrainCostModel)
    weight_bytes: Annotated[int, Field(ge=1024, le=64 << 30)] = Field(
        64 << 20, description="Bytes published per version (one bf16 tensor of this size)."
    )
    publish: PublishConfig = Field(default_factory=PublishConfig)
    max_versions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Stop after this version (unset: run until stopped)."
    )
    sample_wait_s: Annotated[float, Field(gt=0, le=600)] = Field(
        2.0, description="How long one batch request waits at the data role for trajectories."
    )
    data: str | None = Field(None, description="The data role's address (default: ask manager).")
    metrics_file: str | None = Field(
        None, description="One JSON line per version (unset: none; `status` has them too)."
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="The metrics file's lines as TensorBoard/W&B scalars (docs/training.md).",
    )
    state_file: str | None = Field(
        None,
        description="Where the version and data cursor are kept across restarts, as a real "
        "checkpoint keeps them (unset: a restart trains on everything again from version 0).",
    )


class TrainerRankConfig(ServiceConfig):
    group: str = Field("trainer", description="The trainer group to serve in (one per trainer).")
    seat_wait_s: Annotated[float, Field(gt=0, le=MAX_SEAT_WAIT_S)] = Field(
        5.0, description="How long one seat request waits at the manager before asking again."
    )
