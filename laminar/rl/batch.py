"""Packing trajectories into right-padded tensors for the loss.

Why this layout: a causal LM's logits at position ``t - 1`` predict token ``t``. Every per-token
tensor here is indexed by the position of the *predicted token*: at a response position ``t``,
``loss_mask[b, t] = 1``, ``behaviour_logprobs[b, t]`` is the rollout's ``log p(input_ids[b, t])``
and ``advantages[b, t]`` is the trajectory's advantage. :func:`laminar.rl.token_logprobs` returns
its values on the same grid (value at ``t`` is ``log p(input_ids[t] | input_ids[:t])``), so the
loss is plain elementwise arithmetic with no shifting anywhere else.

A multi-turn episode's environment turns (``Trajectory.env_spans``: tool output, observations)
sit in the response as context and get ``loss_mask`` 0, like the prompt.

Rows are ``prompt + response`` padded on the right with ``pad_id``. Right padding keeps the
positions of real tokens at ``0..len-1``, so a model needs no ``position_ids``; padding tokens are
excluded by ``attention_mask`` (long, 1 for real tokens, as HF models expect) and never predicted
(``loss_mask`` is 0 there). A trajectory must have a non-empty prompt: the first response token
needs a context to be predicted from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from laminar.trajectory import Trajectory

from .screen import finite32


@dataclass
class PackedBatch:
    """A right-padded batch; all tensors are ``[B, T]`` on the same grid (see module doc).

    ``input_ids`` long; ``attention_mask`` long (1 = real token); ``loss_mask`` float (1.0 at
    response tokens); ``behaviour_logprobs`` and ``advantages`` float, 0 outside the response.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor

    @property
    def n_tokens(self) -> int:
        """Number of loss (response) tokens in the batch."""
        return int(self.loss_mask.sum().item())

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: slice | list[int]) -> PackedBatch:
        """The sub-batch of ``rows`` (for mini- and micro-batches); keeps the padded width."""
        if isinstance(rows, list):
            index = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)
            return PackedBatch(
                *(getattr(self, f.name).index_select(0, index) for f in fields(self))
            )
        return PackedBatch(*(getattr(self, f.name)[rows] for f in fields(self)))

    def trimmed(self) -> PackedBatch:
        """The same rows cut to their longest real row: a micro-batch of short rows must not pay
        for the global batch's longest one (with long-tailed lengths that is most of the work)."""
        width = int(self.attention_mask.sum(dim=1).max().item()) if self.batch_size else 0
        return PackedBatch(*(getattr(self, f.name)[:, :width] for f in fields(self)))

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def _check(trajectory: Trajectory) -> None:
    n_resp, n_lp = len(trajectory.response_token_ids), len(trajectory.logprobs)
    if n_resp != n_lp:
        raise ValueError(
            f"trajectory {trajectory.trajectory_id}: {n_resp} response tokens but {n_lp} logprobs"
        )
    if not trajectory.prompt_token_ids:
        raise ValueError(f"trajectory {trajectory.trajectory_id}: empty prompt")
    if not finite32(trajectory.logprobs):
        raise ValueError(  # one NaN token makes the whole gradient NaN (laminar.rl.screen)
            f"trajectory {trajectory.trajectory_id}: non-finite behaviour logprobs"
        )


def pack(
    trajectories: Sequence[Trajectory], advantages: Sequence[float], pad_id: int = 0
) -> PackedBatch:
    """Pack ``trajectories`` (one row each, in order) with one scalar advantage per trajectory."""
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    if not trajectories:
        raise ValueError("cannot pack an empty batch")
    for t in trajectories:
        _check(t)
    width = max(len(t.prompt_token_ids) + len(t.response_token_ids) for t in trajectories)
    shape = (len(trajectories), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    behaviour = torch.zeros(shape, dtype=torch.float32)
    adv = torch.zeros(shape, dtype=torch.float32)
    for row, (t, a) in enumerate(zip(trajectories, advantages, strict=True)):
        start = len(t.prompt_token_ids)
        end = start + len(t.response_token_ids)
        input_ids[row, :end] = torch.tensor(t.prompt_token_ids + t.response_token_ids)
        attention_mask[row, :end] = 1
        loss_mask[row, start:end] = 1.0
        for lo, hi in t.env_spans:  # the environment's turns: context, not trained on
            loss_mask[row, start + lo : start + hi] = 0.0
        behaviour[row, start:end] = torch.tensor(t.logprobs, dtype=torch.float32)
        adv[row, start:end] = float(a)
    return PackedBatch(input_ids, attention_mask, loss_mask, behaviour, adv)
