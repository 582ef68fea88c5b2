"""One rank's share of a policy update: the torch work, with no asyncio and no RPC.

A global batch (whole GRPO groups) is split into ``mini_batches`` optimizer steps, and the
steps are repeated ``epochs`` times (PPO epochs: more updates per generated sample, which the
clipped ratio keeps near π_old). Every rank gets
every step's rows but computes only its own slice (rank r takes rows r, r+W, r+2W, ...), in
micro-batches of ``micro_batch_rows``. Rows are grouped by length before they are cut into
micro-batches, and each micro-batch is trimmed to its own longest row: with long-tailed lengths
(one 500-token row among 50-token ones) a fixed global width made the padding most of the work.
Grouping does not change the update: the gradient is a sum over tokens. The loss of each
micro-batch is normalised by the token count of the *whole mini-batch over all ranks*
(``laminar.rl.losses``), so after an all-reduce SUM of the gradients every rank holds exactly
the gradient a single rank would have computed on the whole mini-batch, and identical optimizer
steps keep the replicas identical. That is the
property the 1-rank vs 2-rank test checks.

π_old (the proximal policy of the loss) is recomputed once per global batch, before the first
step, with the weights the rollouts were asked to catch up to. With one mini-batch the first
step's own forward pass *is* that recomputation (same weights, no dropout), so its detached
logprobs serve and the extra pass is skipped (with one epoch: a second epoch needs π_old). The
reference policy (KL term) is a frozen copy of the initial weights, loaded only when
``kl_coef > 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from laminar.rl import LossStats, PackedBatch, policy_loss, token_logprobs

from .config import TrainerConfig


@dataclass
class StepResult:
    stats: dict[str, float]
    grad_norm: float
    tokens: int


def load_policy(path: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


class PolicyTrainer:
    """The policy, its optimizer and the update rule for one rank."""

    def __init__(self, config: TrainerConfig, rank: int = 0, world: int = 1) -> None:
        self.config = config
        self.rank, self.world = rank, world
        torch.manual_seed(config.seed)
        self.model = load_policy(config.model)
        self.model.train()
        o = config.optim
        self.optimizer: torch.optim.Optimizer
        if o.name == "sgd":
            self.optimizer = torch.optim.SGD(
                self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay
            )
        else:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=o.lr,
                betas=o.betas,
                eps=o.eps,
                weight_decay=o.weight_decay,
            )
        self.reference: torch.nn.Module | None = None
        if config.loss.kl_coef > 0:
            self.reference = load_policy(config.model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)

    # -- state -------------------------------------------------------------------------------

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.state_dict().items())

    def load_state(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optim_state)

    # -- the update --------------------------------------------------------------------------

    def _mine(self, rows: range) -> list[int]:
        return list(rows)[self.rank :: self.world]

    def _micro(self, batch: PackedBatch, rows: list[int]) -> list[list[int]]:
        """``rows`` cut into micro-batches of similar length (longest first)."""
        n = self.config.batch.micro_batch_rows
        lengths = batch.attention_mask.sum(dim=1).tolist()
        ordered = sorted(rows, key=lambda r: -lengths[r])
        return [ordered[i : i + n] for i in range(0, len(ordered), n)]

    @torch.no_grad()
    def _recompute(
        self, model: torch.nn.Module, batch: PackedBatch, rows: list[int]
    ) -> torch.Tensor:
        out = torch.zeros_like(batch.behaviour_logprobs)
        was_training = model.training
        model.eval()
        for micro in self._micro(batch, rows):
            part = batch.select(micro).trimmed()
            lp, _ = token_logprobs(model, part, temperature=self.config.temperature)
            out[micro, : lp.shape[1]] = lp
        model.train(was_training)
        return out

    def train(self, batch: PackedBatch) -> StepResult:
        """All optimizer steps of one global batch; merged statistics (equal on every rank)."""
        cfg = self.config
        total = batch.batch_size
        per_step = math.ceil(total / cfg.batch.mini_batches)
        steps = [range(s, min(s + per_step, total)) for s in range(0, total, per_step)]
        mine = [r for step in steps for r in self._mine(step)]
        # One step in all: the step's own forward pass gives π_old (see the module docstring).
        once = len(steps) == 1 and cfg.batch.epochs == 1
        old = None if once else self._recompute(self.model, batch, mine)
        ref = self._recompute(self.reference, batch, mine) if self.reference is not None else None
        for p in self.model.parameters():  # every rank all-reduces the same list, even if idle
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        stats, norms = LossStats(), []
        for step in steps * cfg.batch.epochs:
            step_mask = batch.loss_mask[list(step)]
            step_tokens = float(step_mask.sum())
            step_sequences = float((step_mask.sum(dim=1) > 0).sum())
            if step_tokens == 0:
                continue
            self.optimizer.zero_grad(set_to_none=False)
            for micro in self._micro(batch, self._mine(step)):
                part = batch.select(micro).trimmed()
                width = part.input_ids.shape[1]
                logprobs, entropy = token_logprobs(
                    self.model, part, temperature=cfg.temperature, with_entropy=True
                )
                loss, s = policy_loss(
                    logprobs,
                    logprobs.detach() if old is None else old[micro, :width],
                    part.behaviour_logprobs,
                    part.advantages,
                    part.loss_mask,
                    cfg.loss,
                    total_tokens=step_tokens,
                    total_sequences=step_sequences,
                    entropy=entropy,
                    ref_logprobs=ref[micro, :width] if ref is not None else None,
                )
                loss.backward()
                stats = stats.merge(s)
            self._all_reduce_grads()
            norms.append(self._clip_and_step())
        if self.world > 1:
            summed = stats.as_tensor()
            dist.all_reduce(summed)
            stats = LossStats.from_tensor(summed)
        means = stats.as_means()
        return StepResult(
            stats=means,
            grad_norm=float(sum(norms) / max(len(norms), 1)),
            tokens=int(stats.tokens) // cfg.batch.epochs,  # each epoch sees the same tokens
        )

    def _all_reduce_grads(self) -> None:
        if self.world == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _clip_and_step(self) -> float:
        clip = self.config.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        self.optimizer.step()
        return float(norm)
