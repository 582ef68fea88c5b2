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
restarted trainer never reuses a version number for different weights when ``every`` is 1. With
``every > 1`` versions go out that no checkpoint holds: each is first noted in the checkpoint
directory's ``published`` mark (:func:`.checkpoint.record_published`), and a restarted trainer
gives its checkpoint's weights the number after the mark. The publisher's conflict check
(:class:`laminar.weights.transfer.VersionConflict`) moves the numbering past whatever the master
relay holds, should the mark be lost.

What is not learnt from (:mod:`.integrity`): trajectories without a reward or with non-finite
behaviour logprobs are screened out before the advantages (:mod:`laminar.rl.screen`), and an
optimizer step whose loss or gradient norm is not finite is skipped (:mod:`.compute`). Either way
the batch is *consumed*: the cursor moves past it and the version still advances and is
published (with the weights unchanged if nothing applied), so a poison batch is never retried
forever and every consumer keeps its one-version-per-batch invariant (round schedules wait for
``version == round``). Both are counted, logged and listed in the version's history entry.

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

from prometheus_client import Gauge, Histogram
from pydantic import BaseModel

from laminar.config import ServiceConfig
from laminar.endpoint import endpoint
from laminar.service import Service, ServiceContext
from laminar.tracking import TrainerTracking
from laminar.weights.publisher import WeightPublisher

from .batches import BatchSource
from .checkpoint import (
    TrainingState,
    latest_checkpoint,
    load_state,
    published_mark,
    record_published,
    save_checkpoint,
)
from .compute import StepResult
from .config import TrainerConfig
from .dp import DataParallelGroup
from .integrity import IntegrityMonitor, prepare


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
    excluded: dict[str, int] = {}  # reason -> trajectories consumed but not trained on
    skipped_steps: int = 0  # optimizer steps skipped as non-finite
    version_conflicts: int = 0  # versions the master refused: their number was already taken


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
        self.integrity = IntegrityMonitor(ctx.registry, self.log)
        self._published_mark = -1
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
        found = await asyncio.to_thread(
            latest_checkpoint, c.checkpoint.dir, lambda p: self.log.error("checkpoint", problem=p)
        )
        if found is not None:
            self.state = load_state(found)
            self.resumed = (str(found), self.state.version, self.state.cursor)
            self.log.info(
                "resuming",
                checkpoint=str(found),
                version=self.state.version,
                cursor=self.state.cursor,
            )
        self._published_mark = await asyncio.to_thread(
            published_mark, c.checkpoint.dir, lambda p: self.log.error("checkpoint", problem=p)
        )
        if self._published_mark > self.state.version:
            # Versions past the checkpoint reached the relays: the checkpoint's weights get the
            # next free number, so rollouts take them and no number means two sets of weights.
            self.log.warning(
                "versions past the checkpoint were published; continuing after them",
                checkpoint_version=self.state.version,
                published=self._published_mark,
            )
            self.state.version = self._published_mark + 1
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
            **self.integrity.stats(),
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
            excluded=dict(self.integrity.excluded),
            skipped_steps=self.integrity.skipped_steps,
            version_conflicts=self.publisher.conflicts if self.publisher else 0,
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
            version = self._next_version()  # may move state.version past a reused number
            staleness = [self.state.version - t.version for t in batch]
            for s in staleness:
                self.m_staleness.observe(s)
            self.max_staleness = max(self.max_staleness, *staleness)
            self.m_max_staleness.set(self.max_staleness)
            screened, packed = prepare(batch, c)
            self.integrity.screened(screened, version)
            if packed is not None:
                result = await self._run(self.group.train, packed)
            else:  # nothing trainable: the batch is consumed, the weights stay
                result = StepResult(stats={}, grad_norm=None, tokens=0)
            self.integrity.stepped(result, version)
            first = self.state.cursor + 1
            self.state.version = version
            self.state.cursor = cursor
            self.state.history.append(
                {
                    "version": self.state.version,
                    "seqs": [first, cursor],
                    **self.integrity.history(screened, result),
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
                "reward_mean": sum(screened.rewards) / len(screened.rewards)
                if screened.rewards
                else None,
                "excluded": screened.excluded_count,
                "skipped_steps": result.skipped_steps,
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
                    k: record.get(k)
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

    def _next_version(self) -> int:
        """The number of the version being trained: one past this trainer's, or past what the
        master relay refused ours for (a mark lost with its disk; see the module docstring)."""
        assert self.publisher is not None
        if self.publisher.master_newest > self.state.version:
            self.log.error(
                "the master relay holds newer versions than this trainer; continuing after them",
                version=self.state.version,
                master_newest=self.publisher.master_newest,
            )
            self.state.version = self.publisher.master_newest
        return self.state.version + 1

    async def _publish(self) -> float:
        assert self.publisher is not None and self.group is not None
        if self.state.version > self._published_mark:  # on disk before any byte leaves
            await self._run(record_published, self.config.checkpoint.dir, self.state.version)
            self._published_mark = self.state.version
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
