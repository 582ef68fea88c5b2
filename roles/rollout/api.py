"""The rollout role's endpoints and messages, as the manager, other rollouts and tools see them.

Declaration only: :class:`RolloutApi` has the signatures, ``RolloutService`` serves them.

Repack migration is two calls. The manager asks the *source* to ``migrate`` everything it has in
flight to a destination; the source exports its sequences from the engine (with their KV state
where the engine can export it), moves their leases in the data role, and hands them to the
destination's ``accept``. Whatever the destination refuses goes back into the source's engine, so
a failed migration loses nothing and changes no trajectory's version.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from laminar.endpoint import endpoint
from laminar.engines import InflightSequence
from laminar.membership import RolloutPhase
from laminar.trajectory import Assignment


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
