"""The manager's repack controller: when to repack, and carrying a plan out.

The planner (``laminar.repack.planner``) decides *what* to move from a snapshot of loads; this
module owns everything with time and I/O in it:

* **Loads.** Every rollout heartbeat carries its stats (KV use, in flight, waiting, version,
  whether it takes prompts). :meth:`RepackController.observe` keeps the last two samples per
  rollout, typed (``laminar.runtime.stats.RolloutStats``): the planner's ``C_used`` and ``C_prev``.
* **Triggers.** A periodic check every ``policy.period_s``, and one right after each weight
  publish (``policy.on_publish``): a publish is when rollouts start draining for the new
  version, which is when their tails become worth consolidating. The manager learns of publishes
  by following the head relay's ``versions`` stream. An operator can also repack now
  (``POST /v1/repack``). Repacks never overlap: a trigger during one waits for it.
* **Execution.** Each move is one ``migrate`` call to the source, which exports, moves the leases
  and hands off to the destination itself (``roles.rollout``), so the trajectories' bytes never
  pass through the manager. Moves of one plan run concurrently; their sources are distinct and a
  destination accepts several handoffs at once. A move that fails is reported, not retried: the
  source keeps its trajectories and the next period plans again from fresh loads.
* **Record.** Every repack becomes a :class:`RepackOutcome`, an event on the log, and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, Field

from laminar.repack import RepackPlan, RepackPolicy, RolloutLoad, plan_repack
from laminar.roles.rollout.api import MigrateReport, MigrateRequest, RolloutApi, RolloutStats
from laminar.runtime.clock import Clock
from laminar.runtime.errors import RpcError
from laminar.runtime.membership import Member

from .events import EventLog

MIGRATE_TIMEOUT_S = 120.0  # one source's export + handoff; KV of long sequences can be large


class RepackOutcome(BaseModel):
    id: int
    reason: str  # "period", "publish", "operator"
    at: float  # wall clock at the start
    plan: RepackPlan
    reports: list[MigrateReport] = Field(default_factory=list)
    moved: int = 0  # trajectories now on a destination
    released: list[str] = Field(default_factory=list)  # sources emptied
    overhead_s: float = 0.0  # from the plan to the last handoff done
    errors: list[str] = Field(default_factory=list)


class RepackController:
    """See the module docstring. One per manager; all methods run on the manager's loop."""

    def __init__(
        self,
        policy: RepackPolicy,
        events: EventLog,
        connect: Callable[[str], RolloutApi],
        clock: Clock,
        registry: CollectorRegistry,
        log: Any,
    ) -> None:
        self.policy = policy
        self.events = events
        self._connect = connect
        self._clock = clock
        self._wall = clock.wall
        self._log = log
        # prev, now; None: a heartbeat with no stats (the rollout has nothing to say yet)
        self._samples: dict[str, tuple[RolloutStats | None, RolloutStats | None]] = {}
        self._rollouts: dict[str, Member] = {}
        self._lock = asyncio.Lock()
        self._policy_changed = asyncio.Event()
        self.history: list[RepackOutcome] = []
        self._ids = 0
        self._repacks = Counter("laminar_repacks", "Repacks run", ["reason"], registry=registry)
        self._moved = Counter(
            "laminar_repack_moved_trajectories", "Trajectories migrated by repack",
            ["mode"], registry=registry,
        )  # fmt: skip
        self._released = Counter(
            "laminar_repack_released_rollouts", "Rollouts released by repack", registry=registry
        )
        self._overhead = Histogram(
            "laminar_repack_overhead_seconds",
            "From plan to the last handoff done",
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        )

    # -- loads -------------------------------------------------------------------------------

    def observe(self, member: Member) -> None:
        """A rollout heartbeat arrived (``member.stats`` is the new sample)."""
        if member.role != "rollout":
            return
        now = member.stats_as(RolloutStats)
        prev = self._samples.get(member.instance)
        self._samples[member.instance] = (prev[1] if prev else now, now)
        self._rollouts[member.instance] = member
        before = prev[1] if prev else None
        if prev is not None and _version(before) != _version(now):
            self.events.publish(
                "pull",
                self._wall(),
                rollout=member.instance,
                version=_version(now) or 0,
                previous=_version(before) or 0,
            )

    def forget(self, instance: str) -> None:
        self._samples.pop(instance, None)
        self._rollouts.pop(instance, None)

    def loads(self) -> list[RolloutLoad]:
        out = []
        for instance, (prev, now) in sorted(self._samples.items()):
            member = self._rollouts[instance]
            if member.state != "alive" or now is None:
                continue
            out.append(
                RolloutLoad(
                    rollout=instance,
                    version=now.version,
                    kv_used=now.kv_cache_usage,
                    kv_prev=prev.kv_cache_usage if prev is not None else 0.0,
                    n_reqs=now.in_flight,
                    waiting=now.waiting,
                    draining=now.paused_for_weights or now.operator_drain or now.starved,
                    accepting=not now.operator_drain and not now.migrating,
                )
            )
        return out

    # -- policy ------------------------------------------------------------------------------

    def set_policy(self, policy: RepackPolicy, by: str = "operator") -> None:
        old, self.policy = self.policy, policy
        self._policy_changed.set()
        changed = {
            k: v for k, v in policy.model_dump().items() if old.model_dump().get(k) != v
        }  # fmt: skip
        self.events.publish("policy", self._wall(), by=by, changed=changed, **policy.model_dump())
        self._log.info("repack policy", by=by, **policy.model_dump())

    # -- planning and execution --------------------------------------------------------------

    def plan(self) -> RepackPlan:
        """What a repack would do now (a dry run: nothing moves)."""
        return plan_repack(self.loads(), self.policy)

    async def repack(self, reason: str) -> RepackOutcome:
        """Plan from the current loads and carry the plan out."""
        async with self._lock:
            self._ids += 1
            started, t0 = self._wall(), self._clock.time()
            plan = self.plan()
            outcome = RepackOutcome(id=self._ids, reason=reason, at=started, plan=plan)
            if plan.moves:
                results = await asyncio.gather(
                    *(self._move(m.source, m.destination, m.version) for m in plan.moves)
                )
                for report in results:
                    outcome.reports.append(report)
                    outcome.moved += len(report.moved)
                    if report.error:
                        outcome.errors.append(f"{report.source}: {report.error}")
                    if report.moved and not report.returned and not report.error:
                        outcome.released.append(report.source)
                    if report.moved:
                        self._moved.labels(report.mode).inc(len(report.moved))
                outcome.overhead_s = self._clock.time() - t0
                self._overhead.observe(outcome.overhead_s)
                self._released.inc(len(outcome.released))
            self._repacks.labels(reason).inc()
            self.history = [*self.history[-199:], outcome]
            if plan.moves:
                self.events.publish("repack", self._wall(), **_summary(outcome))
                self._log.info(
                    "repack",
                    reason=reason,
                    moves=len(plan.moves),
                    moved=outcome.moved,
                    released=outcome.released,
                    overhead_s=round(outcome.overhead_s, 3),
                    errors=outcome.errors,
                )
            for error in outcome.errors:
                self.events.publish("failure", self._wall(), what="migration", error=error)
            return outcome

    async def _move(self, source: str, destination: str, version: int) -> MigrateReport:
        src, dst = self._rollouts.get(source), self._rollouts.get(destination)
        if src is None or dst is None:
            return MigrateReport(
                source=source, destination=destination, version=version, error="not a member"
            )
        try:
            api = self._connect(src.address)
            return await api.migrate.options(timeout=MIGRATE_TIMEOUT_S).call(
                MigrateRequest(destination=destination, address=dst.address, version=version)
            )
        except RpcError as exc:
            return MigrateReport(
                source=source, destination=destination, version=version, error=str(exc)
            )

    # -- triggers ----------------------------------------------------------------------------

    async def run_periodic(self) -> None:
        """Repack every ``policy.period_s`` while enabled; a policy change restarts the wait."""
        while True:
            self._policy_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.policy.period_s):
                    await self._policy_changed.wait()
                continue  # the policy changed: wait again with the new period
            if self.policy.enabled:
                await self.repack("period")

    async def on_publish(self, version: int) -> None:
        self.events.publish("publish", self._wall(), version=version)
        if self.policy.enabled and self.policy.on_publish:
            await self.repack("publish")


def _version(stats: RolloutStats | None) -> int | None:
    return stats.version if stats is not None else None


def _summary(outcome: RepackOutcome) -> dict[str, Any]:
    return {
        "id": outcome.id,
        "reason": outcome.reason,
        "moves": [m.model_dump() for m in outcome.plan.moves],
        "moved": outcome.moved,
        "released": outcome.released,
        "overhead_s": round(outcome.overhead_s, 4),
        "modes": sorted({r.mode for r in outcome.reports if r.moved}),
        "kv_bytes": sum(r.kv_bytes for r in outcome.reports),
        "trajectories": [t for r in outcome.reports for t in r.moved],
        "errors": outcome.errors,
    }
