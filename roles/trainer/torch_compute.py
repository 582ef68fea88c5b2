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

import functools
import threading
from typing import Any

from prometheus_client import Gauge

from laminar.recipe.episodes import EvalStopped
from laminar.rl import Screened
from laminar.roles.trainer.publisher import WeightPublisher
from laminar.runtime.context import ServiceContext
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
from .evaluator import Evaluator
from .rendezvous import rendezvous_for
from .step import Progress, Resumed, StepResult


class TorchCompute:
    def __init__(self, ctx: ServiceContext, log: Any, config: TrainerConfig) -> None:
        self.ctx, self.log, self.config = ctx, log, config
        self._executor = ctx.executor("trainer-compute", workers=1)  # one model, one at a time
        self.group: DataParallelGroup | None = None
        self.resumed: tuple[str, int, int] | None = None  # checkpoint, its version and cursor
        self._published_mark = -1
        self._evaluator: Evaluator | None = None  # made on first use
        # set by close: an evaluation under way gives up at its next decoding step (see evaluate)
        self._closing = threading.Event()
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
        group = functools.partial(
            DataParallelGroup, c, state.path, rendezvous=rendezvous_for(self.ctx, c)
        )
        self.group = await self._run(group)
        # one batch per version so far: what a round schedule's gate counts
        progress = Progress(state.version, state.cursor, state.version, state.history)
        return Resumed(progress, publish=state.version > 0)

    async def train(self, screened: Screened, version: int) -> StepResult:
        assert self.group is not None
        group = self.group
        # packing (torch ops) too goes off the loop: on a large batch it would block it for
        # seconds
        return await self._run(lambda: group.train(packed(screened, self.config)))

    async def checkpoint(self, progress: Progress, saved_at: float) -> None:
        state = TrainingState(progress.version, progress.cursor, progress.history or [])
        await self._run(self._save, state, saved_at)

    def _save(self, state: TrainingState, saved_at: float) -> None:
        assert self.group is not None
        c = self.config
        model_state, optim_state = self.group.training_state()  # sharded: gathered to rank 0
        save_checkpoint(
            c.checkpoint.dir,
            state,
            self.group.trainer.model,
            optim_state,
            c.model,
            c.checkpoint.keep,
            saved_at=saved_at,
            model_state=model_state if self.group.trainer.sharded else None,
        )

    async def stage(self, publisher: WeightPublisher, version: int) -> VersionBuffer:
        assert self.group is not None
        if version > self._published_mark:  # on disk before any byte leaves
            await self._run(record_published, self.config.checkpoint.dir, version)
            self._published_mark = version
        return await self._run(self._stage, publisher, version)

    def _stage(self, publisher: WeightPublisher, version: int) -> VersionBuffer:
        """The copy runs in the background while the next step trains, nothing gathered
        (:meth:`DataParallelGroup.copy_out`)."""
        group = self.group
        assert group is not None
        return publisher.stage(
            version,
            specs=group.weight_specs(),
            fill=group.copy_out,
            shared=group.needs_segment,
        )

    async def evaluate(self, version: int) -> dict[str, Any] | None:
        if self.config.eval is None:
            return None
        if self._evaluator is None:
            self._evaluator = Evaluator(self.config.eval, self.config.model)
        assert self.group is not None
        try:
            result = await self._run(
                self.group.evaluate, self._evaluator, version, self._closing.is_set
            )
        except EvalStopped:  # closing: nobody will read it
            return None
        self.m_accuracy.set(result.accuracy)
        return {
            "accuracy": result.accuracy,
            "n": result.n,
            "eval_s": result.seconds,
            "buckets": result.buckets,
            **({} if result.tool_calls is None else {"tool_calls": result.tool_calls}),
        }

    async def close(self) -> None:
        # An evaluation takes tens of seconds on a CPU (200 greedy episodes), and the group's
        # close waits behind it on the one compute thread: a trainer stopped during one ran
        # past its stop's deadline and was killed. It gives up at its next decoding step instead.
        self._closing.set()
        if self.group is not None:
            await self._run(self.group.close)
