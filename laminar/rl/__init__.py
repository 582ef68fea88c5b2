"""RL math for the trainer: advantages, batch packing, token logprobs and the policy loss.

Pure torch, no I/O and no asyncio: the trainer role calls these inside its executor. Every
per-token tensor shares one grid, described in :mod:`laminar.rl.batch`.

The names below load their module (and torch) on first use, not when the package is imported:
:mod:`laminar.rl.config`, which validating a trainer's config needs, imports this package first,
and a config check must not cost a torch import (seconds before ``laminar run`` rejects a typo).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .advantages import grpo_advantages
    from .batch import PackedBatch, pack
    from .config import ExcludeScope, PolicyLossConfig
    from .logprobs import token_logprobs
    from .losses import LossStats, k3, policy_loss
    from .screen import Screened, screen_batch

#: each public name -> the submodule that defines it.
_HOMES = {
    "grpo_advantages": "advantages",
    "PackedBatch": "batch",
    "pack": "batch",
    "ExcludeScope": "config",
    "PolicyLossConfig": "config",
    "token_logprobs": "logprobs",
    "LossStats": "losses",
    "k3": "losses",
    "policy_loss": "losses",
    "Screened": "screen",
    "screen_batch": "screen",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once: later reads are plain module attributes
    return value
