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

Device and precision (``device``, ``precision``, ``activation_checkpointing``): the policy, the
reference and each batch live on the rank's device (``cuda``: GPU ``rank mod count``). Under
``bf16`` only the model's forward (and so its backward) runs in bf16 autocast; the weights, their
gradients, the optimizer states and the log-softmax over the vocabulary stay fp32, the usual mixed
precision with an fp32 master copy. π_old is recomputed under the same precision as the training
forward, so the ratio starts at 1. Gradient accumulation is the micro-batch loop: a step's
micro-batches (``micro_batch_rows`` each) add their gradients before the one optimizer step.

A step whose loss or gradient norm is not finite is *skipped*: its gradients are zeroed, the
optimizer does not step (its moments stay untouched too) and its statistics are dropped. One NaN
reaching ``optimizer.step()`` would turn every weight NaN, and the next checkpoint and every
rollout with it. Ranks must agree, or their replicas diverge: each rank's "my loss was not
finite" rides in the gradient all-reduce as one extra element, and the norm is taken of the
all-reduced gradient, which is the same on every rank; so every rank skips the same steps. The
other steps of the global batch still apply (see :class:`StepResult`).

Publishing does not stop training: :meth:`PolicyTrainer.copy_out` copies the weights into the
publisher's buffer on a background thread while the next step's forward and backward run, and
the optimizer step waits for that copy first (:mod:`.staging`); ``weights_wait_s`` reports the
wait.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from laminar.proc.heap import release_freed_heap
from laminar.rl import (
    LossStats,
    PackedBatch,
    Screened,
    grpo_advantages,
    pack,
    policy_loss,
    screen_batch,
    token_logprobs,
)
from laminar.rl.config import CHUNKED_VOCAB
from laminar.rl.logprobs import Method
from laminar.trajectory import Trajectory
from laminar.weights.manifest import WeightManifest

from .checkpoint import load_training_state
from .config import TrainerConfig
from .device import Precision, load_policy, resolve_device
from .published import published_keys, resolve_dtype
from .sharding import (
    full,
    full_tensors,
    gathered_optimizer_state,
    load_sharded,
    load_sharded_optimizer,
    load_sharded_policy,
    lockstep,
    optimizer_state_by_name,
    optimizer_state_by_position,
    own_rows,
    read_slices,
    set_gradient_sync,
    weight_specs,
)
from .staging import Fence, copy_plan, whole_tensors
from .step import StepResult

__all__ = ["PolicyTrainer", "StepResult", "packed", "prepare"]


def packed(screened: Screened, config: TrainerConfig) -> PackedBatch:
    """The kept trajectories as one batch, with GRPO advantages computed over the kept members
    of each group only (a failed sibling is not a wrong answer: :mod:`laminar.rl.screen`)."""
    advantages = grpo_advantages(
        torch.tensor(screened.rewards, dtype=torch.float32),
        [t.prompt_id for t in screened.kept],
        normalize_std=config.normalize_advantages,
    )
    return pack(screened.kept, advantages.tolist(), pad_id=0)


def prepare(batch: list[Trajectory], config: TrainerConfig) -> tuple[Screened, PackedBatch | None]:
    """Screen a sampled batch and pack what may be trained on (None: nothing may be)."""
    screened = screen_batch(batch, config.exclude_scope)
    return screened, packed(screened, config) if screened.kept else None


class PolicyTrainer:
    """The policy, its optimizer and the update rule for one rank."""

    def __init__(self, config: TrainerConfig, rank: int = 0, world: int = 1) -> None:
        self.config = config
        self.rank, self.world = rank, world
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device, rank)
        # FSDP2 (``sharding: fsdp``): one rank alone has nothing to shard with. Sharded, each
        # rank reads only its slices, and before the optimizer: it must hold the shards.
        self.sharded = config.sharding == "fsdp" and world > 1
        self.model = self._load(config.model, config.activation_checkpointing, config.compile)
        self.model.train()
        self.publish_dtype = resolve_dtype(config.publish.dtype)
        published_keys(self.model)  # a model whose checkpoint layout cannot be published: now
        o = config.optim
        self.optimizer: torch.optim.Optimizer
        if o.name == "sgd":
            self.optimizer = torch.optim.SGD(
                self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay
            )
        else:
            # fused: one kernel per parameter, no temporaries of its size (the update of a large
            # vocabulary's embedding otherwise allocated two more copies of it); not for
            # sharded parameters, whose DTensors take the per-tensor path
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=o.lr,
                betas=o.betas,
                eps=o.eps,
                weight_decay=o.weight_decay,
                fused=not self.sharded,
            )
        # a publish's background copy; the optimizer step waits for it (:mod:`.staging`)
        self.fence = Fence(f"weights-copy-r{rank}")
        self.weights_wait_s = 0.0  # the last update's wait for such a copy
        self.reference: torch.nn.Module | None = None
        if config.loss.kl_coef > 0:
            self.reference = self._load(config.model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)

    def _load(
        self, path: str, activation_checkpointing: bool = False, compile: bool = False
    ) -> torch.nn.Module:
        if self.sharded:
            return load_sharded_policy(
                path, self.device, self.rank, self.world,
                activation_checkpointing=activation_checkpointing, compile=compile,
            )  # fmt: skip
        return load_policy(
            path, self.device, activation_checkpointing=activation_checkpointing, compile=compile
        )

    # -- state -------------------------------------------------------------------------------
    # Sharded, each of these is a collective: every rank of the group calls it (:mod:`.dp`).

    def weight_specs(self) -> list[tuple[str, torch.dtype, list[int]]]:
        """Name, dtype and whole shape of each tensor :meth:`weights` yields (nothing gathered)."""
        return weight_specs(self.model, self.publish_dtype)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The published weights (:mod:`.published`) as whole host tensors, one at a time."""
        return full_tensors(self.model, self.publish_dtype)

    def copy_out(
        self, manifest: WeightManifest, view: memoryview, then: Callable[[], object] | None = None
    ) -> Future[None]:
        """Copy the weights into ``view`` (laid out by ``manifest``) in the background, then call
        ``then``; the next optimizer step waits for it (:mod:`.staging`). Sharded, this rank
        writes only its own rows (every rank calls it with the same buffer); replicated, all of
        them. Call it between steps, from the thread that trains."""
        if self.sharded:
            plan = own_rows(self.model, manifest, self.rank, self.world)
        else:
            plan = whole_tensors(self.model, manifest)

        def copy() -> None:
            copy_plan(plan, view)
            if then is not None:
                then()

        return self.fence.start(copy, self.device)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """All the published weights at once (tests, evaluation helpers)."""
        return list(self.weights())

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Whole model and optimizer state dicts (the optimizer's keyed by parameter name); under
        sharding only rank 0 gets them (the other ranks get empty dicts)."""
        names = [n for n, _ in self.model.named_parameters()]
        if not self.sharded:
            return self.model.state_dict(), optimizer_state_by_name(
                self.optimizer.state_dict(), names
            )
        model_state = {k: full(v.detach()).cpu() for k, v in self.model.state_dict().items()}
        optim_state = gathered_optimizer_state(self.model, self.optimizer)
        return (model_state, optim_state) if self.rank == 0 else ({}, {})

    def close(self) -> None:
        """Finish a copy under way and stop its thread."""
        self.fence.close()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of the parameters, their gradients and the optimizer states
        (sharded: its own slices): what sharding divides by W."""

        def local(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = list(self.model.parameters())
        return {
            "params": sum(local(p) for p in params),
            "grads": sum(local(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(
                local(v)
                for state in self.optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0  # not Adam's step counters
            ),
        }

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from a checkpoint directory. Sharded, each rank reads its own rows of the
        weights, and the optimizer state is memory-mapped, so no rank holds it all at once."""
        if not self.sharded:
            self.load_state(*load_training_state(path))
            return
        self.fence.wait()
        read_slices(self.model, path, self.rank, self.world)
        optim = torch.load(Path(path) / "optimizer.pt", weights_only=True, mmap=True)
        load_sharded_optimizer(self.model, self.optimizer, optim)

    def load_state(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        self.fence.wait()  # a copy under way reads the weights this replaces
        if self.sharded:
            load_sharded(self.model, self.optimizer, model_state, optim_state)
            return
        self.model.load_state_dict(model_state)
        names = [n for n, _ in self.model.named_parameters()]
        self.optimizer.load_state_dict(optimizer_state_by_position(optim_state, names))

    # -- the update --------------------------------------------------------------------------

    def logprobs_method(self) -> Method:
        """``trainer.logprobs``, with ``auto`` resolved for this rank's device and model:
        ``chunked`` on CUDA (memory is what limits a GPU's micro-batches) and for a vocabulary of
        :data:`CHUNKED_VOCAB` or more (whose logits outweigh the model's activations), ``full``
        for a small vocabulary on CPU (where it measured faster: docs/benchmarks.md, *The trainer
        on a GPU*). Read at every call, so a changed config applies at the next step."""
        method = self.config.logprobs
        if method == "auto":
            vocab = int(getattr(self.model.config, "vocab_size", 0) or 0)
            large = self.device.type == "cuda" or vocab >= CHUNKED_VOCAB
            return "chunked" if large else "full"
        return method

    def _run(self, model: torch.nn.Module) -> Any:
        return Precision(model, self.device, self.config.precision)

    def _mine(self, rows: range | list[int], rank: int | None = None) -> list[int]:
        return list(rows)[self.rank if rank is None else rank :: self.world]

    def _micro(self, batch: PackedBatch, rows: list[int]) -> list[list[int]]:
        """``rows`` cut into micro-batches of similar length (longest first)."""
        n = self.config.batch.micro_batch_rows
        lengths = batch.attention_mask.sum(dim=1).tolist()
        ordered = sorted(rows, key=lambda r: -lengths[r])
        return [ordered[i : i + n] for i in range(0, len(ordered), n)]

    def _plan(self, batch: PackedBatch, steps: list[range]) -> list[list[int] | None]:
        """This rank's micro-batches over ``steps``. Sharded, padded with ``None`` (a micro-batch
        that contributes nothing) to the most any rank has, since every forward and backward is
        a collective (:mod:`.sharding`); every rank holds the whole batch, so each works out the
        others' counts itself."""

        def rows_of(rank: int) -> list[int]:
            return [r for step in steps for r in self._mine(step, rank)]

        mine = self._micro(batch, rows_of(self.rank))
        if not self.sharded:
            return list(mine)
        most = lockstep([self._micro(batch, rows_of(r)) for r in range(self.world)])
        return [*mine, *[None] * (most - len(mine))]

    @staticmethod
    def _padding(batch: PackedBatch, rows: list[int]) -> PackedBatch:
        """One real row with nothing to learn from: what a padding micro-batch runs."""
        part = batch.select(rows[:1]).trimmed()
        part.loss_mask.zero_()
        part.advantages.zero_()
        return part

    @torch.no_grad()
    def _recompute(
        self, model: torch.nn.Module, batch: PackedBatch, steps: list[range]
    ) -> torch.Tensor:
        out = torch.zeros_like(batch.behaviour_logprobs)
        was_training = model.training
        model.eval()
        for micro in self._plan(batch, steps):
            part = batch.select(micro if micro is not None else [0]).trimmed()
            lp, _ = token_logprobs(
                self._run(model), part,
                temperature=self.config.temperature, method=self.logprobs_method(),
            )  # fmt: skip
            if micro is not None:
                out[micro, : lp.shape[1]] = lp
        model.train(was_training)
        return out

    def train(self, batch: PackedBatch) -> StepResult:
        """All optimizer steps of one global batch; merged statistics (equal on every rank)."""
        cfg = self.config
        batch = batch.to(self.device)
        total = batch.batch_size
        per_step = math.ceil(total / cfg.batch.mini_batches)
        steps = [range(s, min(s + per_step, total)) for s in range(0, total, per_step)]
        # One step in all: the step's own forward pass gives π_old (see the module docstring).
        once = len(steps) == 1 and cfg.batch.epochs == 1
        old = None if once else self._recompute(self.model, batch, steps)
        ref = self._recompute(self.reference, batch, steps) if self.reference is not None else None
        for p in self.model.parameters():  # every rank all-reduces the same list, even if idle
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        stats, norms, taken, skipped = LossStats(), [], 0, 0
        self.weights_wait_s = 0.0
        for step in steps * cfg.batch.epochs:
            step_mask = batch.loss_mask[list(step)]
            step_tokens = float(step_mask.sum())
            step_sequences = float((step_mask.sum(dim=1) > 0).sum())
            if step_tokens == 0:
                continue
            self.optimizer.zero_grad(set_to_none=False)
            step_stats, finite = LossStats(), True
            micros = self._plan(batch, [step])
            for i, micro in enumerate(micros):
                set_gradient_sync(self.model, i == len(micros) - 1)  # reduce once per step
                if micro is None:  # sharded: this rank's share ran out, the others' did not
                    lp, _ = token_logprobs(
                        self._run(self.model), self._padding(batch, list(step)),
                        temperature=cfg.temperature, method=self.logprobs_method(),
                    )  # fmt: skip
                    (lp.sum() * 0.0).backward()
                    continue
                part = batch.select(micro).trimmed()
                width = part.input_ids.shape[1]
                logprobs, entropy = token_logprobs(
                    self._run(self.model), part,
                    temperature=cfg.temperature, with_entropy=True, method=self.logprobs_method(),
                )  # fmt: skip
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
                if not torch.isfinite(loss):
                    finite = False  # the step is lost (every rank skips it, see below)
                    if not self.sharded:  # its backward would only spread the NaN
                        continue
                loss.backward()  # sharded: even a NaN one, or the other ranks' reduce hangs
                if finite:
                    step_stats = step_stats.merge(s)
            taken += 1
            norm = self._clip_and_step(self._all_reduce_grads(finite))
            if norm is None:
                skipped += 1
                continue
            norms.append(norm)
            stats = stats.merge(step_stats)
        if self.world > 1:
            summed = stats.as_tensor().to(self.device)  # NCCL reduces device tensors only
            dist.all_reduce(summed)
            stats = LossStats.from_tensor(summed.cpu())
        means = stats.as_means()
        release_freed_heap()  # the step's activations and temporaries (laminar.proc.heap)
        return StepResult(
            stats=means,
            grad_norm=float(sum(norms) / len(norms)) if norms else None,
            tokens=int(stats.tokens) // cfg.batch.epochs,  # each epoch sees the same tokens
            steps=taken,
            skipped_steps=skipped,
            weights_wait_s=self.weights_wait_s,
        )

    def _all_reduce_grads(self, finite: bool) -> bool:
        """Sum the gradients over ranks; True when every rank's loss was finite."""
        if self.world == 1:
            return finite
        if self.sharded:  # the backward already reduce-scattered (summed) each shard
            flag = torch.tensor([0.0 if finite else 1.0], device=self.device)
            dist.all_reduce(flag)
            return bool(flag[0] == 0)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flag = torch.tensor([0.0 if finite else 1.0], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([*(g.reshape(-1) for g in grads), flag])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return bool(flat[-1] == 0)

    def _clip_and_step(self, finite: bool) -> float | None:
        """Clip and step; None (and no step, gradients zeroed) when anything is not finite."""
        clip = self.config.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [g for p in params if (g := p.grad) is not None]
        norm = full(torch.nn.utils.get_total_norm(grads))  # sharded: reduced
        if not finite or not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=False)
            return None
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        self.weights_wait_s += self.fence.wait()  # a publish's copy must be out first
        self.optimizer.step()
        return float(norm)
