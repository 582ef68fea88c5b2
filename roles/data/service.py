"""The data role: prompt pool, partial-response pool and experience buffer, durable.

Flow of one trajectory:

1. ``take`` (a rollout with free slots): the prompt pool queues whole groups (n samples per
   prompt, in a seeded order) and leases queued samples to the rollout. Requeued samples that
   carry partial tokens go only to a rollout of the same weight version (a resume). (``leasing``)
2. ``report`` (every flush interval of the rollout): new tokens go to the partial-response pool;
   finished trajectories go to the experience buffer, exactly once, their partials dropped.
   (``reports``)
3. The writer scores each new trajectory with the reward plug-in in a worker process (off the
   event loop, with a timeout) and records the reward or the reason there is none. (``sampling``)
   A multi-turn task has an environment instead: ``env_step`` answers a rollout's episode turn by
   turn, and the episode's steps are its reward. (``episodes``)
4. ``sample`` (the trainer): the sampler picks scored trajectories, which are marked consumed
   with a consume seq (the trainer's cursor: it re-asks from its last committed cursor after a
   crash), optionally as whole groups and within a staleness bound (``buffer.ExperienceBuffer``).

Durability: all state is in :class:`Store` (SQLite, WAL); every acknowledgement follows a commit
(what a commit survives, kill -9 or power loss, is ``store_synchronous``: see ``store``).
Database calls run on the role's one-worker ``data-store`` executor (:meth:`DataService._db`, the
one place that decides; threads in production, the event loop under the in-process test cluster),
so the event loop never blocks on disk.

Bad input fails alone: a report is stored item by item (a bad item is refused and named in the
reply), and a trajectory that cannot be generated (its engine refused it, its completion is
invalid, or rollouts keep dying while holding it) is recorded as failed for good, counted and
never handed out again (``store.failures``).

Failures: the role follows the manager's membership stream; a dead rollout's leases return to
the front of the queue with their partial tokens, for another rollout of the same version to
resume (``members``).

Time comes from the service context's clock (``ctx.clock``), so the role runs on virtual time
like on real time; the store stamps rows with the same clock's wall time (``store_clock``).
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from prometheus_client import Gauge

from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.endpoint import endpoint
from laminar.runtime.errors import ConfigError
from laminar.runtime.membership import MembershipApi
from laminar.runtime.service import Service

from .api import (
    Assignments,
    CompletedIds,
    DataApi,
    DataStatus,
    EnvStepReply,
    EnvStepRequest,
    LeaseRelease,
    LeaseTransfer,
    PartialLengths,
    Released,
    Report,
    ReportReply,
    SampleRequest,
    TakeRequest,
    Trajectories,
    Transferred,
)
from .buffer import EVICTIONS, SAMPLERS, ExperienceBuffer, make_policy
from .config import DataConfig, PolicySpec, SamplingConfig, StalenessConfig
from .context import DataContext, store_clock
from .episodes import Episodes
from .focus import Focus
from .leasing import HANDOFF_GRACE_S, Leasing, trajectory_seed
from .members import WATCH_RETRY_S, RolloutWatch
from .prompts import REASONS, LoadedPrompts, load_prompts
from .reports import Reports
from .rewards import RewardPool
from .rounds import RoundGate
from .sampling import Sampling
from .store import Store

STORE_CLOSED = "the data store is not open (the data role is starting or stopping)"

__all__ = [
    "HANDOFF_GRACE_S",
    "DataConfig",
    "DataService",
    "PolicySpec",
    "SamplingConfig",
    "StalenessConfig",
    "trajectory_seed",
]

T = TypeVar("T")
#: ``focus`` logs its admit rates once per this many whole groups
FOCUS_LOG_EVERY = 100


class DataService(Service, DataApi):
    role: ClassVar[str] = "data"
    config_model: ClassVar[type[ServiceConfig]] = DataConfig
    config: DataConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self._store_executor = ctx.executor("data-store", workers=1)  # one connection, in order
        self.store: Store | None = None
        self.rewards: RewardPool | None = None
        self.episodes: Episodes | None = None  # multi-turn tasks (``data.env``)
        self.buffer: ExperienceBuffer | None = None
        self.tokenizer: Any = None
        self._counts: dict[str, int] = {}
        self._left_out = 0  # prompts left out at load (max_prompt_tokens, overlong_prompts)
        self._m_failed = Gauge(
            "laminar_data_failed_trajectories",
            "Trajectories recorded as failed (never handed out again), by kind",
            ["kind"],
            registry=ctx.registry,
        )
        c = self.config
        self.sampler = make_policy(c.sampler.kind, SAMPLERS, c.sampler.options)
        self.eviction = make_policy(c.eviction.kind, EVICTIONS, c.eviction.options)
        # Round schedules (sync, one_step, tail_batching; laminar.runtime.schedules): prompts go
        # out in gated rounds. None under laminar: every path below behaves as without schedules.
        schedule = ctx.cluster.schedule
        self.rounds = (
            RoundGate(schedule, c.samples_per_prompt, c.seed, c.epochs) if schedule.rounds else None
        )
        if self.rounds is not None and c.redundant_samples:
            raise ConfigError(
                f"data.redundant_samples does not work with the {schedule.kind} schedule's rounds "
                "(a round waits for every sample it started): set it to 0"
            )
        if self.rounds is not None and c.drop_constant_groups:
            raise ConfigError(
                f"data.drop_constant_groups does not work with the {schedule.kind} schedule's "
                "rounds (a round ends with its groups complete; dropping the constant ones leaves "
                "the trainer short of a batch, and the next round waits for the trainer): set it "
                "to false"
            )
        if self.rounds is not None and c.focus is not None:
            raise ConfigError(
                f"data.focus does not work with the {schedule.kind} schedule's rounds (a round "
                "queues the prompts it drew): remove it"
            )
        self.focus = (
            None
            if c.focus is None
            else Focus(c.focus.key, window=c.focus.window, floor=c.focus.floor, seed=c.seed)
        )
        self._groups_seen = 0  # whole groups ``focus`` has learned from
        parts = DataContext(
            config=c,
            clock=ctx.clock,
            log=self.log,
            db=self._db,
            need_store=self._need_store,
            rounds=self.rounds,
            focus=self.focus,
        )
        to_score: asyncio.Queue[str] = asyncio.Queue()
        self.leasing = Leasing(parts)
        self.reports = Reports(parts, ctx.registry, to_score, self.leasing.wake, self._cancelled)
        self.sampling = Sampling(parts, to_score, self.leasing.wake)
        self.watch = RolloutWatch(parts, self.leasing.forget, self.leasing.wake)

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call on the store's executor (every store call goes through here).

        A request that took the store before ``on_stop`` closed it and queued its call after
        the close gets the same clear error as one that came later (not SQLite's "Cannot
        operate on a closed database"); its caller retries, as for an unreachable data role."""
        try:
            return await self._store_executor.run(fn, *args)
        except sqlite3.ProgrammingError:
            if self.store is None:
                raise RuntimeError(STORE_CLOSED) from None
            raise

    def _cancelled(self, ids: list[str]) -> None:
        if self.episodes is not None:
            for tid in ids:
                self.episodes.forget(tid)

    def _need_store(self) -> Store:
        if self.store is None:
            raise RuntimeError(STORE_CLOSED)
        return self.store

    # -- lifecycle ---------------------------------------------------------------------------

    async def on_start(self) -> None:
        c = self.config
        # off the loop: reading, rendering (transformers' import, when a template is used) and
        # tokenizing a large dataset take seconds
        loaded = await self.ctx.executor("data-load").run(load_prompts, c)
        self.tokenizer, rows = loaded.tokenizer, loaded.prompts.rows
        self._left_out = len(loaded.prompts.left_out)
        self._log_prompts(loaded)
        if c.max_model_len is not None:
            room = c.max_model_len - c.sampling.max_tokens
            cut = sum(len(ids) > room for _, _, ids in rows)
            if cut:
                self.log.info("responses of some prompts will stop at the context limit",
                              prompts=cut, max_model_len=c.max_model_len,
                              max_tokens=c.sampling.max_tokens)  # fmt: skip
        self.store = await self._db(
            functools.partial(
                Store, c.store, synchronous=c.store_synchronous, now=store_clock(self.ctx.clock)
            )
        )
        self.buffer = ExperienceBuffer(
            self.store,
            self.sampler,
            self.eviction,
            group_size=c.samples_per_prompt,
            staleness_bound=c.staleness.bound,
            staleness_action=c.staleness.action,
            drop_constant_groups=c.drop_constant_groups,
            spare_samples=c.redundant_samples,
            on_group=self._observe_group if self.focus is not None else None,
        )
        try:
            await self._db(self.store.load_prompts, rows, loaded.fingerprint)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # The rounds that deferred them died with the previous incarnation (``rounds``).
        if parked := await self._db(self.store.release_parked):
            self.log.info("deferred samples of an earlier run requeued", count=len(parked))
        if c.reward is not None:
            self.rewards = RewardPool(
                c.reward,
                kind=c.reward_kind,
                batch=c.reward_batch,
                kwargs=c.reward_kwargs,
                prompt_key=c.prompt_key,
                workers=c.reward_workers,
                timeout_s=c.reward_timeout_s,
                sandbox=c.reward_sandbox,
                token_env=self.ctx.cluster.token_env,
                executor=self.ctx.executor("reward-reaper", workers=c.reward_workers),
            )
        if c.env is not None:
            self.episodes = Episodes(
                c.env, self.tokenizer, self.ctx.registry, self.ctx.clock, chat=loaded.chat
            )
            self.leasing.use_episodes(self.episodes.stop_ids)
        self.sampling.open(self.buffer, self.rewards, self.tokenizer, self.episodes)
        for tid in await self._db(self.store.unscored):  # completed before a crash, not scored
            self.sampling.to_score.put_nowait(tid)
        await self._refresh_counts()
        self.log.info("data ready", prompts=len(rows), store=c.store, **self._counts)
        for i in range(c.reward_workers):
            self.spawn(self.sampling.score_loop(), name=f"score-{i}")
        self.spawn(self._counts_loop(), name="counts")
        if self.ctx.manager is not None:
            mgr = self.ctx.connect(MembershipApi, self.ctx.manager)
            events = functools.partial(self.watch.events, mgr)
            self.ctx.follow("watch-rollouts", events, self.watch.on_event, backoff=WATCH_RETRY_S)

    def _log_prompts(self, loaded: LoadedPrompts) -> None:
        """What loading the prompts decided, once: ids, the template, what was left out."""
        c, prompts = self.config, loaded.prompts
        if loaded.row_ids:
            self.log.info("no record has an `id` field: prompt ids are row numbers")
        if loaded.chat is not None and prompts.as_text:
            self.log.info("plain-text prompts are tokenized without the chat template "
                          "(data.string_prompts: user renders them as user messages)",
                          prompts=prompts.as_text)  # fmt: skip
        if loaded.stop_warning is not None:
            self.log.warning(loaded.stop_warning)
        if prompts.left_out:
            by = {r: sum(x.reason == r for x in prompts.left_out) for r in REASONS}
            self.log.info(
                "prompts left out",
                left_out=len(prompts.left_out),
                kept=len(prompts.rows),
                longer_than_max_prompt_tokens=by["max_prompt_tokens"],
                no_room_within_max_model_len=by["max_model_len"],
                max_prompt_tokens=c.max_prompt_tokens,
                max_model_len=c.max_model_len,
                first=[f"{x.prompt_id} ({x.tokens} tokens)" for x in prompts.left_out[:5]],
            )

    async def on_stop(self) -> None:
        # our tasks (scoring, counts, the watch) and the reports under way have ended: the host
        # ends them first (laminar.runtime.service)
        if self.rewards is not None:
            await self.rewards.close()
        store, self.store = self.store, None  # requests from now on get a clear error
        if store is not None:
            await self._db(store.close)

    def stats(self) -> dict[str, float]:
        rounds = self.rounds.stats() if self.rounds is not None else {}
        counts = {k: float(v) for k, v in self._counts.items()}
        episodes = self.episodes.stats() if self.episodes is not None else {}
        focus = {"focus_skipped": float(self.focus.skipped)} if self.focus is not None else {}
        return {
            **counts,
            "prompts_left_out": float(self._left_out),
            **rounds,
            **episodes,
            **focus,
        }

    # -- endpoints ---------------------------------------------------------------------------

    @endpoint
    async def take(self, req: TakeRequest) -> Assignments:
        return await self.leasing.take(req)

    @endpoint
    async def report(self, req: Report) -> ReportReply:
        # Stored whole even if the rollout's connection closes meanwhile (it stopped right
        # after sending): see ServiceContext.run_to_end.
        return await self.ctx.run_to_end(self.reports.report(req), name="report")

    @endpoint
    async def release(self, req: LeaseRelease) -> Released:
        return await self.leasing.release(req)

    @endpoint
    async def transfer(self, req: LeaseTransfer) -> Transferred:
        # The moved leases' hand-off grace is kept even if the manager's connection closes
        # meanwhile: without it the destination's next take would release what it is receiving.
        return await self.ctx.run_to_end(self.leasing.transfer(req), name="transfer")

    @endpoint
    async def sample(self, req: SampleRequest) -> Trajectories:
        return await self.sampling.sample(req)

    @endpoint
    async def status(self) -> DataStatus:
        return await self._db(self._status, self._need_store())

    def _observe_group(self, trajectory_id: str, informative: bool) -> None:
        """``focus`` learns from a whole group leaving the buffer (on the store's thread)."""
        focus = self.focus
        assert focus is not None and self.store is not None
        focus.observe(self.store.record_of(trajectory_id), informative)
        self._groups_seen += 1
        if self._groups_seen % FOCUS_LOG_EVERY == 0:  # what it does, in the role's log
            self.log.info("focus", groups=self._groups_seen, skipped=focus.skipped,
                          admitted=focus.admitted, rates=focus.rates())  # fmt: skip

    def _status(self, store: Store) -> DataStatus:  # one DB-thread call: a consistent snapshot
        counts = store.counts()
        exhausted = store.exhausted(self.config.epochs)
        finished = (
            exhausted
            and counts["queued"] == 0
            and counts["leased"] == 0
            and store.parked_count() == 0  # deferred groups wait for a later round
            and counts["scored"] == counts["trajectories"]
        )
        return DataStatus(
            **counts,
            exhausted=exhausted,
            finished=finished,
            mean_reward=store.mean_reward(),
            held=self.buffer.held if self.buffer is not None else 0,
            focus_skipped=self.focus.skipped if self.focus is not None else 0,
            prompts_left_out=self._left_out,
            focus_rates=self.focus.rates() if self.focus is not None else {},
            leases={k: len(v) for k, v in store.leases().items()},
        )

    @endpoint
    async def env_step(self, req: EnvStepRequest) -> EnvStepReply:
        if self.episodes is None:
            raise ConfigError("this task has no environment (data.env is not set)")
        store = self._need_store()
        holder = await self._db(store.holder, req.trajectory_id)
        if holder is None or holder[0] != "leased" or holder[1] != req.rollout:
            return EnvStepReply(dropped=True)  # reassigned (or done): not this rollout's to step
        record = await self._db(store.record_of, req.trajectory_id)
        return await self.episodes.step(
            req.trajectory_id, record, list(req.response_token_ids), list(req.env_spans)
        )

    @endpoint
    async def completed_ids(self) -> CompletedIds:
        return CompletedIds(ids=await self._db(self._need_store().completed_ids))

    @endpoint
    async def partial_lengths(self) -> PartialLengths:
        return PartialLengths(lengths=await self._db(self._need_store().partial_lengths))

    # -- background --------------------------------------------------------------------------

    async def _refresh_counts(self) -> None:
        self._counts = counts = await self._db(self._need_store().counts)
        self._m_failed.labels("quarantined").set(counts["quarantined"])
        self._m_failed.labels("other").set(counts["failed"] - counts["quarantined"])

    async def _counts_loop(self) -> None:
        """Keep the heartbeat's numbers fresh. ``counts`` aggregates whole tables, so it runs once
        per heartbeat interval rather than on every report (a hot path)."""
        while True:
            await self.ctx.clock.sleep(self.ctx.cluster.heartbeat_interval_s)
            await self._refresh_counts()
