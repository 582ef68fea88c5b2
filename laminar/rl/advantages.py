"""Group-relative advantages (GRPO and Dr.GRPO).

Why group-relative: GRPO samples several responses per prompt and uses the group's mean reward as
the baseline, so no value model is needed and prompts of different difficulty are comparable.
Dividing by the group's standard deviation (GRPO) rescales every group to unit spread; Dr.GRPO
argues that this division biases the update towards groups with low variance (too easy or too
hard prompts) and keeps only the centring (``normalize_std=False``).

Choices:

* The standard deviation is the *population* one (``correction=0``), so a normalised group has
  exactly zero mean and unit (population) standard deviation, and a group of two gives +-1.
* A group whose rewards are all equal (including a group of one) carries no learning signal: its
  advantages are exactly 0 in both modes, never ``tiny / eps``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _group_index(group_ids: Sequence[str]) -> tuple[torch.Tensor, int]:
    """Map each group id to a dense index 0..G-1, in order of first appearance."""
    dense: dict[str, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[str],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-trajectory advantages: ``(r - mean_g) / (std_g + eps)``, or ``r - mean_g``.

    ``rewards`` is a 1-D tensor aligned with ``group_ids`` (usually the prompt id of each
    trajectory). Groups are independent of one another and of the order of the rows. The result is
    float32 (or the float dtype of ``rewards``) with the shape of ``rewards``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if len(group_ids) != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {len(group_ids)} group ids")
    r = rewards.float() if not rewards.is_floating_point() else rewards
    if r.numel() == 0:
        return r.clone()
    index, n_groups = _group_index(group_ids)
    index = index.to(r.device)

    def group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, index, x)

    count = group_sum(torch.ones_like(r))
    mean = group_sum(r) / count
    centred = r - mean[index]
    lo = torch.full((n_groups,), float("inf"), dtype=r.dtype, device=r.device)
    hi = torch.full((n_groups,), float("-inf"), dtype=r.dtype, device=r.device)
    lo = lo.scatter_reduce(0, index, r, reduce="amin")
    hi = hi.scatter_reduce(0, index, r, reduce="amax")
    constant = (hi == lo)[index]
    if normalize_std:
        std = (group_sum(centred * centred) / count).sqrt()
        centred = centred / (std[index] + eps)
    return torch.where(constant, torch.zeros_like(centred), centred)
