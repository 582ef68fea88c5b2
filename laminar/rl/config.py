"""The RL math's settings, apart from the math: validating a config must not import torch.

``laminar run`` and ``laminar doctor`` check every role's config before anything starts; the
trainer's config holds these, so they live here, beside (not inside) the torch modules that use
them (:mod:`.losses`, :mod:`.screen`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from laminar.runtime.config import Strict

#: what one excluded trajectory takes with it (:func:`laminar.rl.screen.screen_batch`).
ExcludeScope = Literal["trajectory", "group"]


class PolicyLossConfig(Strict):
    clip_low: float = Field(0.2, ge=0, lt=1, description="ε_low: ratio clipped below at 1 - ε_low.")
    clip_high: float = Field(
        0.28, ge=0, description="ε_high: ratio clipped above at 1 + ε_high (DAPO Clip-Higher)."
    )
    objective: Literal["ppo", "cispo", "topr"] = Field(
        "ppo",
        description="ppo: the clipped surrogate; cispo: REINFORCE weighted by the clipped, "
        "detached ratio (MiniMax-M1); topr: tapered off-policy REINFORCE (ROLL Flash).",
    )
    cispo_clip_high: float = Field(
        4.0, gt=0, description="CISPO's weight is min(ratio, 1 + this) (objective=cispo)."
    )
    off_policy: Literal["none", "tis", "decoupled"] = Field(
        "none", description="Off-policy correction: none, truncated IS, or decoupled PPO."
    )
    tis_cap: float = Field(2.0, gt=0, description="Truncation of the TIS weight (off_policy=tis).")
    decoupled_cap: float | None = Field(
        None, gt=0, description="Drop tokens whose behaviour weight exceeds this (decoupled)."
    )
    aggregation: Literal["token_mean", "seq_mean"] = Field(
        "token_mean",
        description="token_mean: every token weighs the same; seq_mean: every response does.",
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the reference policy.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")


#: ``trainer.logprobs: auto`` takes logprobs a chunk of positions at a time (the logits never
#: whole) from this vocabulary size up, on any device: such logits outweigh the activations
CHUNKED_VOCAB = 32768
