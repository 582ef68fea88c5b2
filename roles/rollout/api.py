"""The rollout role's endpoints and messages, as the manager, other rollouts and tools see them.

Declaration only: :class:`RolloutApi` has the signatures, ``RolloutService`` serves them.

Repack migration is two calls. The manager asks the *source* to ``migrate`` everything it has in
flight to a destination; the source exports its sequences from the engine (with their KV state
where the engine can export it), moves their leases in the data role, and hands them to the
destination's ``accept``. Whatever the destination refuses goes back into the source's engine, so
a failed migration loses nothing and changes no trajectory's version.
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, Field, field_serializer, field_validator

from laminar.engines import InflightSequence
from laminar.runtime.endpoint import endpoint
from laminar.runtime.stats import VersionedStats
from laminar.trajectory import Assignment


class RolloutPhase(enum.StrEnum):
    """What a rollout is doing, in the one vocabulary every reader uses: its heartbeat, its
    ``state`` endpoint, the admin API and dashboard, ``laminar status``, the tracked curves. The
    rollout's state machine decides it (``state.RolloutPhases.public``)."""

    RUNNING = "running"  # taking prompts
    DRAINING = "draining"  # an operator's drain: it finishes what it has and takes nothing new
    SWITCHING = "switching"  # a newer version waits, or a repack moves its trajectories out

    @property
    def code(self) -> int:
        """The phase as a heartbeat number (heartbeat stats are floats): its place here."""
        return list(RolloutPhase).index(self)

    @classmethod
    def of_code(cls, code: float) -> RolloutPhase:
        phases = list(cls)
        if code != int(code) or not 0 <= code < len(phases):
            raise ValueError(f"no rollout phase has code {code}")
        return phases[int(code)]


class LoadedWeights(BaseModel):
    version: int
    digest: str  # the manifest digest of the verified bytes loaded ("" for the initial weights)
    loaded_at: float  # wall clock
    load_s: float  # drain excluded: the load itself
    drain_s: float  # from "a newer version exists" to "nothing in flight"


class WeightsHistory(BaseModel):
    loads: list[LoadedWeights]


class RolloutState(BaseModel):
    """``running``: taking prompts. ``draining``: an operator asked it to take none (it finishes
    what it has and stays idle until ``resume``). ``switching``: a newer version is waiting; it
    takes nothing until its trajectories are done (or moved) and the version is loaded."""

    rollout: str
    phase: RolloutPhase
    version: int
    in_flight: int
    env_waiting: int = 0  # of which episodes waiting for the environment (out of the engine)
    operator_drain: bool


class DrainRequest(BaseModel):
    reason: str = ""


class MigrateRequest(BaseModel):
    destination: str  # the destination's instance id
    address: str  # its RPC address
    version: int  # the plan's version group: refused if the source now holds another
    kv: bool = True  # move KV state where the engine can; False: tokens + re-prefill


class MigratedSequence(BaseModel):
    """One trajectory on its way between rollouts: its assignment, and where it stands."""

    assignment: Assignment
    version: int
    started_at: float
    acked: int  # tokens the data role already has
    sequence: InflightSequence  # tokens, logprobs and maybe KV, exactly as the engine had them
    env_spans: list[tuple[int, int]] = Field(default_factory=list)  # an episode's observations
    waiting: bool = False  # an episode waiting for the environment (not in any engine)


class Handoff(BaseModel):
    source: str
    version: int
    sequences: list[MigratedSequence]


class HandoffReply(BaseModel):
    accepted: list[str] = Field(default_factory=list)
    refused: str = ""  # why nothing was accepted ("" when everything was)


class MigrateReport(BaseModel):
    source: str
    destination: str
    version: int
    moved: list[str] = Field(default_factory=list)  # now running on the destination
    returned: list[str] = Field(default_factory=list)  # refused: running here again
    mode: Literal["kv", "reprefill", "none"] = "none"
    tokens: int = 0  # prompt + response tokens moved
    kv_tokens: int = 0  # of which covered by KV state (not recomputed)
    kv_bytes: int = 0
    export_s: float = 0.0  # taking the sequences out of the engine (KV copy included)
    handoff_s: float = 0.0  # lease transfer + the destination's accept (transfer + import)
    total_s: float = 0.0
    error: str = ""


class RolloutApi:
    """Endpoints of the rollout role. Declaration only; ``RolloutService`` serves them."""

    @endpoint
    async def weights(self) -> WeightsHistory:
        raise NotImplementedError

    @endpoint
    async def state(self) -> RolloutState:
        raise NotImplementedError

    @endpoint
    async def drain(self, req: DrainRequest) -> RolloutState:
        raise NotImplementedError

    @endpoint
    async def resume(self) -> RolloutState:
        raise NotImplementedError

    @endpoint
    async def migrate(self, req: MigrateRequest) -> MigrateReport:
        raise NotImplementedError

    @endpoint
    async def accept(self, req: Handoff) -> HandoffReply:
        raise NotImplementedError


# -- what its heartbeats carry -----------------------------------------------------------------


class RolloutStats(VersionedStats):
    """``RolloutService.stats``: the engine's load, the rollout's phase, and the facts the repack
    planner reads beside it."""

    kv_cache_usage: float = 0.0  # fraction of the engine's KV-cache blocks in use
    running: int = 0
    waiting: int = 0
    in_flight: int = 0  # trajectories it holds (running, waiting or being handed over)
    leased_ahead: int = 0  # fresh leases in hand, not started yet (``rollout.lease_ahead``)
    env_waiting: int = 0  # episodes out of the engine, waiting for the environment's answer
    generated_tokens: int = 0
    completed: int = 0
    failed: int = 0
    paused_for_weights: bool = False  # a newer version waits: it takes nothing until loaded
    operator_drain: bool = False  # an operator's drain: it takes nothing until resumed
    migrating: bool = False  # a repack is moving its trajectories out
    starved: bool = False  # its last take found the prompt pool dry
    phase: RolloutPhase = RolloutPhase.RUNNING  # on the wire: its ``code``

    @field_validator("phase", mode="before")
    @classmethod
    def _phase_of_code(cls, value: object) -> object:
        return RolloutPhase.of_code(value) if isinstance(value, int | float) else value

    @field_serializer("phase")
    def _phase_code(self, phase: RolloutPhase) -> int:
        return phase.code
