"""The membership contract between every service and the manager.

It lives here, not in ``roles/``, because every role's runtime speaks it (join, heartbeat,
leave) while only the manager role implements it. :class:`MembershipApi` declares the endpoints;
``roles.manager.ManagerService`` serves them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, TypeVar

from pydantic import BaseModel, Field

from .endpoint import endpoint, stream
from .stats import HeartbeatStats

S = TypeVar("S", bound=HeartbeatStats)

MemberState = Literal["alive", "dead", "left"]


class JoinRequest(BaseModel):
    instance: str
    role: str
    address: str
    metrics: str | None = None
    host: str = ""
    pid: int = 0
    endpoints: dict[str, str] = Field(default_factory=dict)  # extra addresses, e.g. "weights"


class Member(JoinRequest):
    """A joined service as the manager sees it."""

    state: MemberState = "alive"
    reason: str = ""
    joined_at: float = 0.0  # wall clock of the manager
    last_seen: float = 0.0  # wall clock of the manager
    incarnation: int = 1  # bumps each time the same instance id joins again (a restart)
    stats: dict[str, float] = Field(default_factory=dict)  # the last heartbeat's, as sent

    def stats_as(self, model: type[S]) -> S | None:
        """The last heartbeat's stats as the model of this member's role (its ``api``), None
        before the first heartbeat. Readers use this, never ``stats[key]``: a misspelled field
        fails loudly, a misspelled key reads as 0."""
        return model.parse(self.stats)


class JoinReply(BaseModel):
    cluster: str
    manager: str
    incarnation: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class Heartbeat(BaseModel):
    instance: str
    stats: dict[str, float] = Field(default_factory=dict)


class HeartbeatAck(BaseModel):
    rejoin: bool = False  # the manager does not know this instance (it restarted): join again


class LeaveRequest(BaseModel):
    instance: str
    reason: str = "shutdown"


class ClusterStatus(BaseModel):
    cluster: str
    manager: str
    now: float
    heartbeat_timeout_s: float
    members: list[Member]
    heartbeat_interval_s: float = 0.0
    incarnation: str = ""  # the manager's: a new random id at each start
    started_at: float = 0.0  # the manager's wall clock at its start

    def unsettled_s(self) -> float:
        """How much longer ``members`` may lack members that are alive (0: it is complete).

        A restarted manager knows nobody: each member is told to rejoin by its next heartbeat and
        joins one interval later. A member that has not rejoined a heartbeat timeout (plus that
        interval) after the manager's start is as silent as one the manager would have declared
        dead, so from then on a member missing from the list can be treated as not alive. Before
        then, releasing what a missing member holds would take work from a live one.
        """
        settle = self.heartbeat_timeout_s + self.heartbeat_interval_s
        return max(0.0, settle - (self.now - self.started_at))


class WatchRequest(BaseModel):
    snapshot: bool = True  # first yield every current member as a "snapshot" event


class MemberEvent(BaseModel):
    event: Literal["snapshot", "joined", "rejoined", "dead", "left", "revived"]
    member: Member


class MembershipApi:
    """Endpoints of the membership service. Declaration only; the manager serves them."""

    @endpoint
    async def join(self, req: JoinRequest) -> JoinReply:
        raise NotImplementedError

    @endpoint
    async def heartbeat(self, req: Heartbeat) -> HeartbeatAck:
        raise NotImplementedError

    @endpoint
    async def leave(self, req: LeaveRequest) -> None:
        raise NotImplementedError

    @endpoint
    async def status(self) -> ClusterStatus:
        raise NotImplementedError

    @stream
    async def watch(self, req: WatchRequest) -> AsyncIterator[MemberEvent]:
        raise NotImplementedError
        yield  # pragma: no cover - makes this an async generator
