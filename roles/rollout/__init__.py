"""The rollout role: one generation engine fed by the data role, weights from the local relay."""

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
