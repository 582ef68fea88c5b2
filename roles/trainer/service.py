"""The trainer role: consume whole groups as they complete, update, checkpoint, publish; repeat.

One owned task, ``train``, runs the loop; ``publish`` (the weight publisher) pushes each new
version to the master relay in the background. Per version:

1. **sample** ``prompts x samples`` trajectories (whole groups) from the experience buffer, asking
   for the ones *after* the last committed cursor; a short reply is topped up by the next call,
   so the batch is exactly the next ``n`` in consume order;
2. **staleness** of each = this trainer version - the version that generated it (histogram, max);
3. **train** (GRPO advantages, then the policy loss; data-parallel ranks), in a worker thread so
   the event loop keeps serving heartbeats and status;
4. **checkpoint** (every ``checkpoint.every`` versions) with the new version and cursor;
5. **publish**: copy the weights into a host buffer (the only stall) and hand off;
6. **evaluate** (``eval``, when ``every_s`` has passed): greedy held-out accuracy of the weights
   just published, on the same worker thread, so it costs trainer time but never races training.

Checkpoint before publish: a version that reached any rollout is always recoverable, so a
restarted trainer never reuses a version number for different weights when ``every`` is 1.

Each version's record and each evaluation is a line of ``metrics_file`` and, through
:class:`laminar.tracking.TrainerTracking`, TensorBoard/W&B scalars at step = version.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import torch
from prometheus_client import Gauge, Histogram
from pydantic import BaseModel

from laminar.config import ServiceConfig
from laminar.endpoint import endpoint
from laminar.rl import grpo_advantages, pack
from laminar.service import Service, ServiceContext
from laminar.tracking import TrainerTracking
from laminar.weights.publisher import WeightPublisher

from .batches import BatchSource
from .checkpoint import TrainingState, latest_checkpoint, load_state, save_checkpoint
from .config import TrainerConfig
from .dp import DataParallelGroup


class TrainerStatus(BaseModel):
    version: int
    cursor: int
    resumed_from: str | None
    resumed_version: int | None  # the checkpoint's version and cursor at startup
    resumed_cursor: int | None
    digests: dict[int, str]  # version -> manifest digest of what was published
    published: int  # newest version the master relay verified
    stalls_s: list[float]  # the trainer's stall of each publish
    max_staleness: int
    training: bool


class TrainerService(Service):
    role: ClassVar[str] = "trainer"
    config_model: ClassVar[type[ServiceConfig]] = TrainerConfig
    config: TrainerConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trainer-compute")
        self.group: DataParallelGroup | None = None
        self.state = TrainingState()
        self.publisher: WeightPublisher | None = None
        self.max_staleness = 0
        self.training = True
        self.resumed: tuple[str, int, int] | None = None
        self._evaluator: Any = None  # (task, records, tokenizer), loaded on first use
        self._last_eval = float("-inf")
        self.tracking: TrainerTracking | None = None
        self.source = BatchSource(ctx, self.log, self.config.data, self.config.sample_wait_s)
        registry = ctx.registry
        self.m_staleness = Histogram(
            "laminar_staleness",
            "Trainer version minus generating version, per trajectory",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
            registry=registry,
        )
        self.m_max_staleness = Gauge(
            "laminar_staleness_max", "Largest staleness trained on", registry=registry
        )
        self.m_version = Gauge(
            "laminar_trainer_version", "Newest trained version", registry=registry
        )
        self.m_stall = Histogram(
            "laminar_publish_stall_seconds", "Trainer stall per publish", registry=registry
        )
        self.m_accuracy = Gauge(
            "laminar_eval_accuracy", "Held-out accuracy of the newest evaluation", registry=registry
        )

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    # -- lifecycle ---------------------------------------------------------------------------

    async def on_start(self) -> None:
        c = self.config
        found = latest_checkpoint(c.checkpoint.dir)
        if found is not None:
            self.state = load_state(found)
            self.resumed = (str(found), self.state.version, self.state.cursor)
            self.log.info(
                "resuming",
                checkpoint=str(found),
                version=self.state.version,
                cursor=self.state.cursor,
            )
        self.tracking = TrainerTracking(
            c.tracking, c.metrics_file, self.log, c.model_dump(mode="json")
        )
        self.group = await self._run(DataParallelGroup, c, self.state.path)
        self.m_version.set(self.state.version)
        manager = self.ctx.client(self.ctx.manager) if self.ctx.manager else None
        self.publisher = WeightPublisher(c.publish, self.ctx.options, manager=manager, log=self.log)
        self.spawn(self.publisher.run(), name="publish")
        if self.state.version > 0:  # rollouts restarted from disk catch up with the checkpoint
            await self._publish()
        self.spawn(self._train_loop(), name="train")

    async def on_stop(self) -> None:
        if self.group is not None:
            await self._run(self.group.close)
        if self.tracking is not None:
            await asyncio.to_thread(self.tracking.close)
        self._compute.shutdown(wait=False)

    def stats(self) -> dict[str, float]:
        return {
            "version": float(self.state.version),
            "cursor": float(self.state.cursor),
            "max_staleness": float(self.max_staleness),
        }

    @endpoint
    async def status(self) -> TrainerStatus:
        return TrainerStatus(
            version=self.state.version,
            cursor=self.state.cursor,
            resumed_from=self.resumed[0] if self.resumed else None,
            resumed_version=self.resumed[1] if self.resumed else None,
            resumed_cursor=self.resumed[2] if self.resumed else None,
            digests=dict(self.publisher.digests) if self.publisher else {},
            published=self.publisher.acked if self.publisher else -1,
            stalls_s=list(self.publisher.stalls) if self.publisher else [],
            max_staleness=self.max_staleness,
            training=self.training,
        )

    # -- the loop ----------------------------------------------------------------------------

    async def _train_loop(self) -> None:
        c = self.config
        assert self.group is not None
        if c.eval is not None and c.eval.at_start:
            await self._evaluate()
        while c.max_versions is None or self.state.version < c.max_versions:
            got = await self.source.next(c.batch.rows, self.state.version, self.state.cursor)
            batch, cursor = got.items, got.cursor
            started = time.perf_counter()
            staleness = [self.state.version - t.version for t in batch]
            for s in staleness:
                self.m_staleness.observe(s)
            self.max_staleness = max(self.max_staleness, *staleness)
            self.m_max_staleness.set(self.max_staleness)
            rewards = torch.tensor([t.reward or 0.0 for t in batch], dtype=torch.float32)
            advantages = grpo_advantages(
                rewards, [t.prompt_id for t in batch], normalize_std=c.normalize_advantages
            )
            packed = pack(batch, advantages.tolist(), pad_id=0)
            result = await self._run(self.group.train, packed)
            first = self.state.cursor + 1
            self.state.version += 1
            self.state.cursor = cursor
            self.state.history.append(
                {
                    "version": self.state.version,
                    "seqs": [first, cursor],
                    "ids": [t.trajectory_id for t in batch],
                }
            )
            if self.state.version % c.checkpoint.every == 0 or self.state.version == c.max_versions:
                await self._run(self._checkpoint)
            stall = await self._publish()
            self.m_version.set(self.state.version)
            record = {
                "version": self.state.version,
                "cursor": cursor,
                "time": time.time(),
                "train_s": time.perf_counter() - started,
                "tokens": result.tokens,
                "reward_mean": float(rewards.mean()),
                "reward_generated": got.reward_generated,  # filtered groups' rewards too
                "staleness_mean": sum(staleness) / len(staleness),
                "staleness_max": max(staleness),
                "staleness_counts": {str(k): staleness.count(k) for k in sorted(set(staleness))},
                "grad_norm": result.grad_norm,
                "publish_stall_s": stall,
                **result.stats,
            }
            self.log.info(
                "version trained",
                **{
                    k: record[k]
                    for k in (
                        "version",
                        "reward_mean",
                        "staleness_max",
                        "tokens",
                        "mismatch_kl",
                        "clip_frac",
                    )
                },
            )
            self._write_metrics(record)
            if c.eval is not None and time.monotonic() - self._last_eval >= c.eval.every_s:
                await self._evaluate()
        self.training = False
        self.log.info("training finished", version=self.state.version)

    async def _evaluate(self) -> None:
        result = await self._run(self._evaluate_sync)
        self._last_eval = time.monotonic()
        self.m_accuracy.set(result.accuracy)
        self.log.info(
            "evaluated",
            version=self.state.version,
            accuracy=result.accuracy,
            seconds=result.seconds,
        )
        self._write_metrics(
            {
                "eval": True,
                "version": self.state.version,
                "time": time.time(),
                "accuracy": result.accuracy,
                "n": result.n,
                "eval_s": result.seconds,
                "buckets": result.buckets,
            }
        )

    def _evaluate_sync(self) -> Any:
        from laminar.recipe.evaluate import eval_records, evaluate_model
        from laminar.recipe.model import load_tokenizer
        from laminar.recipe.tasks import load_task

        e = self.config.eval
        assert e is not None and self.group is not None
        if self._evaluator is None:
            task = load_task(e.task)
            self._evaluator = (task, eval_records(task, e.n, e.seed, e.data),
                               load_tokenizer(self.config.model))  # fmt: skip
        task, records, tok = self._evaluator
        model = self.group.trainer.model
        return evaluate_model(
            task, model, tok, records, e.batch_size, name=f"v{self.state.version}"
        )

    def _checkpoint(self) -> None:
        assert self.group is not None
        trainer = self.group.trainer
        path = save_checkpoint(
            self.config.checkpoint.dir,
            self.state,
            trainer.model,
            trainer.optimizer,
            self.config.model,
            self.config.checkpoint.keep,
        )
        self.state.path = str(path)

    async def _publish(self) -> float:
        assert self.publisher is not None and self.group is not None
        vb = await self._run(
            self.publisher.stage, self.state.version, self.group.trainer.named_weights()
        )
        await self.publisher.hand_off(vb)
        stall = self.publisher.stalls[-1]
        self.m_stall.observe(stall)
        return stall

    def _write_metrics(self, record: dict[str, Any]) -> None:
        if self.tracking is not None:
            self.tracking.record(record, record["time"])
        if self.config.metrics_file is None:
            return
        path = Path(self.config.metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
