"""The emulated trainer's compute: a cost model's time on the service's clock, bytes to publish.

``train`` sleeps ``cost.train_time(tokens)`` (:class:`laminar.engines.costmodel.TrainCostModel`;
tokens = prompt + response tokens of the trajectories kept for training) on the service's clock,
so under a virtual clock a long run costs nothing. ``stage`` lays out ``weight_bytes`` of tensor
data (one bf16 tensor of zeros, described to the publisher and written into its buffer, so this
role loads no torch) like real weights, so the relays and rollouts move and map real bytes and the
trainer's stall is a real write of that many bytes.

There is no model state to keep, but what a real checkpoint records about the data is kept:
with ``state_file`` set, the version, the cursor and the batch count are written atomically
(fsynced, then renamed) at each checkpoint (every version: the loop checkpoints before a version
can go out). A restarted sim trainer resumes from them, so the data role re-delivers only what
was taken and not yet trained: nothing is trained twice (which the chaos benchmark counts).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel

from laminar.engines.costmodel import TrainCostModel
from laminar.runtime.clock import Clock
from laminar.runtime.executor import Executor

from .step import Progress, Resumed, StepResult

if TYPE_CHECKING:
    from laminar.rl import Screened
    from laminar.roles.trainer.publisher import WeightPublisher
    from laminar.weights.transfer import VersionBuffer


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


class SimCompute:
    def __init__(
        self,
        clock: Clock,
        log: Any,
        cost: TrainCostModel,
        weight_bytes: int,
        state_file: str | None,
        executor: Executor,
    ) -> None:
        self.clock, self.log, self.cost = clock, log, cost
        self.executor = executor  # the state file's fsyncs and the staging copy
        self.weight_bytes = weight_bytes
        self.state_file = Path(state_file) if state_file is not None else None
        # one bf16 tensor of ``weight_bytes``, described, never made: no torch in this role
        self._specs = [("weights", "bfloat16", (weight_bytes // 2,))]

    async def resume(self) -> Resumed:
        if self.state_file is None:
            return Resumed()
        state = SimTrainerState.load(self.state_file)
        if state.version:
            self.log.info("resumed", version=state.version, cursor=state.cursor)
        # no republish: the weights are zeros whatever the number, and the next version follows
        return Resumed(Progress(state.version, state.cursor, state.batches))

    async def train(self, screened: Screened, version: int) -> StepResult:
        kept = screened.kept
        tokens = sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in kept)
        await self.clock.sleep(self.cost.train_time(tokens))
        return StepResult(stats={}, grad_norm=None, tokens=tokens)

    async def checkpoint(self, progress: Progress, saved_at: float) -> None:
        if self.state_file is None:
            return
        state = SimTrainerState(
            version=progress.version, cursor=progress.cursor, batches=progress.batches
        )
        await self.executor.run(state.save, self.state_file)

    async def stage(self, publisher: WeightPublisher, version: int) -> VersionBuffer:
        return await self.executor.run(_stage_zeros, publisher, version, self._specs)

    async def evaluate(self, version: int) -> dict[str, Any] | None:
        return None  # nothing to measure: the weights are zeros

    async def close(self) -> None:
        pass


def _stage_zeros(publisher: WeightPublisher, version: int, specs: list[Any]) -> VersionBuffer:
    """Stage ``specs`` as zeros, in the publisher's own (private) buffer."""
    return publisher.stage(version, specs=specs, fill=_zero_fill, shared=False)


def _zero_fill(manifest: Any, segment: str | None, view: memoryview) -> None:
    np.frombuffer(view, dtype=np.uint8).fill(0)
