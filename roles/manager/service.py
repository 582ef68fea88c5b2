"""The manager role (control plane): membership and liveness, the relay chain, repack, admin.

A member is *dead* as soon as either signal says so:

* its connection to the manager closed without a ``leave`` (a process killed with -9 has its
  sockets closed by the kernel, so this is immediate, the paper's "instantly without a timeout");
* no heartbeat for ``cluster.heartbeat_timeout_s`` (a hung process, a cut network: no socket
  event tells us, so the timeout does), counted from when the manager was listening
  (:mod:`.liveness`: a manager that was stopped does not find everyone silent on waking).

A dead member that heartbeats again is *revived* (a network blip); a restarted process joins again
under the same instance id and gets a new incarnation.

The manager also orders the relay chain (``laminar.roles.manager.api``): every membership change of
a
relay re-plans it at once, in the same call that noticed the change, and pushes the new view to
every ``watch_chain`` stream, so a dead relay is routed around as fast as its socket closes.

Each start of the manager is a new *incarnation* (a random id, in every chain view and in
``status``). A restarted manager knows nobody until members rejoin (their next heartbeat is told
to), so its chain counts epochs afresh and followers take its views by the incarnation
(``ChainView.supersedes``); and ``status.started_at`` tells readers of the member list, such as the
data role, whether it has had time to fill up again (``ClusterStatus.unsettled_s``).

Heartbeat stats stay a ``dict[str, float]`` on the wire; the manager reads them only through the
typed models of ``laminar.runtime.stats``. Stats that do not parse as the member's role's model (a
fractional count, a flag other than 0/1) are refused with a warning naming the key, and the last
good ones kept: every reader of the member table sees stats that parse, and a member's liveness
never depends on its numbers.

Repack (``repack.RepackController``) runs here: rollout heartbeats are its loads, the head
relay's version stream is its publish trigger. The admin HTTP API and the dashboard
(``admin.AdminServer``) read and steer all of it through ``view.ManagerView``; everything they
show also goes on the event log (``events.EventLog``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import AsyncIterator
from typing import ClassVar

from pydantic import Field, ValidationError

from laminar.repack import RepackPolicy
from laminar.roles.manager.api import (
    ChainView,
    ChainWatch,
    GroupFormed,
    GroupOffer,
    RelayChainApi,
    RelayInfo,
    RendezvousApi,
    Seat,
    SeatRequest,
    parse_stats,
)
from laminar.roles.manager.chain import plan_chain
from laminar.roles.relay.api import LatestRequest, RelayApi, SharedVersion
from laminar.roles.rollout.api import RolloutApi
from laminar.roles.trainer.api import TrainerStats
from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.endpoint import endpoint, stream
from laminar.runtime.membership import (
    ClusterStatus,
    Heartbeat,
    HeartbeatAck,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    Member,
    MemberEvent,
    MembershipApi,
    WatchRequest,
)
from laminar.runtime.rpc.client import QUIET_STREAM_TIMEOUT_S
from laminar.runtime.rpc.server import current_call
from laminar.runtime.service import Service

from .admin import AdminServer
from .events import EventLog
from .liveness import check_liveness
from .rendezvous import GroupBoard
from .repack import RepackController


class ManagerConfig(ServiceConfig):
    bind: str = Field("tcp://127.0.0.1:7420", description="Where members reach the manager.")
    liveness_check_s: float = Field(0.1, gt=0, description="How often silence is checked.")
    admin: str | None = Field(
        "127.0.0.1:7421",
        description="host:port of the admin HTTP API and dashboard (port 0: any free port; "
        "null: off). Loopback by default; the cluster token is the bearer token.",
    )
    repack: RepackPolicy = Field(
        default_factory=RepackPolicy, description="The initial repack policy (changeable live)."
    )


class ManagerService(Service, MembershipApi, RelayChainApi, RendezvousApi):
    role: ClassVar[str] = "manager"
    config_model: ClassVar[type[ServiceConfig]] = ManagerConfig
    config: ManagerConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.members: dict[str, Member] = {}
        self._connections: dict[int, str] = {}  # RPC connection id -> instance heard on it
        self._watchers: set[asyncio.Queue[MemberEvent]] = set()
        self._stopping = False
        self._refused: dict[str, str] = {}  # instance -> why its last stats were refused
        self.incarnation = secrets.token_hex(8)
        self.started_at = ctx.clock.wall()
        self._chain = ChainView(incarnation=self.incarnation)
        self._chain_changed = asyncio.Event()
        self._published = -1  # the newest version seen at the head relay (publishes follower)
        self._head = ""  # the relay that follower streams from
        self.events = EventLog()
        self.repack = RepackController(
            self.config.repack,
            self.events,
            lambda address: ctx.connect(RolloutApi, address),
            ctx.clock,
            ctx.registry,
            self.log,
        )
        self.admin: AdminServer | None = None
        self.groups = GroupBoard(ctx.clock)  # trainer rank groups (laminar.roles.manager.api)

    async def on_start(self) -> None:
        assert self.ctx.address is not None
        now = self.ctx.clock.wall()
        endpoints = {}
        if self.config.admin is not None:
            self.admin = AdminServer(self)
            endpoints["admin"] = await self.admin.start(self.config.admin)
            self.log.info("admin API", url=endpoints["admin"])
        self.members[self.ctx.instance] = Member(
            instance=self.ctx.instance,
            role=self.role,
            address=self.ctx.address,
            host=socket.gethostname(),
            pid=os.getpid(),
            joined_at=now,
            last_seen=now,
            endpoints=endpoints,
        )
        self.spawn(
            check_liveness(
                self.members,
                self.ctx.instance,
                self.ctx.clock,
                self.ctx.cluster.heartbeat_timeout_s,
                self.config.liveness_check_s,
                self._mark_dead,
                self.log,
            ),
            name="liveness",
        )
        self.spawn(self.repack.run_periodic(), name="repack")
        self.ctx.follow(
            "publishes",
            self._head_versions,
            self._on_head_version,
            backoff=0.5,
            expected=self._head_left,  # a relay stopping says so first (a run's clean stop)
        )

    async def on_stop(self) -> None:
        self._stopping = True  # our own listener closing drops every connection: not a death
        if self.admin is not None:
            await self.admin.stop()

    @property
    def relay_chain(self) -> ChainView:
        """The relay chain as last planned (``view.ManagerView``)."""
        return self._chain

    # -- endpoints --

    @endpoint
    async def join(self, req: JoinRequest) -> JoinReply:
        now = self.ctx.clock.wall()
        old = self.members.get(req.instance)
        incarnation = old.incarnation + 1 if old is not None else 1
        member = Member(**req.model_dump(), joined_at=now, last_seen=now, incarnation=incarnation)
        self.members[req.instance] = member
        self._remember_connection(req.instance)
        self._publish("rejoined" if old is not None else "joined", member)
        self.log.info(
            "member joined",
            member=req.instance,
            member_role=req.role,
            address=req.address,
            incarnation=incarnation,
        )
        cluster = self.ctx.cluster
        return JoinReply(
            cluster=cluster.name,
            manager=self.ctx.instance,
            incarnation=incarnation,
            heartbeat_interval_s=cluster.heartbeat_interval_s,
            heartbeat_timeout_s=cluster.heartbeat_timeout_s,
        )

    @endpoint
    async def heartbeat(self, req: Heartbeat) -> HeartbeatAck:
        member = self.members.get(req.instance)
        if member is None or member.state == "left":
            return HeartbeatAck(rejoin=True)
        member.last_seen = self.ctx.clock.wall()
        self._take_stats(member, req.stats)
        self._remember_connection(req.instance)
        if member.state == "dead":
            member.state, member.reason = "alive", ""
            self._publish("revived", member)
            self.log.info("member revived", member=req.instance)
        return HeartbeatAck()

    def _take_stats(self, member: Member, raw: dict[str, float]) -> None:
        try:
            stats = parse_stats(member.role, raw)
        except ValidationError as exc:
            why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            if self._refused.get(member.instance) != why:  # once per distinct fault, not per beat
                self.log.warning("heartbeat stats refused", member=member.instance, error=why)
            self._refused[member.instance] = why
            return
        self._refused.pop(member.instance, None)
        previous, member.stats = member.stats, raw
        if isinstance(stats, TrainerStats):
            self._alert_on_growth(member, stats, TrainerStats.parse(previous))
        self.repack.observe(member)

    def _alert_on_growth(
        self, member: Member, now: TrainerStats, before: TrainerStats | None
    ) -> None:
        """Counters that must stay at 0 in a healthy run become events when they grow, so an
        operator watching the event log (or the dashboard) sees silent data loss the moment it
        happens. After a manager restart the first heartbeat re-announces the totals once."""
        was = before.alert_counters() if before is not None else {}
        for what, total in now.alert_counters().items():
            grew = total - was.get(what, 0)
            if grew > 0:
                self.events.publish(
                    "alert",
                    self.ctx.clock.wall(),
                    member=member.instance,
                    member_role=member.role,
                    what=what,
                    new=float(grew),
                    total=float(total),
                )

    @endpoint
    async def leave(self, req: LeaveRequest) -> None:
        member = self.members.get(req.instance)
        if member is not None and member.state != "left":
            member.state, member.reason = "left", req.reason
            self._publish("left", member)
            self.log.info("member left", member=req.instance, reason=req.reason)

    @endpoint
    async def status(self) -> ClusterStatus:
        cluster = self.ctx.cluster
        self.members[self.ctx.instance].last_seen = self.ctx.clock.wall()
        return ClusterStatus(
            cluster=cluster.name,
            manager=self.ctx.instance,
            now=self.ctx.clock.wall(),
            heartbeat_timeout_s=cluster.heartbeat_timeout_s,
            members=list(self.members.values()),
            heartbeat_interval_s=cluster.heartbeat_interval_s,
            incarnation=self.incarnation,
            started_at=self.started_at,
        )

    @stream
    async def watch(self, req: WatchRequest) -> AsyncIterator[MemberEvent]:
        queue: asyncio.Queue[MemberEvent] = asyncio.Queue(maxsize=10_000)
        self._watchers.add(queue)
        try:
            if req.snapshot:
                for member in list(self.members.values()):
                    yield MemberEvent(event="snapshot", member=member.model_copy())
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)

    @endpoint
    async def chain(self) -> ChainView:
        return self._chain

    @stream
    async def watch_chain(self, req: ChainWatch) -> AsyncIterator[ChainView]:
        # A follower of another incarnation gets our first planned view, whatever it had seen.
        # Epoch 0 (nothing planned yet) is never sent: a follower starts from that empty view
        # anyway, and after our restart it would only tear down a chain about to be rebuilt.
        seen = req.since_epoch if req.incarnation == self.incarnation else 0
        while True:
            changed = self._chain_changed
            if self._chain.epoch > seen:
                seen = self._chain.epoch
                yield self._chain
            else:
                await changed.wait()

    def _replan_chain(self, reason: str) -> None:
        alive = [
            RelayInfo(
                instance=m.instance,
                address=m.address,
                weights=m.endpoints.get("weights", ""),
                host=m.host,
            )
            for m in self.members.values()
            if m.role == "relay" and m.state == "alive" and m.endpoints.get("weights")
        ]
        relays = plan_chain(self._chain.relays, alive)
        if relays == self._chain.relays:
            return
        self._chain = ChainView(
            incarnation=self.incarnation,
            epoch=self._chain.epoch + 1,
            relays=relays,
            reason=reason,
            changed_at=self.ctx.clock.wall(),
        )
        event, self._chain_changed = self._chain_changed, asyncio.Event()
        event.set()
        self.log.info(
            "relay chain",
            epoch=self._chain.epoch,
            order=[r.instance for r in relays],
            reason=reason,
        )

    # -- trainer groups (laminar.roles.manager.api) --

    @endpoint
    async def offer_group(self, req: GroupOffer) -> GroupFormed:
        call = current_call.get(None)
        formed = self.groups.offer(req, call.connection_id if call is not None else None)
        self.log.info(
            "trainer group offered", group=req.group, generation=formed.generation,
            world=req.world, address=req.address, by=req.instance,
        )  # fmt: skip
        return formed

    @endpoint
    async def take_seat(self, req: SeatRequest) -> Seat:
        return await self.groups.take(req)

    # -- publishes --

    async def _head_versions(self) -> AsyncIterator[SharedVersion]:
        """The head relay's versions newer than the last one seen (whichever relay heads now)."""
        while not self._chain.relays:  # no relay yet: wait for the chain to name a head
            await self._chain_changed.wait()
        head = self._chain.relays[0]
        self._head = head.instance
        relay = self.ctx.connect(RelayApi, head.address)
        return relay.versions.options(timeout=QUIET_STREAM_TIMEOUT_S).stream(
            LatestRequest(newer_than=self._published)
        )

    def _head_left(self) -> bool:
        """The relay the publishes follower streamed from has left the cluster (it said so)."""
        member = self.members.get(self._head)
        return member is not None and member.state == "left"

    async def _on_head_version(self, shared: SharedVersion) -> None:
        """Each new version at the head is a publish (a repack trigger)."""
        if shared.available and shared.version > self._published:
            first, self._published = self._published < 0, shared.version
            if not first:  # the version the head had when we started is no news
                await self.repack.on_publish(shared.version)

    # -- liveness --

    def on_disconnect(self, connection_id: int) -> None:
        for generation in self.groups.disconnected(connection_id):
            self.log.info("trainer group withdrawn: its rank 0 went away", generation=generation)
        instance = self._connections.pop(connection_id, None)
        member = self.members.get(instance) if instance else None
        if member is not None and member.state == "alive" and not self._stopping:
            self._mark_dead(member, "connection to the manager lost")

    def _mark_dead(self, member: Member, reason: str) -> None:
        member.state, member.reason = "dead", reason
        self._publish("dead", member)
        self.log.warning(
            "member dead", member=member.instance, member_role=member.role, reason=reason
        )

    def _remember_connection(self, instance: str) -> None:
        call = current_call.get(None)
        if call is not None:
            self._connections[call.connection_id] = instance

    def _publish(self, event: str, member: Member) -> None:
        ev = MemberEvent(event=event, member=member.model_copy())
        now = self.ctx.clock.wall()
        if event == "dead":
            self.events.publish(
                "failure", now, what="member", member=member.instance,
                member_role=member.role, reason=member.reason,
            )  # fmt: skip
        else:
            self.events.publish(
                "membership", now, event=event, member=member.instance, member_role=member.role
            )
        if event in ("dead", "left"):
            self.repack.forget(member.instance)
        if member.role == "relay":
            self._replan_chain(f"{member.instance} {event}")
        for queue in list(self._watchers):
            if queue.full():  # a watcher that stopped reading is cut off, never blocks us
                self._watchers.discard(queue)
                continue
            queue.put_nowait(ev)
