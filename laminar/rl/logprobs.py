"""Per-token log-probabilities (and entropies) of a batch under the trainer's model.

Why a dedicated function: the same computation serves three purposes — the differentiable
``logp`` inside the loss, the no-grad ``old_logprobs`` (the proximal policy) recomputed at the
start of a step, and a reference model's ``ref_logprobs`` — and all three must sit on exactly the
grid of :class:`laminar.rl.PackedBatch` (value at ``t`` = ``log p(input_ids[t] | input_ids[:t])``;
position 0 has no prediction and is 0). Logits are divided by the sampling temperature and
normalised in float32 so that they match what the rollout engine sampled from, whatever the
model's dtype.
"""

from __future__ import annotations

import torch

from .batch import PackedBatch


def token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` logprobs of ``batch.input_ids`` (and the entropy of each predicting distribution).

    Differentiable through ``model`` unless called under ``torch.no_grad()``. Positions that are
    padding or position 0 are 0 in both outputs. ``model`` is an HF causal LM (anything whose call
    with ``input_ids``/``attention_mask`` returns an object with ``.logits`` of ``[B, T, V]``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = batch.input_ids[:, 1:].unsqueeze(-1)
    logp = logp_all.gather(-1, targets).squeeze(-1)
    valid = batch.attention_mask[:, 1:].bool()
    logp = _shift_in(torch.where(valid, logp, torch.zeros_like(logp)))
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    entropy = _shift_in(torch.where(valid, entropy, torch.zeros_like(entropy)))
    return logp, entropy


def _shift_in(x: torch.Tensor) -> torch.Tensor:
    """Prepend a zero column: the value predicted from position ``t - 1`` lands at ``t``."""
    return torch.nn.functional.pad(x, (1, 0), value=0.0)
