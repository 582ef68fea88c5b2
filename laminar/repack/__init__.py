"""Dynamic repack: which rollouts' long-tail trajectories to consolidate, and where (pure)."""

from .planner import Move, RepackPlan, RepackPolicy, RolloutLoad, is_candidate, plan_repack

__all__ = ["Move", "RepackPlan", "RepackPolicy", "RolloutLoad", "is_candidate", "plan_repack"]
