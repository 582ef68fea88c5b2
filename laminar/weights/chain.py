"""The relay chain: who is master, who forwards to whom, and how it heals.

The manager owns the order; relays and the trainer follow it through a watch stream. The planning
rule is pure and deliberately boring, because it runs exactly when something just broke:

* survivors keep their relative order, so a dead relay is routed around by linking its upstream
  to its downstream (the paper's O(1) repair: relay1 -> relay3 when relay2 dies) and nobody else
  changes neighbours;
* a newly joined relay goes to the tail, where it disturbs no transfer in progress;
* the master is the head. When it dies the next relay becomes master; it already holds the newest
  version (or the prefix that reached it), and the trainer, told of the new head, resumes there.

A relay that was partway through receiving keeps its chunks: its new upstream resumes at the first
missing chunk (see ``transfer.py``).

Epochs count from 1 in each *incarnation* of the manager (a random id it picks at start), and a
view is newer than another when it comes from another incarnation or has a higher epoch. Why not
the epoch alone: a restarted manager counts from 1 again, and followers comparing epochs only
would ignore every view of the new manager until its count passed the old one, never routing
around a relay that died meanwhile. An incarnation has no order; the manager a follower can reach
is the one whose views count, so any view of a new incarnation is taken.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from pydantic import BaseModel, Field

from laminar.endpoint import endpoint, stream
from laminar.peers import Outage, follow_stream
from laminar.rpc_client import QUIET_STREAM_TIMEOUT_S, RpcClient, remote


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


def plan_chain(previous: Sequence[RelayInfo], alive: Sequence[RelayInfo]) -> list[RelayInfo]:
    """The new order: survivors of ``previous`` in their order, then newcomers in given order."""
    by_id = {r.instance: r for r in alive}
    kept = [by_id[r.instance] for r in previous if r.instance in by_id]
    seen = {r.instance for r in kept}
    return kept + [r for r in alive if r.instance not in seen]


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
    around it is :func:`laminar.peers.follow_stream` (``ctx.follow`` in a service).
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
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
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
