"""The rollout role: one generation engine fed by the data role, weights from the local relay.

The contracts (:mod:`.api`) load with the package; the service loads on first use of
``RolloutService`` or ``RolloutConfig``, so the manager and tools that only talk to rollouts do
not load the rollout's implementation (its engines, its migration) with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .api import (
    Handoff,
    HandoffReply,
    LoadedWeights,
    MigratedSequence,
    MigrateReport,
    MigrateRequest,
    RolloutApi,
    RolloutState,
    WeightsHistory,
)

if TYPE_CHECKING:
    from .service import RolloutConfig, RolloutService

__all__ = [
    "Handoff",
    "HandoffReply",
    "LoadedWeights",
    "MigrateReport",
    "MigrateRequest",
    "MigratedSequence",
    "RolloutApi",
    "RolloutConfig",
    "RolloutService",
    "RolloutState",
    "WeightsHistory",
]


def __getattr__(name: str) -> Any:
    if name in ("RolloutConfig", "RolloutService"):
        from . import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
