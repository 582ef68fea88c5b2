"""RL math for the trainer: advantages, batch packing, token logprobs and the policy loss.

Pure torch, no I/O and no asyncio: the trainer role calls these inside its executor. Every
per-token tensor shares one grid, described in :mod:`laminar.rl.batch`.
"""

from .advantages import grpo_advantages
from .batch import PackedBatch, pack
from .logprobs import token_logprobs
from .losses import LossStats, PolicyLossConfig, k3, policy_loss
from .screen import ExcludeScope, Screened, screen_batch

__all__ = [
    "ExcludeScope",
    "LossStats",
    "PackedBatch",
    "PolicyLossConfig",
    "Screened",
    "grpo_advantages",
    "k3",
    "pack",
    "policy_loss",
    "screen_batch",
    "token_logprobs",
]
