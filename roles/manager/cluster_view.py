"""What the admin API shows of the cluster: ``/v1/status``, ``/v1/learning`` and the scrape-time
gauges.

Read from the manager's live view (``view.ManagerView``: members and their heartbeat stats,
typed by ``laminar.runtime.stats``; the relay chain; the event log), refined by asking the data
role, the
trainer, the relays and the rollouts concurrently with a short timeout each: a role that does not
answer is null and named in ``errors``, never a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from laminar.roles.data.api import DataApi, DataStatus
from laminar.roles.relay.api import RelayApi, RelayStatus
from laminar.roles.rollout.api import RolloutApi, RolloutState, RolloutStats
from laminar.roles.trainer.api import LearningApi, LearningRequest, TrainerApi, TrainerStats
from laminar.runtime.errors import RpcError
from laminar.runtime.membership import Member

from .openapi import (
    AdminStatus,
    ChainSummary,
    LearningView,
    RelayView,
    RolloutView,
    StalenessSummary,
    TrainerView,
)
from .view import ManagerView

STATUS_TIMEOUT_S = 1.0  # per role
TRAINER_ROLES = ("trainer", "sim_trainer")  # whoever serves LearningApi


def rollout_state(member: Member, stats: RolloutStats | None) -> str:
    """Its membership state unless alive; then its phase (``unknown`` before its first beat)."""
    if member.state != "alive":
        return member.state
    if stats is None:
        return "unknown"
    return stats.phase


class ScrapeGauges:
    """Gauges computed when scraped, from the manager's live view."""

    def __init__(self, manager: ManagerView) -> None:
        self.manager = manager

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[GaugeMetricFamily]:
        members = list(self.manager.members.values())
        by_state = GaugeMetricFamily(
            "laminar_admin_members", "Members by role and state", labels=["role", "state"]
        )
        counts: dict[tuple[str, str], int] = {}
        for m in members:
            counts[(m.role, m.state)] = counts.get((m.role, m.state), 0) + 1
        for (role, state), n in sorted(counts.items()):
            by_state.add_metric([role, state], n)
        rollouts = [
            (m, m.stats_as(RolloutStats))
            for m in members
            if m.role == "rollout" and m.state == "alive"
        ]
        by_rstate = GaugeMetricFamily(
            "laminar_admin_rollouts", "Live rollouts by state", labels=["state"]
        )
        rstates: dict[str, int] = {}
        for m, st in rollouts:
            state = rollout_state(m, st)
            rstates[state] = rstates.get(state, 0) + 1
        for state, n in sorted(rstates.items()):
            by_rstate.add_metric([state], n)
        by_version = GaugeMetricFamily(
            "laminar_admin_rollouts_by_version",
            "Live rollouts by the weight version they generate with",
            labels=["version"],
        )
        versions: dict[int, int] = {}
        for _, st in rollouts:
            if st is not None:
                versions[st.version] = versions.get(st.version, 0) + 1
        for v, n in sorted(versions.items()):
            by_version.add_metric([str(v)], n)
        kv = GaugeMetricFamily(
            "laminar_admin_rollout_kv_cache_usage", "KV-cache use per rollout", labels=["rollout"]
        )
        uses = []
        for m, st in rollouts:
            if st is not None:
                kv.add_metric([m.instance], st.kv_cache_usage)
                uses.append(st.kv_cache_usage)
        mean = GaugeMetricFamily(
            "laminar_admin_kv_cache_usage_mean", "Mean KV-cache use of the live rollouts"
        )
        mean.add_metric([], sum(uses) / len(uses) if uses else 0.0)
        in_flight = GaugeMetricFamily(
            "laminar_admin_in_flight", "Trajectories in flight over all live rollouts"
        )
        in_flight.add_metric([], sum(st.in_flight for _, st in rollouts if st is not None))
        epoch = GaugeMetricFamily("laminar_admin_chain_epoch", "Relay chain epoch")
        epoch.add_metric([], self.manager.relay_chain.epoch)
        last = GaugeMetricFamily("laminar_admin_last_event", "Sequence number of the newest event")
        last.add_metric([], self.manager.events.last_seq)
        return [by_state, by_rstate, by_version, kv, mean, in_flight, epoch, last]


async def cluster_status(m: ManagerView) -> AdminStatus:
    """Everything ``GET /v1/status`` shows; roles that do not answer in time are null."""
    ctx = m.ctx
    now = ctx.clock.wall()
    members = list(m.members.values())
    errors: dict[str, str] = {}

    async def ask(name: str, coro: Awaitable[Any]) -> Any:
        try:
            async with asyncio.timeout(STATUS_TIMEOUT_S * 1.5):
                return await coro
        except (RpcError, TimeoutError, OSError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            return None

    def alive(role: str) -> list[Member]:
        return [x for x in members if x.role == role and x.state == "alive"]

    data_m, trainer_m = alive("data"), alive("trainer")
    relays = [x for x in members if x.role == "relay"]
    rollouts = [x for x in members if x.role == "rollout"]
    data_call = (
        ask("data", ctx.connect(DataApi, data_m[0].address)
            .status.options(timeout=STATUS_TIMEOUT_S).call())
        if data_m else _none()
    )  # fmt: skip
    trainer_call = (
        ask("trainer", ctx.connect(TrainerApi, trainer_m[0].address)
            .status.options(timeout=STATUS_TIMEOUT_S).call())
        if trainer_m else _none()
    )  # fmt: skip
    relay_calls = [
        ask(r.instance, ctx.connect(RelayApi, r.address)
            .status.options(timeout=STATUS_TIMEOUT_S).call())
        if r.state == "alive" else _none()
        for r in relays
    ]  # fmt: skip
    state_calls = [
        _quiet(ctx.connect(RolloutApi, r.address).state.options(timeout=STATUS_TIMEOUT_S)
               .call())
        if r.state == "alive" else _none()
        for r in rollouts
    ]  # fmt: skip
    data, trainer, *rest = await asyncio.gather(data_call, trainer_call, *relay_calls, *state_calls)
    relay_st: list[RelayStatus | None] = rest[: len(relays)]
    states: list[RolloutState | None] = rest[len(relays) :]

    views = [
        _rollout_view(r, st, now) for r, st in zip(rollouts, states, strict=True)
    ]  # fmt: skip
    chain = m.relay_chain
    positions = {info.instance: i for i, info in enumerate(chain.relays)}
    relay_views = []
    for r, st in zip(relays, relay_st, strict=True):
        verified = [v.version for v in st.versions if v.verified] if st else None
        relay_views.append(
            RelayView(
                id=r.instance,
                address=r.address,
                host=r.host,
                member_state=r.state,
                position=positions.get(r.instance),
                versions=verified,
                newest=max(verified) if verified else None,
            )
        )
    trainer_view = (
        TrainerView(
            id=trainer_m[0].instance,
            version=trainer.version,
            published=trainer.published,
            max_staleness=trainer.max_staleness,
            training=trainer.training,
        )
        if trainer is not None
        else None
    )
    live_versions = sorted(
        {v.version for v in views if v.member_state == "alive" and v.version is not None}
    )
    trainer_version = trainer.version if trainer is not None else None
    beating = trainer_m or [x for x in members if x.role in TRAINER_ROLES and x.state == "alive"]
    beat = beating[0].stats_as(TrainerStats) if beating else None
    if trainer_version is None and beat is not None:
        trainer_version = beat.version
    staleness = StalenessSummary(
        trainer_version=trainer_version,
        max_trained=trainer.max_staleness if trainer is not None else None,
        rollout_versions=live_versions,
        max_lag=(trainer_version - live_versions[0])
        if trainer_version is not None and live_versions
        else None,
    )
    counts: dict[str, dict[str, int]] = {}
    for x in members:
        by = counts.setdefault(x.role, {})
        by[x.state] = by.get(x.state, 0) + 1
    return AdminStatus(
        cluster=ctx.cluster.name,
        manager=ctx.instance,
        now=now,
        rollouts=views,
        relays=relay_views,
        chain=ChainSummary(
            epoch=chain.epoch,
            order=[r.instance for r in chain.relays],
            reason=chain.reason,
            changed_at=chain.changed_at,
        ),
        trainer=trainer_view,
        data=data if isinstance(data, DataStatus) else None,
        staleness=staleness,
        repack_policy=m.repack.policy,
        members=counts,
        last_event=m.events.last_seq,
        errors=errors,
    )


async def learning_view(m: ManagerView, request: LearningRequest) -> LearningView:
    """What ``GET /v1/learning`` shows: the live trainer's curves, or none (never an error)."""
    trainers = [x for x in m.members.values() if x.role in TRAINER_ROLES and x.state == "alive"]
    if not trainers:
        return LearningView()
    trainer = trainers[0]
    api = m.ctx.connect(LearningApi, trainer.address)
    try:
        async with asyncio.timeout(STATUS_TIMEOUT_S * 1.5):
            series = await api.learning.options(timeout=STATUS_TIMEOUT_S).call(request)
    except (RpcError, TimeoutError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        return LearningView(trainer=trainer.instance, errors={"trainer": error})
    return LearningView(
        trainer=trainer.instance,
        version=series.version,
        versions=series.versions,
        evals=series.evals,
    )


def _rollout_view(member: Member, state: RolloutState | None, now: float) -> RolloutView:
    """From its last heartbeat (no numbers before the first), refined by its ``state`` answer."""
    st = member.stats_as(RolloutStats)
    view = RolloutView(
        id=member.instance,
        host=member.host,
        address=member.address,
        member_state=member.state,
        state=rollout_state(member, st),
        last_seen_s=max(0.0, now - member.last_seen),
        incarnation=member.incarnation,
    )
    if st is not None:
        view.version, view.kv_cache_usage = st.version, st.kv_cache_usage
        view.running, view.waiting, view.in_flight = st.running, st.waiting, st.in_flight
        view.generated_tokens, view.completed = st.generated_tokens, st.completed
    if state is not None and member.state == "alive":
        view.state = state.phase.value
        view.in_flight, view.version = state.in_flight, state.version
    return view


async def _none() -> None:
    return None


async def _quiet(coro: Awaitable[Any]) -> Any:
    try:
        async with asyncio.timeout(STATUS_TIMEOUT_S * 1.5):
            return await coro
    except (RpcError, TimeoutError, OSError):
        return None
