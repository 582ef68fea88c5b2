"""The torch trainer's compute: the policy's data-parallel group, its checkpoints, its weights.

Every blocking call (torch, checkpoint files, the published mark, staging the weights) runs on the
role's one-worker ``trainer-compute`` executor (a thread in production), so the event loop keeps
serving heartbeats and status while a step runs, and steps, checkpoints, staging and evaluation
never race each other on the model.

Resuming (see :mod:`.checkpoint`): the newest checkpoint that validates gives the version, cursor
and history; if versions past it were published (``checkpoint.every > 1``: the ``published``
mark), the checkpoint's weights get the number after the mark, so no number ever names two sets
of weights. A resumed trainer publishes its weights again before training, so rollouts restarted
from disk catch up with the checkpoint. The mark is written (fsynced) before a version's first
byte leaves: :meth:`TorchCompute.stage`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Gauge

from laminar.rl import Screened
from laminar.service import ServiceContext
from laminar.weights.publisher import WeightPublisher
from laminar.weights.transfer import VersionBuffer

from .checkpoint import (
    TrainingState,
    latest_checkpoint,
    load_state,
    published_mark,
    record_published,
    save_checkpoint,
)
from .compute import packed
from .config import TrainerConfig
from .dp import DataParallelGroup
from .step import Progress, Resumed, StepResult


class TorchCompute:
    def __init__(self, ctx: ServiceContext, log: Any, config: TrainerConfig) -> None:
        self.log, self.config = log, config
        self._executor = ctx.executor("trainer-compute", workers=1)  # one model, one at a time
        self.group: DataParallelGroup | None = None
        self.resumed: tuple[str, int, int] | None = None  # checkpoint, its version and cursor
        self._published_mark = -1
        self._evaluator: Any = None  # (task, records, tokenizer), loaded on first use
        self.m_accuracy = Gauge(
            "laminar_eval_accuracy",
            "Held-out accuracy of the newest evaluation",
            registry=ctx.registry,
        )

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await self._executor.run(fn, *args)

    def _problem(self, problem: str) -> None:
        self.log.error("checkpoint", problem=problem)

    async def resume(self) -> Resumed:
        c = self.config
        state = TrainingState()
        found = await self._run(latest_checkpoint, c.checkpoint.dir, self._problem)
        if found is not None:
            state = load_state(found)
            self.resumed = (str(found), state.version, state.cursor)
            self.log.info(
                "resuming", checkpoint=str(found), version=state.version, cursor=state.cursor
            )
        self._published_mark = await self._run(published_mark, c.checkpoint.dir, self._problem)
        if self._published_mark > state.version:
            # Versions past the checkpoint reached the relays: the checkpoint's weights get the
            # next free number, so rollouts take them and no number means two sets of weights.
            self.log.warning(
                "versions past the checkpoint were published; continuing after them",
                checkpoint_version=state.version,
                published=self._published_mark,
            )
            state.version = self._published_mark + 1
        self.group = await self._run(DataParallelGroup, c, state.path)
        # one batch per version so far: what a round schedule's gate counts
        progress = Progress(state.version, state.cursor, state.version, state.history)
        return Resumed(progress, publish=state.version > 0)

    async def train(self, screened: Screened, version: int) -> StepResult:
        assert self.group is not None
        return await self._run(self.group.train, packed(screened, self.config))  # type: ignore[no-any-return]

    async def checkpoint(self, progress: Progress, saved_at: float) -> None:
        state = TrainingState(progress.version, progress.cursor, progress.history or [])
        await self._run(self._save, state, saved_at)

    def _save(self, state: TrainingState, saved_at: float) -> None:
        assert self.group is not None
        c, trainer = self.config, self.group.trainer
        save_checkpoint(
            c.checkpoint.dir,
            state,
            trainer.model,
            trainer.optimizer,
            c.model,
            c.checkpoint.keep,
            saved_at=saved_at,
        )

    async def stage(self, publisher: WeightPublisher, version: int) -> VersionBuffer:
        assert self.group is not None
        if version > self._published_mark:  # on disk before any byte leaves
            await self._run(record_published, self.config.checkpoint.dir, version)
            self._published_mark = version
        weights = self.group.trainer.named_weights()
        return await self._run(publisher.stage, version, weights)  # type: ignore[no-any-return]

    async def evaluate(self, version: int) -> dict[str, Any] | None:
        if self.config.eval is None:
            return None
        result = await self._run(self._evaluate, version)
        self.m_accuracy.set(result.accuracy)
        return {
            "accuracy": result.accuracy,
            "n": result.n,
            "eval_s": result.seconds,
            "buckets": result.buckets,
        }

    def _evaluate(self, version: int) -> Any:
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
        return evaluate_model(task, model, tok, records, e.batch_size, name=f"v{version}")

    async def close(self) -> None:
        if self.group is not None:
            await self._run(self.group.close)
