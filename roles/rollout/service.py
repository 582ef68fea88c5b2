"""The rollout role: one generation engine, kept busy with prompts from the data role.

Three owned tasks, each with one job:

* **pull** — keep ``concurrency`` trajectories in the engine and ``lease_ahead`` fresh leases in
  hand (:mod:`.ahead`): lease in batches from the data role (a long-poll ``take``) and start a
  lease in hand as soon as a slot frees; resumed leases start at once and continue from their
  acknowledged partial tokens.
* **outputs** — consume the engine's output stream: append tokens and logprobs to each
  trajectory; a finished one becomes a :class:`Trajectory` (one version, per-token behaviour
  logprobs, timestamps, finish reason) waiting to be reported.
* **flush** (:mod:`.reporting`) — every ``flush_interval_s``, one ``report`` call carries every
  in-flight trajectory's new tokens, every finished and every failed trajectory; only an
  acknowledged report advances what counts as sent, and items the data role refused are dropped.

* **episodes** (:mod:`.turns`) — a multi-turn episode whose turn ends at one of the environment's
  stop tokens leaves the engine (its KV released) while the data role steps the environment, and
  comes back with the observation appended; the other trajectories decode on meanwhile.

* **failures** — a request the engine refuses (a prompt too long for its context, token ids
  outside its vocabulary) fails alone: the engine goes on, and the trajectory is reported as
  failed with the engine's reason; the data role records it and never hands it out again.

* **weights** (:mod:`.switching`) — follow the local relay's ``versions`` stream. When a newer
  version is there, stop taking prompts, let the trajectories in flight finish on the version they
  started with (a trajectory never mixes versions), then load the new version in place from the
  relay's shared memory and take prompts again.

* **repack** (:mod:`.migration`) — on the manager's word, ``migrate`` moves every trajectory in
  flight to another rollout of the same version and this one carries on: with a newer version
  waiting, it loads it at once; otherwise it takes fresh prompts. ``accept`` is the receiving
  end. An operator can ``drain`` a rollout (take no prompts, finish what it has) and ``resume``
  it.

The phase (starting, generating, paused for weights, loading; operator drain and migration on
the side) lives in one state machine, :mod:`.state`, and changes only through its transitions;
the flights live in :mod:`.flights`. Tasks wait on :class:`.changes.Changes` for the conditions
they need. Stats (KV use, running, waiting, in flight, version, draining) ride on the heartbeat to
the manager; they are the repack planner's input.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, ClassVar

from pydantic import Field

from laminar.engines import Engine, EngineConfig, EngineRequest, InflightSequence, create_engine
from laminar.engines.base import EngineError
from laminar.roles.data.api import DataApi, LeaseRelease, TakeRequest
from laminar.roles.rollout.api import RolloutStats
from laminar.runtime.clock import Clock
from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.endpoint import endpoint
from laminar.runtime.errors import RpcError
from laminar.runtime.peers import ONCE
from laminar.runtime.service import Service
from laminar.trajectory import Assignment, Trajectory

from .ahead import LeasesAhead, is_fresh, sizes
from .api import (
    DrainRequest,
    Handoff,
    HandoffReply,
    MigrateReport,
    MigrateRequest,
    RolloutApi,
    RolloutState,
    WeightsHistory,
)
from .changes import Changes
from .flights import Flight, FlightTable
from .migration import accept_in, migrate_out
from .reporting import Reporter
from .state import RolloutPhases
from .switching import WeightSwitcher
from .turns import Turns


class RolloutConfig(ServiceConfig):
    engine: EngineConfig
    concurrency: Annotated[int, Field(ge=1)] = Field(
        32, description="Trajectories kept in flight in the engine."
    )
    lease_ahead: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="Fresh leases held beyond `concurrency`, so a slot that frees is refilled "
        "without a round trip to the data role (default: half of `concurrency`; 0: lease only as "
        "slots free). Given back when the rollout drains or loads another version.",
    )
    min_take: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Lease only when at least this many places (slots and leases ahead) are "
        "free, which batches the takes (default: half of `lease_ahead`, at least 1).",
    )
    flush_interval_s: Annotated[float, Field(gt=0)] = Field(
        0.25, description="How often new tokens and finished trajectories go to the data role."
    )
    take_wait_s: Annotated[float, Field(ge=0, le=60)] = Field(
        2.0, description="How long a prompt lease request waits at the data role for prompts."
    )
    data: str | None = Field(
        None, description="The data role's address (default: ask the manager)."
    )
    relay: str | None = Field(
        None, description="The relay to pull weights from (default: the relay on this host)."
    )
    weights_retry_s: Annotated[float, Field(gt=0)] = Field(
        1.0, description="Pause before retrying a failed weight pull (or finding no relay)."
    )


class RolloutService(Service, RolloutApi):
    role: ClassVar[str] = "rollout"
    feeds_engine: ClassVar[bool] = True  # gives way only off its engine's cores (placement)
    config_model: ClassVar[type[ServiceConfig]] = RolloutConfig
    config: RolloutConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.engine: Engine = create_engine(self.config.engine, clock=ctx.clock)
        self.engine.executor = ctx.executor("engine-weights")
        self.changes = Changes()  # a phase change, a flight or a lease leaving wakes waiters
        self.phases = RolloutPhases(on_change=self.changes.notify)
        self.flights = FlightTable(on_change=self.changes.notify)
        self.data = ctx.peer("data", DataApi, address=self.config.data)
        self.reporter = Reporter(ctx.instance, self.flights, self.engine, self.data, self.log)
        self.finished = self.reporter.finished  # not yet acknowledged by the data role
        self.failed = self.reporter.failed  # trajectory id -> why; not yet acknowledged
        self.failures = 0  # trajectories that failed here (since start)
        self.completed = 0
        cfg = self.config
        self.ahead = LeasesAhead(on_change=self.changes.notify)  # leases leaving make room
        self.lease_ahead, self.min_take = sizes(cfg.concurrency, cfg.lease_ahead, cfg.min_take)
        self._take_lock = asyncio.Lock()  # held while leasing and starting; a load waits for it
        self._fill_lock = asyncio.Lock()
        self.turns = Turns(
            ctx.instance,
            self.flights,
            self.engine,
            self.data,
            ctx.clock,
            self.log,
            spawn=self.spawn,
            finish=self._finish,
            fail=self._failed,
        )
        self.switcher = WeightSwitcher(
            ctx,
            self.engine,
            self.phases,
            self.flights,
            self.changes,
            self._take_lock,
            relay=self.config.relay,
            retry_s=self.config.weights_retry_s,
        )

    # what migration needs of us (``migration.MigratingRollout``)

    @property
    def instance(self) -> str:
        return self.ctx.instance

    @property
    def clock(self) -> Clock:
        return self.ctx.clock

    def peer(self, address: str) -> RolloutApi:
        return self.ctx.connect(RolloutApi, address)

    async def data_api(self) -> DataApi:
        return await self.data.api()

    # -- lifecycle ---------------------------------------------------------------------------

    async def on_start(self) -> None:
        await self.engine.start()
        self.log.info("engine ready", backend=self.engine.backend, version=self.engine.version)
        self.phases.started()
        self.spawn(self._outputs(), name="outputs")
        self.spawn(self._pull(), name="pull")
        self.spawn(self._feed(), name="feed")
        self.spawn(self.reporter.loop(self.ctx.clock, self.config.flush_interval_s), name="flush")
        if self.ctx.manager is not None or self.config.relay is not None:
            self.switcher.start()

    async def on_stop(self) -> None:
        # Our work has stopped (the host ends a service's tasks before on_stop: reading the
        # engine's outputs, feeding it, episodes back from their environment, weight loads; a
        # migration under way has finished). What is finished is handed over (the leases of the
        # rest are released when this rollout leaves), then the engine closes.
        with contextlib.suppress(Exception):
            await self._flush()
        await self.engine.close()

    async def _flush(self) -> None:
        await self.reporter.flush()

    def stats(self) -> dict[str, float]:
        s = self.engine.stats()
        return RolloutStats(
            kv_cache_usage=s.kv_cache_usage,
            running=s.running,
            waiting=s.waiting,
            in_flight=len(self.flights),
            leased_ahead=len(self.ahead),
            version=self.engine.version,
            generated_tokens=s.generated_tokens,
            completed=self.completed,
            failed=self.failures,
            env_waiting=self.turns.waiting,
            **self.phases.stats(),  # the phase, and the facts the repack planner reads
        ).wire()

    # -- endpoints ---------------------------------------------------------------------------

    @endpoint
    async def weights(self) -> WeightsHistory:
        return WeightsHistory(loads=self.switcher.loads)

    @endpoint
    async def state(self) -> RolloutState:
        return RolloutState(
            rollout=self.ctx.instance,
            phase=self.phases.public(),
            version=self.engine.version,
            in_flight=len(self.flights),
            env_waiting=self.turns.waiting,
            operator_drain=self.phases.operator_drain,
        )

    @endpoint
    async def drain(self, req: DrainRequest) -> RolloutState:
        if self.phases.drain():
            self.log.info("draining: taking no prompts", reason=req.reason)
        await self._give_back(self.ahead.clear())
        return await self.state.call()

    @endpoint
    async def resume(self) -> RolloutState:
        if self.phases.resume():
            self.log.info("resumed: taking prompts again")
        return await self.state.call()

    # A migration is not cut in two when the connection that asked for it closes (the manager
    # gone, or the source rollout dead during the hand-off): each side runs it to its end
    # (ServiceContext.run_to_end). Cut, the source had taken the moving flights out of its table
    # with their leases already the destination's, and the destination had put them in its
    # table but not in its engine: held by a live rollout, generated by none.

    @endpoint
    async def migrate(self, req: MigrateRequest) -> MigrateReport:
        return await self.ctx.run_to_end(migrate_out(self, req), name="migrate")

    @endpoint
    async def accept(self, req: Handoff) -> HandoffReply:
        return await self.ctx.run_to_end(accept_in(self, req), name="accept")

    # -- pull --------------------------------------------------------------------------------

    def _room(self) -> int:
        """Leases it may take now: engine slots and leases ahead, less what it holds."""
        return self.config.concurrency + self.lease_ahead - len(self.flights) - len(self.ahead)

    async def _pull(self) -> None:
        def may_take() -> bool:  # allowed, and enough room (batches the takes)
            return self.phases.may_take and self._room() >= self.min_take

        while True:
            await self.changes.until(may_take)
            # Finding the data role can take any time (it may not have joined yet); a drain or a
            # newer version may come meanwhile. So find it first, then ask afresh.
            await self.data.resolve()
            async with self._take_lock:
                if may_take():
                    await self._take(self._room())

    async def _take(self, free: int) -> None:
        cfg = self.config
        req = TakeRequest(
            rollout=self.ctx.instance,
            max_count=free,
            version=self.engine.version,
            holding=[*self.reporter.holding(), *self.ahead],
            wait_s=cfg.take_wait_s,
        )
        # Once, under the take lock a weight load waits for: the pull loop asks afresh (free
        # slots, holding, version), finding the data role again outside the lock.
        try:
            batch = await self.data.call(
                lambda data: data.take.options(timeout=cfg.take_wait_s + 10).call(req), ONCE
            )
        except RpcError:  # noted by the peer (and its address forgotten)
            await self.ctx.clock.sleep(0.5)
            return
        self.phases.took(len(batch.items))  # a long poll came back empty: the pool is dry
        for assignment in batch.items:
            if is_fresh(assignment):
                self.ahead.add(assignment)
            else:  # a resume continues tokens of its version: now, while that is the engine's
                await self._start(assignment)
        if self.phases.operator_drain:
            # A drain came while this take waited at the data role (a long poll): what it brought
            # goes back now, or a drained rollout would keep those prompts from every other
            # rollout for as long as the drain lasts.
            await self._give_back(self.ahead.clear())
        await self._fill()

    async def _feed(self) -> None:
        """Start leases in hand as slots free (and give back those of an older version)."""

        def startable() -> bool:
            slot = len(self.flights) < self.config.concurrency
            return self.phases.may_take and len(self.ahead) > 0 and slot

        while True:
            await self.changes.until(startable)
            await self._fill()

    async def _fill(self) -> None:
        async with self._fill_lock:  # one at a time: each counts the slots the last one filled
            if not self.phases.may_take:
                return
            await self._give_back(self.ahead.stale(self.engine.version))
            for assignment in self.ahead.pop(self.config.concurrency - len(self.flights)):
                await self._start(assignment)

    async def _give_back(self, ids: list[str]) -> None:
        """Return leases in hand to the data role; if that fails, the next ``take`` does not
        list them as held, and the data role requeues (or re-delivers) them then."""
        if not ids:
            return
        req = LeaseRelease(rollout=self.ctx.instance, trajectory_ids=ids)
        with contextlib.suppress(RpcError):
            await self.data.call(lambda data: data.release.call(req), ONCE)
            self.log.info("gave back leases not started", count=len(ids))

    async def _start(self, a: Assignment) -> None:
        tid = a.trajectory_id
        if tid in self.flights or tid in self.finished or tid in self.failed:
            return
        version = self.engine.version
        self.flights.add(tid, Flight(a, version, a.started_at or self.ctx.clock.wall()))
        try:
            await self._submit(a, version)
        except EngineError as exc:  # this trajectory alone: report it failed, keep the engine
            self._failed(tid, str(exc))

    async def _submit(self, a: Assignment, version: int) -> None:
        tid = a.trajectory_id
        if a.resume_token_ids:
            flight = self.flights[tid]
            flight.tokens, flight.logprobs = list(a.resume_token_ids), list(a.resume_logprobs)
            flight.env_spans = list(a.resume_env_spans)
            flight.acked = len(flight.tokens)
            if self.turns.resumed_waiting(flight):  # its last turn's answer is still owed
                self.turns.wait(tid, flight)
                return
            await self.engine.import_sequences(
                [
                    InflightSequence(
                        request_id=tid,
                        prompt_token_ids=a.prompt_token_ids,
                        response_token_ids=a.resume_token_ids,
                        response_logprobs=a.resume_logprobs,
                        params=a.params,
                        version=a.version if a.version is not None else version,
                    )
                ]
            )
        else:
            await self.engine.add_request(
                EngineRequest(request_id=tid, prompt_token_ids=a.prompt_token_ids, params=a.params)
            )

    # -- outputs -----------------------------------------------------------------------------

    async def _outputs(self) -> None:
        async for batch in self.engine.outputs():
            now = self.ctx.clock.wall()
            for out in batch:
                flight = self.flights.get(out.request_id)
                if flight is None:
                    continue
                if out.error is not None:  # the engine refused it: it fails alone
                    self._failed(out.request_id, out.error)
                    continue
                flight.tokens += out.token_ids
                flight.logprobs += out.logprobs
                if not out.finished:
                    continue
                if self.turns.ended_turn(flight, out.finish_reason):  # the environment's turn
                    self.turns.wait(out.request_id, flight)
                    continue
                self.flights.pop(out.request_id)
                self._finish(
                    out.request_id, flight.trajectory(out.finish_reason, now, self.ctx.instance)
                )

    def _finish(self, tid: str, trajectory: Trajectory) -> None:
        """``tid`` is done (out of the flight table): report it with the next flush."""
        self.finished[tid] = trajectory
        self.completed += 1

    def _failed(self, tid: str, why: str) -> None:
        """``tid`` cannot be generated here: report it failed (the data role records it)."""
        if self.flights.pop(tid) is None:
            return
        self.failed[tid] = why
        self.failures += 1
        self.log.warning("trajectory failed in the engine", trajectory=tid, reason=why)
