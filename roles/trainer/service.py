"""The trainer role: consume whole groups as they complete, update, checkpoint, publish; repeat.

The loop itself (sample, staleness, screen, train, checkpoint, publish on the schedule's terms,
record, evaluate) is :mod:`.loop`, shared with the emulated ``sim_trainer``; this role gives it
the torch compute (:mod:`.torch_compute`: GRPO advantages, then the policy loss on data-parallel
ranks, in a worker thread so the event loop keeps serving heartbeats and status). ``publish``
(the weight publisher) pushes each new version to the master relay in the background.

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

``eval`` (when ``every_s`` has passed): greedy held-out accuracy of the weights just published,
on the same worker thread, so it costs trainer time but never races training. Each version's
record and each evaluation is a line of ``metrics_file`` and, through
:class:`laminar.tracking.TrainerTracking`, TensorBoard/W&B scalars at step = version.
"""

from __future__ import annotations

from typing import ClassVar

from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.endpoint import endpoint
from laminar.runtime.service import Service

from .api import LearningRequest, LearningSeries, TrainerApi, TrainerStatus
from .config import TrainerConfig
from .loop import LoopSettings, TrainLoop
from .torch_compute import TorchCompute


def loop_settings(c: TrainerConfig) -> LoopSettings:
    return LoopSettings(
        rows=c.batch.rows,
        publish=c.publish,
        max_versions=c.max_versions,
        sample_wait_s=c.sample_wait_s,
        data=c.data,
        checkpoint_every=c.checkpoint.every,
        metrics_file=c.metrics_file,
        tracking=c.tracking,
        config=c.model_dump(mode="json"),
        exclude_scope=c.exclude_scope,
        eval_every_s=c.eval.every_s if c.eval is not None else None,
        eval_at_start=c.eval is not None and c.eval.at_start,
    )


class TrainerService(Service, TrainerApi):
    role: ClassVar[str] = "trainer"
    computes: ClassVar[bool] = True  # keeps its priority and cores (laminar.proc.placement)
    config_model: ClassVar[type[ServiceConfig]] = TrainerConfig
    config: TrainerConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.compute = TorchCompute(ctx, self.log, self.config)
        self.loop = TrainLoop(ctx, self.log, loop_settings(self.config), self.compute)

    async def on_start(self) -> None:
        await self.loop.start()

    async def on_stop(self) -> None:
        await self.loop.close()

    def stats(self) -> dict[str, float]:
        loop = self.loop
        return {
            "version": float(loop.progress.version),
            "cursor": float(loop.progress.cursor),
            "max_staleness": float(loop.max_staleness),
            **loop.integrity.stats(),
        }

    @endpoint
    async def status(self) -> TrainerStatus:
        loop, publisher, resumed = self.loop, self.loop.publisher, self.compute.resumed
        return TrainerStatus(
            version=loop.progress.version,
            cursor=loop.progress.cursor,
            resumed_from=resumed[0] if resumed else None,
            resumed_version=resumed[1] if resumed else None,
            resumed_cursor=resumed[2] if resumed else None,
            digests=dict(publisher.digests) if publisher else {},
            published=publisher.acked if publisher else -1,
            stalls_s=list(publisher.stalls) if publisher else [],
            max_staleness=loop.max_staleness,
            training=loop.training,
            excluded=dict(loop.integrity.excluded),
            skipped_steps=loop.integrity.skipped_steps,
            version_conflicts=publisher.conflicts if publisher else 0,
        )

    @endpoint
    async def learning(self, request: LearningRequest) -> LearningSeries:
        return self.loop.learning(request)
