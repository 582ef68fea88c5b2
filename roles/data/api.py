"""The data role's endpoints and messages, as its clients (rollouts, trainer, tools) see them.

Declaration only: :class:`DataApi` has the signatures, ``DataService`` serves them. Every message
that acknowledges something is answered only after it is durable (see ``store``), and every one
can be repeated safely: ``take`` re-delivers leases whose reply was lost, ``report`` keys tokens
by offset and completions by trajectory id.

A report is judged item by item: one bad item (a gap in a trajectory's tokens, a completion of an
unknown trajectory, a non-finite logprob) is refused alone, named in ``ReportReply.rejected`` with
its reason, while the rest of the report is stored. The rollout drops what was refused and never
sends it again, so a bad item cannot make a report fail forever.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from laminar.runtime.endpoint import endpoint
from laminar.trajectory import Assignment, PartialChunk, TokenIds, Trajectory


class TakeRequest(BaseModel):
    rollout: str
    max_count: Annotated[int, Field(ge=1)]
    version: int  # the rollout's weight version: resumes must match it
    holding: list[str] = Field(default_factory=list)  # trajectory ids it has in flight now
    wait_s: Annotated[float, Field(ge=0, le=60)] = 0.0  # long-poll: wait this long for work


class FailedItem(BaseModel):
    """A trajectory its rollout could not generate (its engine refused the request), and why.

    The data role records it as failed for good: never handed out again (a bad prompt must fail
    alone, not take every rollout down in turn)."""

    trajectory_id: str
    reason: str


class Report(BaseModel):
    """What a rollout sends every flush interval: new tokens, trajectories that finished, and
    trajectories that failed."""

    rollout: str
    partials: list[PartialChunk] = Field(default_factory=list)
    completed: list[Trajectory] = Field(default_factory=list)
    failed: list[FailedItem] = Field(default_factory=list)


class RejectedItem(BaseModel):
    """One item of a report the data role refused (the rest of the report was stored)."""

    trajectory_id: str
    item: Literal["partial", "completed", "failed"]
    reason: str


class ReportReply(BaseModel):
    drop: list[str] = Field(default_factory=list)  # ids no longer leased to this rollout
    duplicates: int = 0  # completions that had already arrived (ignored)
    rejected: list[RejectedItem] = Field(default_factory=list)  # refused items: never resend


class LeaseTransfer(BaseModel):
    """Repack moved these in-flight trajectories from ``source`` to ``destination``.

    Only leases held by ``source`` move (ids already leased to ``destination`` count as moved, so
    a repeated call is a no-op). The destination's next ``take`` does not treat a moved lease as
    lost for ``HANDOFF_GRACE_S``, the time the handoff has to arrive there.
    """

    trajectory_ids: list[str]
    source: str
    destination: str


class Transferred(BaseModel):
    moved: list[str] = Field(default_factory=list)


class LeaseRelease(BaseModel):
    """``rollout`` gives back leases it took but has not started (it was told to drain, or its
    weights changed before it started them). Only samples still leased to it with no progress on
    this lease go back to the front of the queue; the rest are left as they are."""

    rollout: str
    trajectory_ids: list[str]


class Released(BaseModel):
    released: list[str] = Field(default_factory=list)


class SampleRequest(BaseModel):
    """The trainer asks for up to ``n`` scored trajectories (consumed: never handed out again).

    Every consumed trajectory gets a *consume seq* (1, 2, ... over the store's life). A trainer
    that commits the reply's ``cursor`` with its checkpoint and, after a restart, asks with
    ``after=cursor`` first gets back the trajectories it had taken but not committed (consume seq
    > ``after``, in consume order, up to ``n``), then fresh ones: each is trained exactly once.
    ``after=None``: fresh ones only.

    ``whole_groups``: ``n`` must be a multiple of the role's ``samples_per_prompt``; the reply holds
    only complete groups (every sample of a prompt scored), members adjacent by sample index.

    Waits up to ``wait_s`` for ``n`` (or, with whole groups, ``n // samples_per_prompt`` groups);
    at the deadline returns what there is, maybe nothing.
    """

    n: Annotated[int, Field(ge=1)]
    trainer_version: int = 0  # staleness of a trajectory = trainer_version - its version
    wait_s: Annotated[float, Field(ge=0, le=600)] = 0.0
    after: Annotated[int, Field(ge=0)] | None = None  # the trainer's last committed cursor
    whole_groups: bool = False


class Assignments(BaseModel):
    items: list[Assignment] = Field(default_factory=list)


class Trajectories(BaseModel):
    items: list[Trajectory] = Field(default_factory=list)
    seqs: list[int] = Field(default_factory=list)  # consume seq of each item (ascending)
    cursor: int = 0  # max of ``seqs``; the request's ``after`` (or 0) when empty
    redelivered: int = 0  # leading items that were consumed before (re-delivered after ``after``)
    # Rewards of every trajectory scored since the previous ``sample`` (whatever became of it:
    # with ``drop_constant_groups`` the trained batch's mean reward is not the policy's).
    scored: int = 0
    scored_reward_sum: float = 0.0


class CompletedIds(BaseModel):
    ids: list[str]


class PartialLengths(BaseModel):
    lengths: dict[str, int]  # trajectory id -> acknowledged partial tokens


class DataStatus(BaseModel):
    queued: int
    leased: int
    done: int
    trajectories: int
    scored: int
    consumed: int
    evicted: int  # by the eviction policy or for staleness
    stale_dropped: int = 0  # evicted because staler than the bound (staleness action ``drop``)
    filtered: int = 0  # evicted as uninformative groups (``drop_constant_groups``)
    held: int = 0  # skipped for staleness by the last sample (action ``hold``), still buffered
    failed: int = 0  # trajectories recorded as failed (never handed out again), quarantined incl.
    quarantined: int = 0  # failed because their rollouts kept dying while holding them
    orphaned: int = 0  # evicted: members of a group too many other members of which failed
    cancelled: int = 0  # redundant samples withdrawn: their group finished without them
    focus_skipped: int = 0  # prompts drawn and not queued (``focus``) by this incarnation
    prompts_left_out: int = 0  # left out at load: max_prompt_tokens, overlong_prompts: skip
    focus_rates: dict[str, float] = {}  # ``focus``: class -> admit probability now
    cursor: int = 0  # the highest consume seq handed out so far
    reward_errors: int
    tokens: int
    partial_tokens: int
    exhausted: bool  # every prompt of every epoch has been queued
    finished: bool  # exhausted, and every trajectory is done and scored
    mean_reward: float | None
    leases: dict[str, int]  # rollout -> leased trajectories


class EnvStepRequest(BaseModel):
    """A rollout's episode ended a model turn at a stop token: the environment's answer, please.

    Carries the whole response so far (the data role may have to rebuild the episode by replaying
    its earlier actions). Idempotent: asked again for the same turn (a retry, or the rollout a
    repack moved the episode to), it gets the same answer, from the step already made."""

    rollout: str
    trajectory_id: str
    version: int
    response_token_ids: TokenIds
    env_spans: list[tuple[int, int]] = Field(default_factory=list)


class EnvStepReply(BaseModel):
    observation_token_ids: TokenIds = Field(default_factory=list)  # append, then generate on
    done: bool = False  # the episode is over: complete the trajectory as it is
    error: str | None = None  # the step failed (the episode is over, without a reward)
    dropped: bool = False  # not leased to the asking rollout (any more): stop working on it
    wait_s: float = 0.0  # queued for a free environment slot
    step_s: float = 0.0  # the environment's step itself


class DataApi:
    """Endpoints of the data role. Declaration only; ``DataService`` serves them."""

    @endpoint
    async def take(self, req: TakeRequest) -> Assignments:
        raise NotImplementedError

    @endpoint
    async def report(self, req: Report) -> ReportReply:
        raise NotImplementedError

    @endpoint
    async def transfer(self, req: LeaseTransfer) -> Transferred:
        raise NotImplementedError

    @endpoint
    async def release(self, req: LeaseRelease) -> Released:
        raise NotImplementedError

    @endpoint
    async def sample(self, req: SampleRequest) -> Trajectories:
        raise NotImplementedError

    @endpoint
    async def status(self) -> DataStatus:
        raise NotImplementedError

    @endpoint
    async def env_step(self, req: EnvStepRequest) -> EnvStepReply:
        raise NotImplementedError

    @endpoint
    async def completed_ids(self) -> CompletedIds:
        raise NotImplementedError

    @endpoint
    async def partial_lengths(self) -> PartialLengths:
        raise NotImplementedError
