"""The emulated trainer (design.md, "emulated — sim engine and sim trainer"): role ``sim_trainer``.

It runs the torch trainer's loop (:mod:`.loop`: the same batches, staleness, screening,
checkpoint cadence, schedule gate and records) with the GPU work replaced by sleeping
(:mod:`.sim_compute`):

1. **sample** the next ``batch.prompts x batch.samples`` trajectories as whole groups, after its
   cursor (the same ``sample`` protocol as the real trainer, so each is trained exactly once);
2. **train**: sleep ``cost.train_time(tokens)`` (:class:`laminar.engines.costmodel.TrainCostModel`,
   tokens = prompt + response tokens of the batch) on the service's clock;
3. **publish** the new version through the real :class:`WeightPublisher`: ``weight_bytes`` of
   tensor data are staged (the trainer's stall is that host copy) and pushed down the relay chain
   like real weights, so the relays and rollouts move and map real bytes.

The schedule (``cluster.schedule``, :mod:`laminar.runtime.schedules`) decides when a trained
version may
go out: ``one_step`` holds version ``v`` until batch ``v`` has been sampled (the global barrier),
every other schedule publishes at once. One JSON line per version goes to ``metrics_file``:
version, batch tokens, staleness, the train interval and the publish time; its numbers also go
to TensorBoard/W&B (``tracking``, :mod:`laminar.tracking`, shared with the torch trainer).

With ``state_file`` set, a restarted sim trainer resumes from its version, cursor and batch count
(:class:`.sim_compute.SimTrainerState`), so nothing is trained twice. Without it a restarted sim
trainer starts from version 0 and cursor 0 and trains on everything again. Its first version
then carries a number the relays already hold: the master refuses it
(:class:`laminar.weights.transfer.VersionConflict`) and, under ``laminar``, the next version is
numbered after the master's newest, so rollouts follow the restarted trainer after one batch
instead of ignoring it until it catches up. (Round schedules count versions against batches, and
restarting them mid-run is not supported either way.)
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel

from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.endpoint import endpoint
from laminar.runtime.service import Service

from .api import LearningApi, LearningRequest, LearningSeries
from .config import SimTrainerConfig
from .loop import LoopSettings, TrainLoop
from .sim_compute import SimCompute, SimTrainerState

__all__ = ["SimTrainerConfig", "SimTrainerService", "SimTrainerState", "SimTrainerStatus"]


class SimTrainerStatus(BaseModel):
    version: int
    published: list[int]  # versions handed to the publisher, in order
    records: list[dict[str, Any]]  # one per version (see the module docstring)


def loop_settings(c: SimTrainerConfig) -> LoopSettings:
    return LoopSettings(
        rows=c.batch.rows,
        publish=c.publish,
        max_versions=c.max_versions,
        sample_wait_s=c.sample_wait_s,
        data=c.data,
        checkpoint_every=1 if c.state_file is not None else None,
        metrics_file=c.metrics_file,
        tracking=c.tracking,
        config=c.model_dump(mode="json"),
    )


class SimTrainerService(Service, LearningApi):
    role: ClassVar[str] = "sim_trainer"
    computes: ClassVar[bool] = True  # keeps its priority and cores (laminar.proc.placement)
    config_model: ClassVar[type[ServiceConfig]] = SimTrainerConfig
    config: SimTrainerConfig
    #: the compute the loop runs (a subclass may measure more, e.g. stand-in evaluations)
    compute_cls: ClassVar[type[SimCompute]] = SimCompute

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        c = self.config
        compute = self.compute_cls(
            ctx.clock,
            self.log,
            c.cost,
            c.weight_bytes,
            c.state_file,
            ctx.executor("trainer-compute", workers=1),
        )
        self.loop = TrainLoop(ctx, self.log, self.settings(), compute)

    def settings(self) -> LoopSettings:
        """The loop's settings, from the config."""
        return loop_settings(self.config)

    async def on_start(self) -> None:
        await self.loop.start()

    async def on_stop(self) -> None:
        await self.loop.close()

    def stats(self) -> dict[str, float]:
        loop = self.loop
        return {
            "version": float(loop.progress.version),
            "trained_tokens": float(loop.trained_tokens),
            "batches": float(loop.progress.batches),
        }

    @endpoint
    async def status(self) -> SimTrainerStatus:
        loop = self.loop
        return SimTrainerStatus(
            version=loop.progress.version,
            published=list(loop.published),
            records=list(loop.records),
        )

    @endpoint
    async def learning(self, request: LearningRequest) -> LearningSeries:
        return self.loop.learning(request)
