"""The trainer's settings: validated once, at startup, with the reason in every error."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from laminar.config import ServiceConfig, Strict
from laminar.rl import PolicyLossConfig
from laminar.weights.publisher import PublishConfig


class BatchConfig(Strict):
    prompts: Annotated[int, Field(ge=1)] = Field(8, description="Prompt groups per global batch.")
    samples: Annotated[int, Field(ge=1)] = Field(
        4, description="Samples per prompt (the data role's samples_per_prompt)."
    )
    mini_batches: Annotated[int, Field(ge=1)] = Field(
        1, description="Optimizer steps per global batch (each on 1/mini_batches of the rows)."
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
    name: Literal["adamw", "sgd"] = "adamw"
    lr: Annotated[float, Field(gt=0)] = 1e-5
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: Annotated[float, Field(gt=0)] = 1e-8
    grad_clip: Annotated[float, Field(gt=0)] | None = Field(
        1.0, description="Clip the global gradient norm (unset: no clipping)."
    )


class CheckpointConfig(Strict):
    dir: str = Field("runs/latest/checkpoints", description="Where checkpoints are written.")
    every: Annotated[int, Field(ge=1)] = Field(1, description="Checkpoint every N versions.")
    keep: Annotated[int, Field(ge=1)] = Field(2, description="Checkpoints kept on disk.")


class TrainerConfig(ServiceConfig):
    model: str = Field(description="HF model directory (the initial policy).")
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    normalize_advantages: bool = Field(
        True, description="GRPO: divide by the group's reward std (false: Dr.GRPO, mean only)."
    )
    temperature: Annotated[float, Field(gt=0)] = Field(
        1.0, description="The rollouts' sampling temperature (logprobs are of that distribution)."
    )
    data_parallel: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="Data-parallel ranks (processes; gloo on CPU, NCCL on GPU)."
    )
    threads_per_rank: Annotated[int, Field(ge=1)] | None = Field(
        None, description="torch threads per rank (default: cores / ranks)."
    )
    seed: int = 0
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)
    max_versions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Stop after publishing this version (unset: run until data ends)."
    )
    sample_wait_s: Annotated[float, Field(gt=0, le=600)] = 2.0
    data: str | None = Field(None, description="The data role's address (default: ask manager).")
    metrics_file: str | None = Field(
        "runs/latest/trainer.jsonl", description="One JSON line per version (unset: none)."
    )
