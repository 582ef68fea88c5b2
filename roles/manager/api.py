"""The manager's contracts beside membership: the relay chain and the trainer group's rendezvous.

Membership (join, heartbeat, leave) is in :mod:`laminar.runtime.membership` because every
service's host speaks it; what is here only some roles speak: relays and the trainer's publisher
follow the chain (:class:`RelayChainApi`, :class:`ChainFollower`), a trainer and its rank
processes meet through :class:`RendezvousApi`. The manager serves both; how, and why the chain is
planned as it is, is in ``docs/training.md``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Annotated

from pydantic import BaseModel, Field

from laminar.roles.relay.api import RelayStats
from laminar.roles.rollout.api import RolloutStats
from laminar.roles.trainer.api import TrainerStats
from laminar.runtime.endpoint import endpoint, stream
from laminar.runtime.peers import Outage, follow_stream
from laminar.runtime.rpc.client import QUIET_STREAM_TIMEOUT_S, RpcClient, remote
from laminar.runtime.stats import HeartbeatStats

# -- members' heartbeat stats, as the manager parses them ----------------------------------------

#: the stats model of each built-in role (each in its role's ``api``); any other role's stats
#: parse as the base model, every key kept.
STATS_BY_ROLE: dict[str, type[HeartbeatStats]] = {
    "rollout": RolloutStats,
    "trainer": TrainerStats,
    "sim_trainer": TrainerStats,
    "relay": RelayStats,
}


def parse_stats(role: str, raw: Mapping[str, float]) -> HeartbeatStats | None:
    """``raw`` as the model of ``role`` (None: no heartbeat yet)."""
    return STATS_BY_ROLE.get(role, HeartbeatStats).parse(raw)


# -- the relay chain -----------------------------------------------------------------------------


class RelayInfo(BaseModel):
    instance: str
    address: str  # RPC address
    weights: str  # where it accepts weight transfers (tcp:// or ucx://)
    host: str = ""


class ChainView(BaseModel):
    """One epoch of the chain; ``relays[0]`` is the master."""

    incarnation: str = ""  # the manager's, picked at its start ("": none yet)
    epoch: int = 0  # counts from 1 within one incarnation; 0: never planned
    relays: list[RelayInfo] = Field(default_factory=list)
    reason: str = ""
    changed_at: float = 0.0  # manager's wall clock

    @property
    def master(self) -> RelayInfo | None:
        return self.relays[0] if self.relays else None

    def position(self, instance: str) -> int | None:
        for i, relay in enumerate(self.relays):
            if relay.instance == instance:
                return i
        return None

    def downstream_of(self, instance: str) -> RelayInfo | None:
        pos = self.position(instance)
        if pos is None or pos + 1 >= len(self.relays):
            return None
        return self.relays[pos + 1]

    def supersedes(self, seen: ChainView) -> bool:
        """Whether a follower that applied ``seen`` should apply this view."""
        return self.incarnation != seen.incarnation or self.epoch > seen.epoch


class ChainWatch(BaseModel):
    """Yield the current view at once if it supersedes (``incarnation``, ``since_epoch``)."""

    since_epoch: int = -1
    incarnation: str = ""  # of the view ``since_epoch`` counts in ("": none seen yet)


class RelayChainApi:
    """Served by the manager; followed by relays (their downstream) and the trainer (master)."""

    @endpoint
    async def chain(self) -> ChainView:
        raise NotImplementedError

    @stream
    async def watch_chain(self, req: ChainWatch) -> AsyncIterator[ChainView]:
        raise NotImplementedError
        yield  # pragma: no cover


class ChainFollower:
    """Which chain views are news to a follower, and where its next subscription starts.

    Each subscription asks for views after the last one applied, so a re-subscription after a
    broken watch (the manager restarted, a network blip) applies no view twice; a restarted
    manager's views are taken whatever their epochs (:meth:`ChainView.supersedes`). The loop
    around it is :func:`laminar.runtime.peers.follow_stream` (``ctx.follow`` in a service).
    """

    def __init__(self, manager: RpcClient, apply: Callable[[ChainView], None]) -> None:
        self._chain = remote(RelayChainApi, manager)
        self._apply = apply
        self.seen = ChainView()

    def subscribe(self) -> AsyncIterator[ChainView]:
        return self._chain.watch_chain.options(timeout=QUIET_STREAM_TIMEOUT_S).stream(
            ChainWatch(since_epoch=self.seen.epoch, incarnation=self.seen.incarnation)
        )

    def apply(self, view: ChainView) -> None:
        if view.supersedes(self.seen):
            self.seen = view
            self._apply(view)


async def follow_chain(
    manager: RpcClient,
    apply: Callable[[ChainView], None],
    *,
    retry_s: float,
    on_error: Callable[[Exception], None],
    sleep: Callable[[float], Awaitable[None]],
) -> None:
    """Call ``apply`` with every new chain view, until cancelled (for a follower that is not a
    service, the trainer's publisher; a service uses ``ctx.follow`` with a :class:`ChainFollower`).

    A broken watch is reported to ``on_error`` (once per outage) and re-subscribed after
    ``retry_s`` from the last view applied.
    """
    follower = ChainFollower(manager, apply)
    await follow_stream(
        follower.subscribe, follower.apply, backoff=retry_s, sleep=sleep, outage=Outage(on_error)
    )


# -- the trainer group's rendezvous ----------------------------------------------------------------


#: The longest a seat request may wait at the manager: well inside any RPC timeout.
MAX_SEAT_WAIT_S = 30.0


class GroupOffer(BaseModel):
    """Rank 0 forming a new generation of its group."""

    group: str = "trainer"  # which group (one per trainer)
    instance: str  # rank 0's member instance: its death withdraws the offer
    address: str  # tcp://HOST:PORT of the group's store, on rank 0's host
    world: Annotated[int, Field(ge=2)]
    config: str  # the trainer's config (JSON): every rank runs rank 0's settings
    state_path: str | None = None  # the checkpoint every rank loads (None: the initial model)
    timeout_s: Annotated[float, Field(gt=0)] = 600.0  # the group's collective timeout


class GroupFormed(BaseModel):
    generation: int  # the offer's number, newer than any generation offered or asked about


class SeatRequest(BaseModel):
    group: str = "trainer"
    instance: str  # the rank process's member instance (the same seat if it asks again)
    after: int = 0  # a generation newer than this one (the last this process served)
    wait_s: Annotated[float, Field(ge=0, le=MAX_SEAT_WAIT_S)] = 5.0


class Seat(BaseModel):
    """A place in one generation of the group; ``generation`` 0: none open (ask again)."""

    generation: int = 0
    rank: int = 0
    world: int = 0
    address: str = ""
    config: str = ""
    state_path: str | None = None
    timeout_s: float = 600.0


class RendezvousApi:
    """Served by the manager; called by a trainer (offer) and its rank processes (seat)."""

    @endpoint
    async def offer_group(self, req: GroupOffer) -> GroupFormed:
        raise NotImplementedError

    @endpoint
    async def take_seat(self, req: SeatRequest) -> Seat:
        raise NotImplementedError
