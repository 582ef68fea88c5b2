"""How long the GPU work of a model-free engine would take: decode steps and prefill.

Why a table and not a roofline: what matters to scheduling is the *shape* of decode latency
against batch size — nearly flat while decode is memory-bound, then rising once it turns
compute-bound — and that shape is what the paper measured. The default table is the paper's
Fig. 4 (a 7B model, TP=1, one H800, sequence length 4096)::

    batch     1      64     128    256
    step    ~7 ms  ~12.5   ~18    ~30 ms

Between points the time is interpolated linearly; beyond the last point it is extrapolated along
the last segment (the compute-bound slope); below the first point it is the first point's time (a
step has a floor: the weights are read once whatever the batch).

Two optional linear terms sit on top:

* ``context_s_per_token`` — seconds per step per token of context held by the batch (attention
  reads the whole KV cache every step). Default 0: Fig. 4 was measured at a fixed 4096-token
  context, so the table already includes a typical attention cost. For a physical estimate, a
  Qwen2.5-7B-like model (28 layers, 4 KV heads of 128, bf16) holds 56 KiB of KV per token; at
  ~3.3 TB/s that is ~1.7e-8 s per token of context per step.
* ``prefill_s_per_token`` — seconds per prompt token prefilled (compute-bound: ~14 GFLOP per
  token for 7B at ~50% of an H800's ~990 TFLOP/s gives ~70k tokens/s). Default 2e-5 s
  (50k tokens/s), plus ``prefill_base_s`` per prefill (default 0).

Everything here is pure: no clock, no engine. :func:`step_time` and :func:`prefill_time` evaluate
the default model.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import pairwise
from typing import Annotated

from pydantic import Field, model_validator

from laminar.runtime.config import Strict

__all__ = [
    "DEFAULT_COST_MODEL",
    "PAPER_FIG4_7B",
    "CostModel",
    "TrainCostModel",
    "prefill_time",
    "step_time",
]

# (decode batch size, seconds per decode step): paper Fig. 4, 7B on one H800 at seq len 4096.
PAPER_FIG4_7B: list[tuple[int, float]] = [(1, 0.007), (64, 0.0125), (128, 0.018), (256, 0.030)]


class CostModel(Strict):
    """Decode step time from batch size and context; prefill time from prompt tokens."""

    batch_points: list[tuple[Annotated[int, Field(ge=1)], Annotated[float, Field(gt=0)]]] = Field(
        default_factory=lambda: list(PAPER_FIG4_7B),
        description="(batch size, seconds per decode step), batch sizes increasing. "
        "Linear in between, extrapolated along the last segment beyond the last point.",
    )
    context_s_per_token: Annotated[float, Field(ge=0)] = Field(
        0.0, description="Seconds per decode step per token of context held by the batch."
    )
    prefill_s_per_token: Annotated[float, Field(ge=0)] = Field(
        2e-5, description="Seconds per prompt token prefilled (default: 50k tokens/s)."
    )
    prefill_base_s: Annotated[float, Field(ge=0)] = Field(
        0.0, description="Fixed seconds added to any step that prefills at least one token."
    )

    @model_validator(mode="after")
    def _increasing(self) -> CostModel:
        if not self.batch_points:
            raise ValueError("batch_points needs at least one (batch size, seconds) point")
        sizes = [b for b, _ in self.batch_points]
        if any(b2 <= b1 for b1, b2 in pairwise(sizes)):
            raise ValueError(f"batch_points batch sizes must increase strictly, got {sizes}")
        return self

    def batch_time(self, batch_size: int) -> float:
        """Seconds of one decode step of ``batch_size`` sequences, ignoring context."""
        if batch_size <= 0:
            return 0.0
        points = self.batch_points
        if batch_size <= points[0][0] or len(points) == 1:  # the floor (or a one-point table)
            return points[0][1]
        i = bisect_right([b for b, _ in points], batch_size)
        if i >= len(points):  # beyond the last point: extend the last segment
            (b0, t0), (b1, t1) = points[-2], points[-1]
        else:
            (b0, t0), (b1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)

    def step_time(self, batch_size: int, context_tokens: int = 0) -> float:
        """Seconds of one decode step: the batch table plus the context term."""
        if batch_size <= 0:
            return 0.0
        return self.batch_time(batch_size) + self.context_s_per_token * context_tokens

    def prefill_time(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` prompt tokens (0 for none)."""
        if tokens <= 0:
            return 0.0
        return self.prefill_base_s + self.prefill_s_per_token * tokens


DEFAULT_COST_MODEL = CostModel()


def step_time(batch_size: int, context_tokens: int = 0, model: CostModel | None = None) -> float:
    """Seconds of one decode step under ``model`` (default: the paper's Fig. 4 table)."""
    return (model or DEFAULT_COST_MODEL).step_time(batch_size, context_tokens)


def prefill_time(tokens: int, model: CostModel | None = None) -> float:
    """Seconds to prefill ``tokens`` prompt tokens under ``model`` (default: 2e-5 s/token)."""
    return (model or DEFAULT_COST_MODEL).prefill_time(tokens)


# -- training -------------------------------------------------------------------------------------
#
# The sim trainer (roles/trainer/sim_compute.py) sleeps for ``TrainCostModel.train_time(tokens)``.
# The default constants describe the paper's 7B setting (Qwen2.5-7B, FSDP on H800s):
#
# * FLOPs per trained token: 6 N for forward + backward plus 2 N for the forward that recomputes
#   the old policy's logprobs (GRPO; no reference model), N = 7.6e9 parameters -> 8 N = 6.1e10.
# * H800 dense bf16 peak 989 TFLOP/s at 35% model-FLOPs utilisation (typical of FSDP + Ulysses
#   on long sequences) -> 3.5e14 FLOP/s per GPU -> ~5.7k tokens/s per GPU.
# * ``base_s``: a fixed cost per update (optimizer step, gradient all-reduce, offload): 2 s.
#
# Cross-check: 8 training GPUs then train ~45k tokens/s; the paper's Laminar 7B run on 16 GPUs
# (8 train / 8 rollout) reached ~35k trained tokens/s (Fig. 11), i.e. at or below that rate.

H800_BF16_FLOPS = 989e12
QWEN25_7B_PARAMS = 7.6e9


class TrainCostModel(Strict):
    """Seconds of one training update of a global batch, from its tokens and the GPU count."""

    flops_per_token: Annotated[float, Field(gt=0)] = Field(
        8 * QWEN25_7B_PARAMS,
        description="FLOPs per trained token (default 8 N: fwd + bwd + old-logprob forward, 7B).",
    )
    gpu_flops: Annotated[float, Field(gt=0)] = Field(
        H800_BF16_FLOPS, description="Peak FLOP/s of one GPU (default: H800 dense bf16)."
    )
    mfu: Annotated[float, Field(gt=0, le=1)] = Field(
        0.35, description="Model-FLOPs utilisation reached by training."
    )
    gpus: Annotated[int, Field(ge=1)] = Field(8, description="GPUs the trainer runs on.")
    base_s: Annotated[float, Field(ge=0)] = Field(
        2.0, description="Fixed seconds per update (optimizer step, all-reduce), as slept."
    )
    time_scale: Annotated[float, Field(gt=0)] = Field(
        1.0,
        description="Multiplies the per-token term: an emulation that divides lengths by L and "
        "multiplies decode step times by S sets S (each emulated token then stands for L real "
        "ones at S/L of real time, as in decoding) and base_s to 2 S / L.",
    )

    def tokens_per_s(self) -> float:
        """Trained tokens per second of the whole trainer (unscaled)."""
        return self.gpus * self.gpu_flops * self.mfu / self.flops_per_token

    def train_time(self, tokens: int) -> float:
        """Seconds (scaled) to train one update on ``tokens`` tokens (prompt + response)."""
        if tokens <= 0:
            return 0.0
        return self.base_s + self.time_scale * tokens / self.tokens_per_s()
