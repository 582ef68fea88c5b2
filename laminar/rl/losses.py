"""The clipped policy-gradient loss, with corrections for off-policy rollouts.

Why corrections are needed: in an asynchronous system a trajectory may be sampled by an older
weight version than the one being trained, and always by a different kernel (vLLM vs the trainer's
forward), so the *behaviour* policy ``μ`` (``behaviour_logprobs``) differs from the policy the
trainer believes it is improving. At the start of every step the trainer recomputes, without grad,
``old_logprobs`` ``π_old`` (the *proximal* policy) with its current weights; ``logprobs`` ``π_θ``
are the same computation with grad. Three modes (``PolicyLossConfig.off_policy``):

* ``none`` (the paper's default, verl-like) — PPO/DAPO clipping against ``π_old``:
  ``r = exp(logp - old_logp)``, per-token loss ``-min(r A, clip(r, 1 - ε_low, 1 + ε_high) A)``.
  Behaviour logprobs only feed metrics.
* ``tis`` — truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): the same loss times ``w = min(exp(old_logp - behaviour_logp),
  tis_cap)`` per token, detached. It corrects the trainer/rollout mismatch with bounded variance.
* ``decoupled`` — decoupled PPO (Hilton et al.; AReaL): clip against the proximal policy and weight
  by the full behaviour importance weight ``w = exp(old_logp - behaviour_logp)`` (detached). With
  ``decoupled_cap`` set, tokens whose ``w`` exceeds it are dropped from the loss (AReaL's
  behaviour-weight cap) rather than truncated.

The objective (``PolicyLossConfig.objective``): ``ppo`` is the clipped surrogate above. Two
REINFORCE-style objectives from ROLL Flash's off-policy study (arXiv 2510.11345) replace it; both
let the gradient flow through ``log π_θ`` only, with a detached per-token weight, so no token's
gradient is ever clipped to zero:

* ``cispo`` (MiniMax-M1, arXiv 2506.13585): ``-sg(min(r, 1 + cispo_clip_high)) · A · logp``, the
  importance ratio ``r = exp(logp - old_logp)`` clipped (from above only, as MiniMax does) and
  detached. PPO drops the gradient of a token whose ratio left the trust region; CISPO keeps it,
  bounded by the clipped weight, which matters for the rare tokens (reflection words) that
  decide a long trace.
* ``topr`` (Tapered Off-Policy REINFORCE, Le Roux et al., arXiv 2503.14286): per trajectory,
  ``-w · A · logp`` with ``w = 1`` when ``A >= 0`` (positive samples: a plain SFT-like update,
  however off-policy) and ``w = min(1, exp(Σ_t (logp_t - behaviour_t)))`` (detached) when
  ``A < 0`` (negative samples: truncated importance sampling over the whole trajectory, so an
  unlikely bad sample cannot push the policy hard). TOPR is defined on the reward's sign; with
  group-normalised advantages the advantage's sign is used (above or below the group's mean).

``off_policy`` weights (``tis``, ``decoupled``) multiply any objective's per-token loss.

Optional terms: ``kl_coef * k3`` to a reference policy, ``k3 = exp(ref - logp) - (ref - logp) - 1``
(unbiased, non-negative, low variance), and an entropy bonus ``- entropy_coef * H``.

Aggregation (``PolicyLossConfig.aggregation``):

* ``token_mean`` (DAPO): ``loss = Σ per_token · mask / total_tokens``; every token weighs the same,
  so a 300-token response pulls ten times harder than a 30-token one.
* ``seq_mean``: each response's mean over its own tokens, then the mean over responses,
  ``loss = Σ_rows (Σ_t per_token / len_row) / total_sequences``; every response weighs the same,
  so a few long responses cannot dominate an update. Its known cost (Dr. GRPO's length bias): a
  long wrong response is penalised less per token than a short one, so rambling is cheap, and
  with several PPO epochs responses can grow to the length cap (docs/benchmarks.md,
  *Learning*).

``total_tokens`` / ``total_sequences`` are passed in rather than read off the mask so the caller
can use the count of the *whole mini-batch* across gradient-accumulation micro-batches and data-
parallel ranks: then each micro-batch's loss is its exact share of the mini-batch loss, and
summing gradients over micro-batches and all-reducing them with SUM over ranks gives exactly the
1-rank, 1-micro-batch update.

Statistics are token *sums* (:class:`LossStats`) so they can be merged and all-reduced before
dividing. A token counts as *clipped* when the clipped branch is strictly the larger loss, i.e.
when clipping zeroes that token's gradient: ``r > 1 + ε_high`` with ``A > 0`` or ``r < 1 - ε_low``
with ``A < 0``. ``clip_frac = clipped / tokens``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .config import PolicyLossConfig


@dataclass
class LossStats:
    """Token sums of one loss evaluation; merge across micro-batches/ranks, then ``as_means``."""

    tokens: float = 0.0
    clipped: float = 0.0
    mismatch_kl_sum: float = 0.0
    entropy_sum: float = 0.0
    ratio_sum: float = 0.0
    is_weight_sum: float = 0.0
    masked_out: float = 0.0
    kl_ref_sum: float = 0.0

    def merge(self, other: LossStats) -> LossStats:
        a, b = asdict(self), asdict(other)
        return LossStats(**{k: a[k] + b[k] for k in a})

    def as_tensor(self) -> torch.Tensor:
        """The sums as one float64 vector (for ``all_reduce(SUM)``); see :meth:`from_tensor`."""
        return torch.tensor(list(asdict(self).values()), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> LossStats:
        return cls(*(float(v) for v in t.tolist()))

    def as_means(self) -> dict[str, float]:
        """Per-token means; ``masked_frac`` is the share of tokens dropped by the decoupled cap."""
        n = max(self.tokens, 1.0)
        return {
            "clip_frac": self.clipped / n,
            "mismatch_kl": self.mismatch_kl_sum / n,
            "entropy": self.entropy_sum / n,
            "ratio": self.ratio_sum / n,
            "is_weight": self.is_weight_sum / n,
            "masked_frac": self.masked_out / n,
            "kl_ref": self.kl_ref_sum / n,
        }


def _is_weight(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached per-token weight and a keep-mask (False where the decoupled cap drops a token)."""
    log_w = (old_logprobs - behaviour_logprobs).detach()
    keep = torch.ones_like(log_w, dtype=torch.bool)
    if cfg.off_policy == "none":
        return torch.ones_like(log_w), keep
    w = torch.exp(log_w)
    if cfg.off_policy == "tis":
        return w.clamp(max=cfg.tis_cap), keep
    if cfg.decoupled_cap is not None:
        keep = w <= cfg.decoupled_cap
    return torch.where(keep, w, torch.zeros_like(w)), keep


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ || π_ref) (Schulman): ``exp(d) - d - 1``, d = ref - logp."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    total_tokens: float,
    total_sequences: float | None = None,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Scalar loss (``cfg.aggregation``; see the module docstring) and its token-sum statistics.

    All tensors are ``[B, T]`` on the :class:`~laminar.rl.PackedBatch` grid; only ``logprobs``
    (and ``entropy``) carry gradient. ``total_tokens`` must be > 0, and so must
    ``total_sequences`` (responses with at least one loss token) for ``seq_mean``.
    """
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
    if cfg.aggregation == "seq_mean" and not (total_sequences and total_sequences > 0):
        raise ValueError(f"seq_mean needs total_sequences > 0, got {total_sequences}")
    mask = loss_mask > 0
    # Zero everything outside the response first: prompt/pad values (e.g. a behaviour logprob of
    # 0 against a recomputed -9) must not reach exp() and leak inf/nan through the gradient.
    logprobs = _outside_zero(logprobs, mask)
    old = _outside_zero(old_logprobs.detach(), mask)
    behaviour_logprobs = _outside_zero(behaviour_logprobs.detach(), mask)
    weight_mask = loss_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)

    ratio = torch.exp(logprobs - old)
    per_token, is_clipped = _objective(cfg, logprobs, ratio, adv, behaviour_logprobs, mask)

    w, keep = _is_weight(old, behaviour_logprobs, cfg)
    per_token = per_token * w
    kl_ref = None
    if cfg.kl_coef > 0 and ref_logprobs is not None:
        kl_ref = k3(logprobs, _outside_zero(ref_logprobs.detach(), mask))
        per_token = per_token + cfg.kl_coef * kl_ref
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy

    used = mask & keep
    per_token = torch.where(used, per_token, torch.zeros_like(per_token)) * weight_mask
    if cfg.aggregation == "seq_mean":
        row_tokens = weight_mask.sum(dim=1, keepdim=True).clamp(min=1)
        assert total_sequences is not None  # checked on entry
        loss = (per_token / row_tokens).sum() / total_sequences
    else:
        loss = per_token.sum() / total_tokens
    stats = _stats(mask, keep, is_clipped, ratio, w, old, behaviour_logprobs, entropy, kl_ref)
    return loss, stats


def _objective(
    cfg: PolicyLossConfig,
    logprobs: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of ``cfg.objective`` (module docstring) and where its weight was clipped."""
    if cfg.objective == "ppo":
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        return torch.maximum(unclipped, clipped), (clipped > unclipped) & mask
    if cfg.objective == "cispo":
        weight = ratio.detach().clamp(max=1 + cfg.cispo_clip_high)
        return -weight * adv * logprobs, (ratio.detach() > 1 + cfg.cispo_clip_high) & mask
    # topr: one weight per trajectory (row), from its whole log-ratio to the behaviour policy
    log_ratio = torch.where(mask, logprobs.detach() - behaviour, torch.zeros_like(logprobs))
    seq_ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True).clamp(max=0.0))  # min(1, ratio)
    negative = adv < 0
    weight = torch.where(negative, seq_ratio.expand_as(adv), torch.ones_like(adv))
    return -weight * adv * logprobs, negative & (weight < 1) & mask


def _outside_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(torch.where(mask, x.detach().double(), 0.0).sum().item())


def _stats(
    mask: torch.Tensor,
    keep: torch.Tensor,
    is_clipped: torch.Tensor,
    ratio: torch.Tensor,
    w: torch.Tensor,
    old: torch.Tensor,
    behaviour: torch.Tensor,
    entropy: torch.Tensor | None,
    kl_ref: torch.Tensor | None,
) -> LossStats:
    return LossStats(
        tokens=float(mask.sum().item()),
        clipped=float((is_clipped & keep).sum().item()),
        mismatch_kl_sum=_masked_sum(behaviour - old, mask),
        entropy_sum=_masked_sum(entropy, mask) if entropy is not None else 0.0,
        ratio_sum=_masked_sum(ratio, mask),
        is_weight_sum=_masked_sum(w, mask),
        masked_out=float((mask & ~keep).sum().item()),
        kl_ref_sum=_masked_sum(kl_ref, mask) if kl_ref is not None else 0.0,
    )
