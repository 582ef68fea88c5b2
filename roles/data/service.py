"""The data role: prompt pool, partial-response pool and experience buffer, durable.

Flow of one trajectory:

1. ``take`` (a rollout with free slots): the prompt pool queues whole groups (n samples per
   prompt, in a seeded order) and leases queued samples to the rollout. Requeued samples that
   carry partial tokens go only to a rollout of the same weight version (a resume).
2. ``report`` (every flush interval of the rollout): new tokens go to the partial-response pool;
   finished trajectories go to the experience buffer, exactly once, their partials dropped.
3. The writer scores each new trajectory with the reward plug-in in a worker process (off the
   event loop, with a timeout) and records the reward or the reason there is none.
4. ``sample`` (the trainer): the sampler picks scored trajectories, which are marked consumed
   with a consume seq (the trainer's cursor: it re-asks from its last committed cursor after a
   crash), optionally as whole groups and within a staleness bound (``buffer.ExperienceBuffer``).

Durability: all state is in :class:`Store` (SQLite, WAL); every acknowledgement follows a commit
(what a commit survives, kill -9 or power loss, is ``store_synchronous``: see ``store``).
Database calls run on one dedicated thread, so the event loop never blocks on disk.

Bad input fails alone: a report is stored item by item (a bad item is refused and named in the
reply), and a trajectory that cannot be generated (its engine refused it, its completion is
invalid, or rollouts keep dying while holding it) is recorded as failed for good, counted and
never handed out again (``failures``).

Failures: the role watches the manager's membership stream; when a rollout dies its leases return
to the front of the queue with their partial tokens, for another rollout of the same version to
resume. After a restart of this role, leases of rollouts that are not alive are released the same
way; rollouts that are alive keep theirs (they will report them). After a restart of the manager,
a rollout missing from its member list is released only once it has had a heartbeat timeout to
rejoin (``_watch_rollouts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from prometheus_client import Counter, Gauge
from pydantic import Field

from laminar.config import ServiceConfig, Strict
from laminar.endpoint import endpoint
from laminar.errors import CallTimeout, ConfigError, PeerUnavailable, RemoteError
from laminar.membership import MembershipApi, WatchRequest
from laminar.service import Service, ServiceContext
from laminar.trajectory import Assignment, SamplingParams, Trajectory

from .api import (
    Assignments,
    CompletedIds,
    DataApi,
    DataStatus,
    LeaseTransfer,
    PartialLengths,
    RejectedItem,
    Report,
    ReportReply,
    SampleRequest,
    TakeRequest,
    Trajectories,
    Transferred,
)
from .buffer import EVICTIONS, SAMPLERS, Batch, ExperienceBuffer, make_policy
from .prompts import fingerprint, load_tokenizer, read_records, tokenize_records
from .rewards import RewardPool, RewardSandbox
from .rounds import RoundGate
from .store import Store

T = TypeVar("T")


def _invalid(t: Trajectory) -> str | None:
    """Why a completion cannot be trained on (None: it can)."""
    bad = next((i for i, lp in enumerate(t.logprobs) if not math.isfinite(lp)), None)
    if bad is not None:
        return f"behaviour logprob of response token {bad} is {t.logprobs[bad]}"
    return None


class PolicySpec(Strict):
    kind: str = Field(description="A built-in name or module:Class / file.py:Class.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the policy's constructor."
    )


class SamplingConfig(Strict):
    max_tokens: Annotated[int, Field(ge=1)] = Field(256, description="Most response tokens.")
    temperature: Annotated[float, Field(ge=0)] = Field(
        1.0, description="Sampling temperature (keep trainer.temperature equal)."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(1.0, description="Nucleus sampling mass.")
    top_k: Annotated[int, Field(ge=0)] = Field(0, description="Top-k sampling; 0 = off.")
    seed: int | None = Field(
        None,
        description="Set: each trajectory samples with its own seed derived from this and its id "
        "(reproducible runs). null: engine randomness.",
    )
    ignore_eos: bool = Field(
        False,
        description="Generate max_tokens every time, past EOS (fixed-length benchmarks, tests).",
    )


class StalenessConfig(Strict):
    bound: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="Max trainer_version - trajectory version a sample may hand out; null = off.",
    )
    action: Literal["drop", "hold"] = Field(
        "drop",
        description="drop: evict staler trajectories for good (counted); hold: skip them but keep "
        "them buffered (a later, larger bound can still use them).",
    )


class DataConfig(ServiceConfig):
    prompts: str = Field(description="Prompt dataset: .jsonl or .parquet (relative to the cwd).")
    tokenizer: str = Field(description="Model directory (or tokenizer.json) to tokenize prompts.")
    reward: str = Field(description="Reward function: module:function or file.py:function.")
    max_prompt_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Leave out prompts longer than this many tokens (a curriculum, or a bound on "
        "the prompt part of the context); null: keep all. Those left out are counted "
        "(`prompts_left_out` in the stats).",
    )
    max_model_len: Annotated[int, Field(ge=2)] | None = Field(
        None,
        description="The rollouts' context length; unset, it is taken from the same file's "
        "rollout.engine.max_model_len (laminar.config.DERIVED). Set: a prompt "
        "that leaves no room for a response (tokens >= this) is an error at load naming the "
        "record (to leave such prompts out instead, set max_prompt_tokens below it); a prompt "
        "that fits but leaves less than sampling.max_tokens gets a response cut at the limit "
        "(finish reason length, counted in the log). null in both: not checked at load; a "
        "rollout's engine refuses such a prompt and its trajectories are recorded as failed.",
    )
    id_key: str = Field("id", description="Record field holding the prompt's unique id.")
    prompt_key: str = Field("prompt", description="Record field holding the prompt text.")
    samples_per_prompt: Annotated[int, Field(ge=1)] = Field(
        4, description="Trajectories per prompt (a group, for group-relative advantages)."
    )
    epochs: Annotated[int, Field(ge=1)] | None = Field(1, description="null = cycle forever.")
    seed: int = Field(0, description="Seeds the per-epoch prompt order.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    store: str = Field(
        "runs/latest/data.sqlite",
        description="SQLite file of the prompt, partial-response and experience pools (durable).",
    )
    store_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL",
        description="SQLite synchronous setting of the store. NORMAL: an acknowledged report, "
        "take or sample survives the data role being killed (kill -9, a crash), but an OS crash "
        "or power loss can drop the last ones acknowledged. FULL: each is fsynced before it is "
        "acknowledged, so it also survives an OS crash or power loss (one fsync per call).",
    )
    quarantine_after: Annotated[int, Field(ge=1)] = Field(
        2,
        description="A trajectory whose rollouts died this many times in a row while holding it "
        "(no token acknowledged in between) is recorded as failed (quarantined) instead of "
        "being handed to the next rollout: a poison prompt cannot take down every rollout.",
    )
    queue_ahead: Annotated[int, Field(ge=1)] = Field(
        256, description="Samples kept queued ahead of demand (whole prompt groups)."
    )
    max_ahead: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Backpressure: at most this many trajectories in generation or finished but "
        "not yet trained on; rollouts get no new prompts beyond it. When generation outpaces "
        "training, an unbounded backlog makes staleness grow without limit (FIFO consumption); "
        "about 2 global batches keeps it at 1-3 versions. Unset: no limit.",
    )
    reward_workers: Annotated[int, Field(ge=1)] = Field(
        1, description="Worker processes running the reward function."
    )
    reward_timeout_s: Annotated[float, Field(gt=0)] = Field(
        10.0, description="A reward call running longer is killed (the trajectory gets no reward)."
    )
    reward_sandbox: RewardSandbox = Field(
        default_factory=RewardSandbox,
        description="What a reward worker may use: memory, CPU seconds, processes, environment "
        "(roles/data/rewards.py).",
    )
    drop_constant_groups: bool = Field(
        False,
        description="Dynamic sampling (DAPO): evict complete groups whose rewards are all equal "
        "(advantage 0 for every member) instead of training on them; counted in `filtered`. "
        "Applies to whole-group samples (the trainer's).",
    )
    sampler: PolicySpec = Field(default_factory=lambda: PolicySpec(kind="fifo"))
    eviction: PolicySpec = Field(default_factory=lambda: PolicySpec(kind="none"))
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)


HANDOFF_GRACE_S = 60.0  # a repack handoff not arrived by then is a lost lease (re-delivered)


def trajectory_seed(seed: int, trajectory_id: str) -> int:
    """A stable 31-bit sampling seed per trajectory (the same on every rollout and every run)."""
    digest = hashlib.blake2b(f"{seed}/{trajectory_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class DataService(Service, DataApi):
    role: ClassVar[str] = "data"
    config_model: ClassVar[type[ServiceConfig]] = DataConfig
    config: DataConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="data-store")
        self.store: Store | None = None
        self.rewards: RewardPool | None = None
        self.buffer: ExperienceBuffer | None = None
        self.tokenizer: Any = None
        self._work = asyncio.Event()  # set when samples may have become available
        self._ready = asyncio.Event()  # set when scored trajectories arrive
        self._to_score: asyncio.Queue[str] = asyncio.Queue()
        self._counts: dict[str, int] = {}
        self._scored = (0, 0.0)  # trajectories scored since the last sample, their reward sum
        self._rollout_versions: dict[str, int] = {}  # weight version each live rollout last took at
        self._left_out = 0  # prompts left out at load (max_prompt_tokens)
        self._m_failed = Gauge(
            "laminar_data_failed_trajectories",
            "Trajectories recorded as failed (never handed out again), by kind",
            ["kind"],
            registry=ctx.registry,
        )
        self._m_rejected = Counter(
            "laminar_data_report_items_rejected",
            "Report items refused (the rest of their report was stored), by item",
            ["item"],
            registry=ctx.registry,
        )
        # Leases repack moved to a rollout whose handoff may still be on its way: its takes must
        # not re-deliver them meanwhile (rollout -> trajectory id -> deadline, loop time).
        self._handoffs: dict[str, dict[str, float]] = {}
        self._background: list[asyncio.Task[None]] = []
        c = self.config
        self.params = SamplingParams(
            max_tokens=c.sampling.max_tokens,
            temperature=c.sampling.temperature,
            top_p=c.sampling.top_p,
            top_k=c.sampling.top_k,
            ignore_eos=c.sampling.ignore_eos,
        )
        self.sampler = make_policy(c.sampler.kind, SAMPLERS, c.sampler.options)
        self.eviction = make_policy(c.eviction.kind, EVICTIONS, c.eviction.options)
        # Round schedules (sync, one_step, tail_batching; laminar.schedules): prompts go out in
        # gated rounds. None under laminar: every path below behaves as without schedules.
        schedule = ctx.cluster.schedule
        self.rounds = (
            RoundGate(schedule, c.samples_per_prompt, c.seed, c.epochs) if schedule.rounds else None
        )

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- lifecycle ---------------------------------------------------------------------------

    async def on_start(self) -> None:
        c = self.config
        self.tokenizer = load_tokenizer(c.tokenizer)
        records = read_records(c.prompts)
        rows = tokenize_records(
            records,
            self.tokenizer,
            id_key=c.id_key,
            prompt_key=c.prompt_key,
            source=c.prompts,
            max_prompt_tokens=c.max_prompt_tokens,
            max_model_len=c.max_model_len,
        )
        self._left_out = len(records) - len(rows)
        if self._left_out:
            self.log.info("prompts left out", longer_than=c.max_prompt_tokens,
                          left_out=self._left_out, kept=len(rows))  # fmt: skip
        if c.max_model_len is not None:
            room = c.max_model_len - c.sampling.max_tokens
            cut = sum(len(ids) > room for _, _, ids in rows)
            if cut:
                self.log.info("responses of some prompts will stop at the context limit",
                              prompts=cut, max_model_len=c.max_model_len,
                              max_tokens=c.sampling.max_tokens)  # fmt: skip
        extra = f"{c.samples_per_prompt}/{c.seed}"
        if c.max_prompt_tokens is not None:  # another prompt set: another dataset
            extra += f"/{c.max_prompt_tokens}"
        print_ = fingerprint(c.prompts, c.tokenizer, extra=extra)
        self.store = await self._db(
            functools.partial(Store, c.store, synchronous=c.store_synchronous)
        )
        self.buffer = ExperienceBuffer(
            self.store,
            self.sampler,
            self.eviction,
            group_size=c.samples_per_prompt,
            staleness_bound=c.staleness.bound,
            staleness_action=c.staleness.action,
            drop_constant_groups=c.drop_constant_groups,
        )
        try:
            await self._db(self.store.load_prompts, rows, print_)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.rewards = RewardPool(
            c.reward,
            workers=c.reward_workers,
            timeout_s=c.reward_timeout_s,
            sandbox=c.reward_sandbox,
            token_env=self.ctx.cluster.token_env,
        )
        for tid in await self._db(self.store.unscored):  # completed before a crash, not scored
            self._to_score.put_nowait(tid)
        await self._refresh_counts()
        self.log.info("data ready", prompts=len(rows), store=c.store, **self._counts)
        for i in range(c.reward_workers):
            self._background.append(self.spawn(self._score_loop(), name=f"score-{i}"))
        self._background.append(self.spawn(self._counts_loop(), name="counts"))
        if self.ctx.manager is not None:
            self._background.append(self.spawn(self._watch_rollouts(), name="watch-rollouts"))

    async def on_stop(self) -> None:
        # Stop our own tasks before closing what they use (the host cancels them only later).
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.rewards is not None:
            await self.rewards.close()
        store, self.store = self.store, None  # requests from now on get a clear error
        if store is not None:
            await self._db(store.close)
        self._thread.shutdown(wait=True)

    def stats(self) -> dict[str, float]:
        rounds = self.rounds.stats() if self.rounds is not None else {}
        counts = {k: float(v) for k, v in self._counts.items()}
        return {**counts, "prompts_left_out": float(self._left_out), **rounds}

    # -- endpoints ---------------------------------------------------------------------------

    @endpoint
    async def take(self, req: TakeRequest) -> Assignments:
        store = self._need_store()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.wait_s
        self._rollout_versions[req.rollout] = req.version
        while True:
            self._work.clear()
            alive = set(self._rollout_versions.values())
            in_handoff = self._in_handoff(req.rollout, req.holding)
            out = await self._db(self._lease, store, req, alive, in_handoff)
            remaining = deadline - loop.time()
            if out or remaining <= 0:
                return Assignments(items=out)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._work.wait(), remaining)

    def _in_handoff(self, rollout: str, holding: list[str]) -> set[str]:
        """Moved leases ``rollout`` does not hold yet but whose handoff may still arrive."""
        pending = self._handoffs.get(rollout)
        if not pending:
            return set()
        now = asyncio.get_running_loop().time()
        for tid in [*holding, *(t for t, deadline in pending.items() if deadline < now)]:
            pending.pop(tid, None)  # arrived, or given up on: a lost lease again
        return set(pending)

    def _lease(
        self, store: Store, req: TakeRequest, alive_versions: set[int], in_handoff: set[str]
    ) -> list[Assignment]:
        c = self.config
        restarted = store.unbind_versions(alive_versions)
        if restarted:
            self.log.info("restarting resumes of a version no rollout holds", count=len(restarted))
        holding = set(req.holding) | in_handoff
        if self.rounds is not None:  # a round schedule: only the open round, only its version
            out = self.rounds.lease(
                store, req.rollout, req.max_count, req.version, holding, self.params
            )
        else:
            store.refill(c.queue_ahead + req.max_count, c.samples_per_prompt, c.seed, c.epochs)
            fresh = None if c.max_ahead is None else max(0, c.max_ahead - store.ahead())
            out = store.lease(
                req.rollout, req.max_count, req.version, holding, self.params, fresh_limit=fresh
            )
        if c.sampling.seed is not None:
            out = [
                a.model_copy(
                    update={
                        "params": a.params.model_copy(
                            update={"seed": trajectory_seed(c.sampling.seed, a.trajectory_id)}
                        )
                    }
                )
                for a in out
            ]
        return out

    @endpoint
    async def report(self, req: Report) -> ReportReply:
        """Store what a report carries, item by item (``api``: a bad item is refused alone)."""
        store = self._need_store()
        reply = ReportReply()
        if req.partials:
            reply.drop, refused = await self._db(store.append_partials, req.rollout, req.partials)
            self._refuse_items(reply, req.rollout, "partial", refused)
        failed = [(f.trajectory_id, f.reason) for f in req.failed]
        invalid = [(t.trajectory_id, why) for t in req.completed if (why := _invalid(t))]
        if failed or invalid:
            refused = await self._db(self._fail, store, req.rollout, failed, invalid)
            self._refuse_items(reply, req.rollout, "failed", refused)
        bad = {tid for tid, _ in invalid}
        completed = [t for t in req.completed if t.trajectory_id not in bad]
        self._refuse_items(reply, req.rollout, "completed", invalid)
        if completed:
            new, reply.duplicates, refused = await self._db(
                self._complete, store, req.rollout, completed
            )
            self._refuse_items(reply, req.rollout, "completed", refused)
            for tid in new:
                self._to_score.put_nowait(tid)
        if self.rounds is not None and not self.rounds.open:
            self._work.set()  # a round ended: waiting takes re-check for the next one
        return reply

    def _refuse_items(
        self,
        reply: ReportReply,
        rollout: str,
        item: Literal["partial", "completed", "failed"],
        refused: list[tuple[str, str]],
    ) -> None:
        for tid, reason in refused:
            self.log.warning("report item refused", rollout=rollout, item=item,
                             trajectory=tid, reason=reason)  # fmt: skip
            reply.rejected.append(RejectedItem(trajectory_id=tid, item=item, reason=reason))
            self._m_rejected.labels(item).inc()

    def _fail(
        self,
        store: Store,
        rollout: str,
        failed: list[tuple[str, str]],
        invalid: list[tuple[str, str]],
    ) -> list[tuple[str, str]]:
        """Record failures (the engine's refusals, invalid completions); returns refused ones."""
        recorded, refused = store.fail(rollout, failed, "refused")
        recorded += store.fail(rollout, invalid, "invalid")[0]  # unknown ones: refused later
        for tid, reason in [*failed, *invalid]:
            if tid in recorded:
                self.log.error("trajectory failed", trajectory=tid, rollout=rollout, reason=reason)
        if recorded and self.rounds is not None:
            self.rounds.note_failed(store, recorded)
        return refused

    def _release_dead(self, rollout: str) -> list[str]:
        """Release a dead rollout's leases with a strike each; returns the ids it held."""
        store = self._need_store()
        released, quarantined = store.release_dead(rollout, self.config.quarantine_after)
        for tid, reason in quarantined:
            self.log.error("trajectory quarantined", trajectory=tid, rollout=rollout, reason=reason)
        if quarantined and self.rounds is not None:
            self.rounds.note_failed(store, [tid for tid, _ in quarantined])
        return released + [tid for tid, _ in quarantined]

    def _complete(
        self, store: Store, rollout: str, completed: list[Trajectory]
    ) -> tuple[list[str], int, list[tuple[str, str]]]:
        if self.rounds is None:
            return store.complete(rollout, completed)
        # round schedules: completions of deferred samples are ignored; a round may end here
        new, dupes, refused = store.complete(
            rollout, self.rounds.filter_completed(store, completed)
        )
        self.rounds.note_completed(store, new)
        return new, dupes, refused

    @endpoint
    async def transfer(self, req: LeaseTransfer) -> Transferred:
        store = self._need_store()
        moved = await self._db(store.transfer, req.trajectory_ids, req.source, req.destination)
        deadline = asyncio.get_running_loop().time() + HANDOFF_GRACE_S
        for tid in moved:
            self._handoffs.get(req.source, {}).pop(tid, None)
            self._handoffs.setdefault(req.destination, {})[tid] = deadline
        if moved:
            self.log.info(
                "leases moved", source=req.source, destination=req.destination, count=len(moved)
            )
        return Transferred(moved=moved)

    @endpoint
    async def sample(self, req: SampleRequest) -> Trajectories:
        self._need_store()
        buffer = self.buffer
        assert buffer is not None
        buffer.check(req.n, req.whole_groups)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.wait_s
        while True:
            self._ready.clear()
            final = loop.time() >= deadline
            batch = await self._db(self._sample_batch, buffer, req, final)
            if self.config.max_ahead is not None and (buffer.filtered or (batch and batch.items)):
                self._work.set()  # consumption or filtering made room: waiting takes re-check
            if batch is not None and (batch.items or final):
                (scored, reward_sum), self._scored = self._scored, (0, 0.0)
                return Trajectories(
                    items=batch.items,
                    seqs=batch.seqs,
                    cursor=batch.cursor,
                    redelivered=batch.redelivered,
                    scored=scored,
                    scored_reward_sum=reward_sum,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), max(deadline - loop.time(), 0.0))

    @staticmethod
    def _sample_batch(buffer: ExperienceBuffer, req: SampleRequest, final: bool) -> Batch | None:
        return buffer.sample(
            req.n,
            req.trainer_version,
            after=req.after,
            whole_groups=req.whole_groups,
            partial=final,
        )

    @endpoint
    async def status(self) -> DataStatus:
        return await self._db(self._status, self._need_store())

    def _status(self, store: Store) -> DataStatus:  # one DB-thread call: a consistent snapshot
        counts = store.counts()
        exhausted = store.exhausted(self.config.epochs)
        finished = (
            exhausted
            and counts["queued"] == 0
            and counts["leased"] == 0
            and counts["scored"] == counts["trajectories"]
        )
        return DataStatus(
            **counts,
            exhausted=exhausted,
            finished=finished,
            mean_reward=store.mean_reward(),
            held=self.buffer.held if self.buffer is not None else 0,
            leases={k: len(v) for k, v in store.leases().items()},
        )

    @endpoint
    async def completed_ids(self) -> CompletedIds:
        return CompletedIds(ids=await self._db(self._need_store().completed_ids))

    @endpoint
    async def partial_lengths(self) -> PartialLengths:
        return PartialLengths(lengths=await self._db(self._need_store().partial_lengths))

    # -- background --------------------------------------------------------------------------

    def _need_store(self) -> Store:
        if self.store is None:
            raise RuntimeError("the data store is not open (the data role is starting or stopping)")
        return self.store

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

    async def _score_loop(self) -> None:
        store, rewards = self._need_store(), self.rewards
        assert rewards is not None
        while True:
            tid = await self._to_score.get()
            try:
                t = await self._db(store.trajectory, tid)
            except KeyError:  # withdrawn meanwhile (a deferred prompt of tail_batching)
                continue
            record = await self._db(store.record_of, tid)
            text = self.tokenizer.decode(t.response_token_ids, skip_special_tokens=True)
            result = await rewards.score(record, text)
            if result.error is not None:
                self.log.warning("reward failed", trajectory=tid, error=result.error)
            await self._db(store.set_rewards, [(tid, result.reward, result.error)])
            if result.reward is not None:
                self._scored = (self._scored[0] + 1, self._scored[1] + result.reward)
            self._ready.set()

    async def _watch_rollouts(self) -> None:
        """Release the leases of rollouts that die (and of those that died while we, or the
        manager, were down).

        Subscribe, then read the member list: the watch's first item (a snapshot event) says the
        manager has registered it, so every change after that arrives as an event and none falls
        between the list and the stream. The list is acted on only once it is settled
        (``ClusterStatus.unsettled_s``): a restarted manager lists live rollouts only as they
        rejoin, and releasing the leases of one not back yet would take work from a live rollout.
        """
        assert self.ctx.manager is not None
        mgr = self.ctx.connect(MembershipApi, self.ctx.manager)
        while True:
            sweep: asyncio.Task[None] | None = None
            try:
                watch = mgr.watch.options(timeout=3600).stream(WatchRequest(snapshot=True))
                async for event in watch:
                    if sweep is None:  # registered with the manager: the list may be read now
                        sweep = asyncio.create_task(self._release_absent(mgr))
                    if event.event in ("dead", "left"):
                        await self._release(event.member.instance, event.event)
            except (PeerUnavailable, CallTimeout, RemoteError) as exc:
                self.log.warning("membership watch lost; retrying", error=str(exc))
            finally:
                if sweep is not None:
                    sweep.cancel()
                    (failed,) = await asyncio.gather(sweep, return_exceptions=True)
                    if isinstance(failed, Exception):
                        self.log.error("lease sweep failed", error=repr(failed))
            await self.ctx.clock.sleep(1.0)

    async def _release_absent(self, mgr: MembershipApi) -> None:
        """Release the leases of rollouts the manager's settled member list has not alive."""
        store = self._need_store()
        try:
            while (wait := (status := await mgr.status.call()).unsettled_s()) > 0:
                self.log.info("manager (re)started: waiting for members to rejoin before "
                              "releasing leases", manager_incarnation=status.incarnation,
                              wait_s=round(wait, 2))  # fmt: skip
                await self.ctx.clock.sleep(wait)
            # Holders first, then the list: a rollout that takes after the list was read is
            # not among the holders looked at, so a newcomer is never mistaken for a dead one.
            holders = await self._db(lambda: list(store.leases()))
            status = await mgr.status.call()
        except (PeerUnavailable, CallTimeout, RemoteError) as exc:
            self.log.info("member list unavailable; the next watch sweeps", error=str(exc))
            return
        alive = {m.instance for m in status.members if m.state == "alive"}
        for rollout in holders:
            if rollout not in alive:
                await self._release(rollout, "not alive in the manager's member list")

    async def _release(self, rollout: str, why: str) -> None:
        self._rollout_versions.pop(rollout, None)
        self._handoffs.pop(rollout, None)
        if why != "left":  # it died holding them (or vanished): a strike each (see failures)
            released = await self._db(self._release_dead, rollout)
        else:
            released = await self._db(self._need_store().release, rollout)
        if released:
            self.log.info("released leases", rollout=rollout, count=len(released), why=why)
            self._work.set()
