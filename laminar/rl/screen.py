"""Screening a batch before the loss: what must not be trained on, and why.

Why a screen: two kinds of trajectory look like ordinary data but would corrupt the update.

* **No reward** (``reward`` is None or ``reward_error`` is set: the reward function raised or
  timed out, or returned NaN/inf). Training on it as 0.0 teaches the policy that the answer was
  wrong when nobody knows; a reward that times out on long answers would push every long answer
  down. Such a trajectory is excluded.
* **Non-finite behaviour logprobs** (NaN or +-inf from the rollout engine). They enter the loss
  through the importance weights and the mismatch statistics, and one NaN token makes the whole
  gradient NaN. Such a trajectory is excluded.

What happens to the rest of its GRPO group (``scope``):

* ``trajectory`` (the default): only the bad trajectory goes. The others keep a group-relative
  baseline computed over the members that remain, which is still an unbiased baseline for them
  (GRPO with a smaller group; dynamic-sampling systems train on uneven groups all the time), and
  their reward signal is not thrown away because of an infrastructure failure of a sibling. A
  group left with one member has advantage 0 (:func:`grpo_advantages`), so it adds nothing.
* ``group``: the whole group goes. Choose it when failures correlate with the answer (a reward
  that times out mostly on wrong, looping answers): the remaining members' mean is then biased
  upwards and their advantages downwards, and dropping the group is the conservative choice.

Excluded trajectories are named per reason, so the trainer can count them, record their ids in
its history (they were consumed, deliberately not trained) and alert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from laminar.trajectory import Trajectory

from .config import ExcludeScope

# Why a trajectory was excluded (metric labels and history keys; keep them stable).
REWARD_FAILED = "reward_failed"
LOGPROBS_NONFINITE = "logprobs_nonfinite"
GROUP_OF_EXCLUDED = "group_of_excluded"
REASONS = (REWARD_FAILED, LOGPROBS_NONFINITE, GROUP_OF_EXCLUDED)


@dataclass
class Screened:
    """The trajectories to train on (in batch order), their rewards, and the excluded ids."""

    kept: list[Trajectory] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    excluded: dict[str, list[str]] = field(default_factory=dict)  # reason -> trajectory ids

    @property
    def excluded_count(self) -> int:
        return sum(len(ids) for ids in self.excluded.values())


def finite32(values: Sequence[float]) -> bool:
    """Finite once stored as float32, as the trainer stores them (1e300 is finite as a Python
    float and ``inf`` in the packed batch)."""
    with np.errstate(over="ignore"):  # the overflow to inf is what this looks for
        return bool(np.isfinite(np.asarray(values, dtype=np.float32)).all())


def exclusion_reason(t: Trajectory) -> str | None:
    """Why ``t`` must not be trained on (None: it may). Logprobs are checked first: a trajectory
    with both faults is counted once, under the one that says the rollout produced garbage."""
    if not finite32(t.logprobs):
        return LOGPROBS_NONFINITE
    if t.reward_error is not None or t.reward is None or not finite32([t.reward]):
        return REWARD_FAILED
    return None


def screen_batch(batch: Sequence[Trajectory], scope: ExcludeScope = "trajectory") -> Screened:
    """Split ``batch`` into what to train on and what to exclude (see the module docstring)."""
    reasons = {t.trajectory_id: exclusion_reason(t) for t in batch}
    poisoned_groups = {t.prompt_id for t in batch if reasons[t.trajectory_id] is not None}
    out = Screened()
    for t in batch:
        reason = reasons[t.trajectory_id]
        if reason is None and scope == "group" and t.prompt_id in poisoned_groups:
            reason = GROUP_OF_EXCLUDED
        if reason is not None:
            out.excluded.setdefault(reason, []).append(t.trajectory_id)
            continue
        assert t.reward is not None
        out.kept.append(t)
        out.rewards.append(float(t.reward))
    return out
