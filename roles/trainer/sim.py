"""The emulated trainer (design.md, "emulated — sim engine and sim trainer"): role ``sim_trainer``.

It does what :mod:`roles.trainer.service` does with the GPU work replaced by sleeping:

1. **sample** the next ``batch.prompts x batch.samples`` trajectories as whole groups, after its
   cursor (the same ``sample`` protocol as the real trainer, so each is trained exactly once);
2. **train**: sleep ``cost.train_time(tokens)`` (:class:`laminar.engines.costmodel.TrainCostModel`,
   tokens = prompt + response tokens of the batch) on the service's clock;
3. **publish** the new version through the real :class:`WeightPublisher`: ``weight_bytes`` of
   tensor data are staged (the trainer's stall is that host copy) and pushed down the relay chain
   like real weights, so the relays and rollouts move and map real bytes.

The schedule (``cluster.schedule``, :mod:`laminar.schedules`) decides when a trained version may
go out: ``one_step`` holds version ``v`` until batch ``v`` has been sampled (the global barrier),
every other schedule publishes at once. One JSON line per version goes to ``metrics_file``:
version, batch tokens, staleness, the train interval and the publish time; its numbers also go
to TensorBoard/W&B (``tracking``, :mod:`laminar.tracking`, shared with the torch trainer).

There is no model state to keep, but what a real checkpoint records about the data is kept:
with ``state_file`` set, the version, the cursor and the batch count are written atomically
(fsynced, then renamed) after each version is trained and before it is published, the order of
the real trainer's checkpoint. A restarted sim trainer resumes from them, so the data role
re-delivers only what was taken and not yet trained: nothing is trained twice (which the chaos
benchmark counts). Without ``state_file`` a restarted sim trainer starts from version 0 and
cursor 0 and trains on everything again. Its first version then carries a number the relays
already hold: the master refuses it (:class:`laminar.weights.transfer.VersionConflict`) and,
under ``laminar``, the next version is numbered after the master's newest, so rollouts follow the
restarted trainer after one batch instead of ignoring it until it catches up. (Round schedules
count versions against batches, and restarting them mid-run is not supported either way.)
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field

from laminar.config import ServiceConfig
from laminar.endpoint import endpoint
from laminar.engines.costmodel import TrainCostModel
from laminar.schedules import may_publish
from laminar.service import Service, ServiceContext
from laminar.tracking import TrackingConfig, TrainerTracking
from laminar.weights.publisher import PublishConfig, WeightPublisher

from .batches import BatchSource
from .config import BatchConfig


class SimTrainerConfig(ServiceConfig):
    batch: BatchConfig = Field(default_factory=BatchConfig)
    cost: TrainCostModel = Field(default_factory=TrainCostModel)
    weight_bytes: Annotated[int, Field(ge=1024, le=64 << 30)] = Field(
        64 << 20, description="Bytes published per version (one bf16 tensor of this size)."
    )
    publish: PublishConfig = Field(default_factory=PublishConfig)
    max_versions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Stop after this version (unset: run until stopped)."
    )
    sample_wait_s: Annotated[float, Field(gt=0, le=600)] = Field(
        2.0, description="How long one batch request waits at the data role for trajectories."
    )
    data: str | None = Field(None, description="The data role's address (default: ask manager).")
    metrics_file: str | None = Field(
        None, description="One JSON line per version (unset: none; `status` has them too)."
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="The metrics file's lines as TensorBoard/W&B scalars (docs/training.md).",
    )
    state_file: str | None = Field(
        None,
        description="Where the version and data cursor are kept across restarts, as a real "
        "checkpoint keeps them (unset: a restart trains on everything again from version 0).",
    )


class SimTrainerState(BaseModel):
    """What a restarted sim trainer resumes from (see the module docstring)."""

    version: int = 0
    cursor: int = 0
    batches: int = 0

    @classmethod
    def load(cls, path: Path) -> SimTrainerState:
        if not path.exists():
            return cls()
        return cls.model_validate_json(path.read_bytes())  # a broken file fails loudly

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(self.model_dump_json().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class SimTrainerStatus(BaseModel):
    version: int
    published: list[int]  # versions handed to the publisher, in order
    records: list[dict[str, Any]]  # one per version (see the module docstring)


class SimTrainerService(Service):
    role: ClassVar[str] = "sim_trainer"
    config_model: ClassVar[type[ServiceConfig]] = SimTrainerConfig
    config: SimTrainerConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.version = 0
        self.cursor = 0
        self.batches = 0  # batches sampled so far
        self.trained_tokens = 0
        self.published: list[int] = []
        self.records: list[dict[str, Any]] = []
        self.publisher: WeightPublisher | None = None
        self._tensors: list[tuple[str, Any]] = []
        self.tracking: TrainerTracking | None = None
        self.source = BatchSource(ctx, self.log, self.config.data, self.config.sample_wait_s)

    async def on_start(self) -> None:
        import torch  # the publisher lays out torch tensors

        c = self.config
        if c.state_file is not None:
            state = SimTrainerState.load(Path(c.state_file))
            self.version, self.cursor, self.batches = state.version, state.cursor, state.batches
            if state.version:
                self.log.info("resumed", version=state.version, cursor=state.cursor)
        self._tensors = [("weights", torch.zeros(c.weight_bytes // 2, dtype=torch.bfloat16))]
        self.tracking = TrainerTracking(
            c.tracking, c.metrics_file, self.log, c.model_dump(mode="json")
        )
        manager = self.ctx.client(self.ctx.manager) if self.ctx.manager else None
        self.publisher = WeightPublisher(c.publish, self.ctx.options, manager=manager, log=self.log)
        self.spawn(self.publisher.run(), name="publish")
        self.spawn(self._train_loop(), name="train")

    async def on_stop(self) -> None:
        if self.tracking is not None:
            await asyncio.to_thread(self.tracking.close)

    def stats(self) -> dict[str, float]:
        return {
            "version": float(self.version),
            "trained_tokens": float(self.trained_tokens),
            "batches": float(self.batches),
        }

    @endpoint
    async def status(self) -> SimTrainerStatus:
        return SimTrainerStatus(
            version=self.version, published=list(self.published), records=list(self.records)
        )

    # -- the loop ----------------------------------------------------------------------------

    async def _train_loop(self) -> None:
        c = self.config
        kind = self.ctx.cluster.schedule.kind
        clock = self.ctx.clock
        held: int | None = None  # a trained version the schedule does not let out yet
        while c.max_versions is None or self.version < c.max_versions:
            got = await self.source.next(c.batch.rows, self.version, self.cursor)
            batch, self.cursor = got.items, got.cursor
            sampled_at = clock.wall()
            self.batches += 1
            if held is not None and may_publish(kind, held, self.batches):
                await self._publish(held)
                held = None
            staleness = [self.version - t.version for t in batch]
            tokens = sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in batch)
            train_s = c.cost.train_time(tokens)
            started = clock.wall()
            await clock.sleep(train_s)
            assert self.publisher is not None
            if not self.ctx.cluster.schedule.rounds and self.publisher.master_newest > self.version:
                self.log.error(
                    "the master relay holds newer versions than this trainer; continuing after",
                    version=self.version,
                    master_newest=self.publisher.master_newest,
                )
                self.version = self.publisher.master_newest
            self.version += 1
            self.trained_tokens += tokens
            trained = clock.wall()
            record: dict[str, Any] = {
                "version": self.version,
                "cursor": self.cursor,
                "tokens": tokens,
                "trajectories": len(batch),
                "sampled_at": sampled_at,
                "train_start": started,
                "train_end": trained,
                "train_s": train_s,
                "staleness_mean": sum(staleness) / len(staleness),
                "staleness_max": max(staleness),
                "gen_versions": sorted({t.version for t in batch}),
            }
            self.records.append(record)
            if c.state_file is not None:  # before it goes out, as a real checkpoint
                state = SimTrainerState(
                    version=self.version, cursor=self.cursor, batches=self.batches
                )
                await asyncio.to_thread(state.save, Path(c.state_file))
            if may_publish(kind, self.version, self.batches):
                await self._publish(self.version)
            else:
                held = self.version
            self.log.info(
                "version trained", version=self.version, tokens=tokens, train_s=round(train_s, 3)
            )
            self._write(record)
        if held is not None:
            await self._publish(held)
        self.log.info("training finished", version=self.version)

    async def _publish(self, version: int) -> None:
        assert self.publisher is not None
        vb = await asyncio.to_thread(self.publisher.stage, version, self._tensors)
        await self.publisher.hand_off(vb)
        self.published.append(version)
        for record in reversed(self.records):
            if record["version"] == version:
                record["published_at"] = self.ctx.clock.wall()
                break

    def _write(self, record: dict[str, Any]) -> None:
        if self.tracking is not None:
            self.tracking.record(record, self.ctx.clock.wall())
        if self.config.metrics_file is None:
            return
        path = Path(self.config.metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
