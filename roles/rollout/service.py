"""The rollout role: one generation engine, kept busy with prompts from the data role.

Three owned tasks, each with one job:

* **pull** — while fewer than ``concurrency`` trajectories are in flight, lease more from the data
  role (a long-poll ``take``) and add them to the engine; resumed leases continue from their
  acknowledged partial tokens.
* **outputs** — consume the engine's output stream: append tokens and logprobs to each
  trajectory; a finished one becomes a :class:`Trajectory` (one version, per-token behaviour
  logprobs, timestamps, finish reason) waiting to be reported.
* **flush** — every ``flush_interval_s``, one ``report`` call carries every in-flight
  trajectory's new tokens, every finished trajectory and every failed one. Only an acknowledged
  report advances what counts as sent, so a data role that dies and restarts just sees the same
  report again (the data role treats repeats as no-ops). Nothing is lost while it is down: tokens
  pile up here and go out with the first report that succeeds. Items the data role refused
  (named in the reply, with why) are dropped and logged once, never sent again: one bad item
  cannot make every report fail.

* **failures** — a request the engine refuses (a prompt too long for its context, token ids
  outside its vocabulary) fails alone: the engine goes on, and the trajectory is reported as
  failed with the engine's reason; the data role records it and never hands it out again.

* **weights** — follow the local relay's ``versions`` stream. When a newer version is there, stop
  taking prompts, let the trajectories in flight finish on the version they started with (a
  trajectory never mixes versions), then load the new version in place from the relay's shared
  memory (the engine maps it; the bytes never cross a socket) and take prompts again. The relay
  is the one on this host, or ``relay`` if set; with no relay in the cluster, weights never change.

* **repack** (``migration``) — on the manager's word, ``migrate`` moves every trajectory in
  flight to another rollout of the same version and this one carries on: with a newer version
  waiting, it loads it at once; otherwise it takes fresh prompts. ``accept`` is the receiving
  end. An operator can ``drain`` a rollout (take no prompts, finish what it has) and ``resume``
  it.

Stats (KV use, running, waiting, in flight, version, draining) ride on the heartbeat to the
manager; they are the repack planner's input.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from pydantic import Field

from laminar.config import ServiceConfig
from laminar.endpoint import endpoint
from laminar.engines import Engine, EngineConfig, EngineRequest, InflightSequence, create_engine
from laminar.engines.base import EngineError
from laminar.errors import CallTimeout, PeerUnavailable, RemoteError
from laminar.membership import rollout_phase
from laminar.roles.data.api import DataApi, FailedItem, Report, TakeRequest
from laminar.roles.relay import LatestRequest, RelayApi
from laminar.rpc_client import QUIET_STREAM_TIMEOUT_S
from laminar.service import Service, ServiceContext
from laminar.trajectory import Assignment, PartialChunk, Trajectory

from .api import (
    DrainRequest,
    Handoff,
    HandoffReply,
    LoadedWeights,
    MigrateReport,
    MigrateRequest,
    RolloutApi,
    RolloutState,
    WeightsHistory,
)
from .migration import accept_in, migrate_out


class RolloutConfig(ServiceConfig):
    engine: EngineConfig
    concurrency: Annotated[int, Field(ge=1)] = Field(
        32, description="Trajectories kept in flight in the engine."
    )
    min_take: Annotated[int, Field(ge=1)] = Field(
        1, description="Lease only when at least this many slots are free (batches the pulls)."
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


@dataclass
class _Flight:
    assignment: Assignment
    version: int
    started_at: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    acked: int = 0  # tokens the data role has acknowledged


LATEST_TIMEOUT_S = 5.0  # asking the local relay for the version to load (see ``_switch``)


class RolloutService(Service, RolloutApi):
    role: ClassVar[str] = "rollout"
    config_model: ClassVar[type[ServiceConfig]] = RolloutConfig
    config: RolloutConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.engine: Engine = create_engine(self.config.engine, clock=ctx.clock)
        self.flights: dict[str, _Flight] = {}
        self.finished: dict[str, Trajectory] = {}  # not yet acknowledged by the data role
        self.failed: dict[str, str] = {}  # trajectory id -> why; not yet acknowledged
        self.failures = 0  # trajectories that failed here (since start)
        self._slot_free = asyncio.Event()
        self._data_address: str | None = self.config.data
        self.completed = 0
        self._take_lock = asyncio.Lock()  # held while leasing and starting; a load waits for it
        self._paused = False  # a newer version is waiting: take nothing until it is loaded
        self._resume = asyncio.Event()
        self._drained = asyncio.Event()
        self.loads: list[LoadedWeights] = []
        self.migrating = False  # a repack migration is moving our trajectories out
        self._operator_drain = False
        self._starved = False  # the last take found no prompts

    async def on_start(self) -> None:
        await self.engine.start()
        self.log.info("engine ready", backend=self.engine.backend, version=self.engine.version)
        self.spawn(self._outputs(), name="outputs")
        self.spawn(self._pull(), name="pull")
        self.spawn(self._flush_loop(), name="flush")
        if self.ctx.manager is not None or self.config.relay is not None:
            self.spawn(self._weights(), name="weights")

    async def on_stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._flush()  # hand over what we have; the leases are released on leave
        await self.engine.close()

    def stats(self) -> dict[str, float]:
        s = self.engine.stats()
        return {
            "kv_cache_usage": s.kv_cache_usage,
            "running": float(s.running),
            "waiting": float(s.waiting),
            "in_flight": float(len(self.flights)),
            "version": float(self.engine.version),
            "generated_tokens": float(s.generated_tokens),
            "completed": float(self.completed),
            "failed": float(self.failures),
            "paused_for_weights": float(self._paused),
            "operator_drain": float(self._operator_drain),
            "migrating": float(self.migrating),
            "starved": float(self._starved),
        }

    @endpoint
    async def weights(self) -> WeightsHistory:
        return WeightsHistory(loads=self.loads)

    @endpoint
    async def state(self) -> RolloutState:
        return RolloutState(
            rollout=self.ctx.instance,
            phase=rollout_phase(self.stats()),
            version=self.engine.version,
            in_flight=len(self.flights),
            operator_drain=self._operator_drain,
        )

    @endpoint
    async def drain(self, req: DrainRequest) -> RolloutState:
        if not self._operator_drain:
            self.log.info("draining: taking no prompts", reason=req.reason)
        self._operator_drain = True
        return await self.state()

    @endpoint
    async def resume(self) -> RolloutState:
        if self._operator_drain:
            self.log.info("resumed: taking prompts again")
        self._operator_drain = False
        self._resume.set()
        return await self.state()

    @endpoint
    async def migrate(self, req: MigrateRequest) -> MigrateReport:
        return await migrate_out(self, req)

    @endpoint
    async def accept(self, req: Handoff) -> HandoffReply:
        return await accept_in(self, req)

    def flights_changed(self) -> None:
        """Flights left (finished, dropped, migrated) or a migration ended: wake who waits."""
        self._slot_free.set()
        if not self.flights and not self.migrating:
            self._drained.set()

    # -- the data role -----------------------------------------------------------------------

    async def data_api(self) -> DataApi:
        if self._data_address is None:
            self._data_address = await self.ctx.find("data")
            self.log.info("found the data role", address=self._data_address)
        return self.ctx.connect(DataApi, self._data_address)

    def _lost_data(self, error: Exception) -> None:
        self.log.warning("data role unreachable; retrying", error=str(error))
        if self.config.data is None:
            self._data_address = None  # it may come back elsewhere: ask the manager again

    # -- pull --------------------------------------------------------------------------------

    async def _pull(self) -> None:
        cfg = self.config
        while True:
            if self._paused or self._operator_drain:
                self._resume.clear()
                await self._resume.wait()
                continue
            free = cfg.concurrency - len(self.flights)
            if free < cfg.min_take:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            async with self._take_lock:
                await self._take(free)

    async def _take(self, free: int) -> None:
        cfg = self.config
        req = TakeRequest(
            rollout=self.ctx.instance,
            max_count=free,
            version=self.engine.version,
            holding=[*self.flights, *self.finished, *self.failed],
            wait_s=cfg.take_wait_s,
        )
        try:
            data = await self.data_api()
            batch = await data.take.options(timeout=cfg.take_wait_s + 10).call(req)
        except (PeerUnavailable, CallTimeout, RemoteError) as exc:
            self._lost_data(exc)
            await self.ctx.clock.sleep(0.5)
            return
        self._starved = not batch.items  # a long poll came back empty: the pool is dry
        for assignment in batch.items:
            await self._start(assignment)

    async def _start(self, a: Assignment) -> None:
        tid = a.trajectory_id
        if tid in self.flights or tid in self.finished or tid in self.failed:
            return
        version = self.engine.version
        flight = _Flight(a, version, a.started_at or self.ctx.clock.wall())
        self.flights[tid] = flight
        try:
            await self._submit(a, version)
        except EngineError as exc:  # this trajectory alone: report it failed, keep the engine
            self._failed(tid, str(exc))

    async def _submit(self, a: Assignment, version: int) -> None:
        tid = a.trajectory_id
        if a.resume_token_ids:
            flight = self.flights[tid]
            flight.tokens, flight.logprobs = list(a.resume_token_ids), list(a.resume_logprobs)
            flight.acked = len(flight.tokens)
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
                if out.finished:
                    del self.flights[out.request_id]
                    self.finished[out.request_id] = self._trajectory(flight, out.finish_reason, now)
                    self.completed += 1
                    self.flights_changed()

    def _failed(self, tid: str, why: str) -> None:
        """``tid`` cannot be generated here: report it failed (the data role records it)."""
        if self.flights.pop(tid, None) is None:
            return
        self.failed[tid] = why
        self.failures += 1
        self.log.warning("trajectory failed in the engine", trajectory=tid, reason=why)
        self.flights_changed()

    def _trajectory(self, f: _Flight, reason: str | None, now: float) -> Trajectory:
        a = f.assignment
        return Trajectory(
            trajectory_id=a.trajectory_id,
            prompt_id=a.prompt_id,
            sample_index=a.sample_index,
            prompt_token_ids=a.prompt_token_ids,
            response_token_ids=f.tokens,
            logprobs=f.logprobs,
            version=f.version,
            finish_reason=reason or "stop",  # type: ignore[arg-type]
            queued_at=a.queued_at,
            started_at=f.started_at,
            finished_at=now,
            rollout=self.ctx.instance,
        )

    # -- flush -------------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await self.ctx.clock.sleep(self.config.flush_interval_s)
            try:
                await self._flush()
            except (PeerUnavailable, CallTimeout, RemoteError) as exc:
                self._lost_data(exc)

    async def _flush(self) -> None:
        partials = [
            PartialChunk(
                trajectory_id=tid,
                version=f.version,
                offset=f.acked,
                token_ids=f.tokens[f.acked :],
                logprobs=f.logprobs[f.acked :],
            )
            for tid, f in self.flights.items()
            if len(f.tokens) > f.acked
        ]
        completed = list(self.finished.values())
        failed = [FailedItem(trajectory_id=tid, reason=why) for tid, why in self.failed.items()]
        if not partials and not completed and not failed:
            return
        data = await self.data_api()
        reply = await data.report.call(
            Report(rollout=self.ctx.instance, partials=partials, completed=completed, failed=failed)
        )
        refused = {r.trajectory_id for r in reply.rejected if r.item == "partial"}
        for chunk in partials:
            flight = self.flights.get(chunk.trajectory_id)
            if flight is not None and chunk.trajectory_id not in refused:
                flight.acked = max(flight.acked, chunk.offset + len(chunk.token_ids))
        for t in completed:  # stored, duplicates or refused: sent for good either way
            self.finished.pop(t.trajectory_id, None)
        for f in failed:
            self.failed.pop(f.trajectory_id, None)
        for r in reply.rejected:
            self.log.warning("the data role refused a report item; dropped",
                             trajectory=r.trajectory_id, item=r.item, reason=r.reason)  # fmt: skip
        # a refused partial: stop generating it; the data role re-delivers it from what it has
        for tid in [*reply.drop, *refused]:
            if self.flights.pop(tid, None) is not None:
                await self.engine.abort(tid)
                self.flights_changed()
        if reply.drop:
            self.log.warning("dropped trajectories the data role reassigned", ids=reply.drop)

    # -- weights -----------------------------------------------------------------------------

    async def _relay(self) -> RelayApi | None:
        if self.config.relay is not None:
            return self.ctx.connect(RelayApi, self.config.relay)
        relays = [m for m in await self.ctx.members("relay") if m.state == "alive"]
        mine = [m for m in relays if m.host == socket.gethostname()] or relays
        if not mine:
            return None
        return self.ctx.connect(RelayApi, sorted(mine, key=lambda m: m.instance)[0].address)

    async def _weights(self) -> None:
        """Follow the relay's newest version; load each one between batches (module docstring)."""
        while True:
            try:
                relay = await self._relay()
                if relay is None:
                    await self.ctx.clock.sleep(self.config.weights_retry_s)
                    continue
                stream = relay.versions.options(timeout=QUIET_STREAM_TIMEOUT_S).stream(
                    LatestRequest(newer_than=self.engine.version)
                )
                async for shared in stream:
                    if shared.available and shared.version > self.engine.version:
                        await self._switch(relay)
            except (PeerUnavailable, CallTimeout, RemoteError, EngineError) as exc:
                # includes a segment the relay evicted just before we mapped it: ask again
                self.log.warning("weight pull failed; retrying", error=str(exc))
            await self.ctx.clock.sleep(self.config.weights_retry_s)

    async def _switch(self, relay: RelayApi) -> None:
        """Drain, then load the relay's newest version (newer ones may have come meanwhile)."""
        noticed = self.ctx.clock.wall()
        self._paused = True
        try:
            async with self._take_lock:  # no lease is half-started while we swap
                while self.flights or self.migrating:  # a migration may hand some back
                    self._drained.clear()
                    await self._drained.wait()
                drained = self.ctx.clock.wall()
                # short: the rollout takes no prompts while paused here, and a relay that died
                # since it announced the version is found again by the caller's retry
                shared = await relay.latest.options(timeout=LATEST_TIMEOUT_S).call(
                    LatestRequest(newer_than=self.engine.version)
                )
                if not shared.available or shared.manifest is None:
                    return
                digest = await self.engine.load_shared(
                    shared.version, shared.segment, shared.manifest
                )
        finally:
            self._paused = False
            self._resume.set()
        loaded = self.ctx.clock.wall()
        self.loads.append(
            LoadedWeights(
                version=shared.version,
                digest=digest,
                loaded_at=loaded,
                load_s=loaded - drained,
                drain_s=drained - noticed,
            )
        )
        self.log.info(
            "weights loaded",
            version=shared.version,
            drain_s=round(drained - noticed, 3),
            load_s=round(loaded - drained, 3),
        )
