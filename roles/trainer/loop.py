"""The trainer loop, once for both trainers: batches in, versions out, on the schedule's terms.

The torch ``trainer`` and the emulated ``sim_trainer`` differ only in their compute
(:class:`.step.Compute`: a policy-gradient step, or a sleep for a cost model's time); this loop is
everything else, so a schedule measured on the sim trainer is the loop a real run uses. Per
version:

1. **sample** the next ``rows`` trajectories (whole groups) after the committed cursor
   (:class:`.batches.BatchSource`); a version the schedule held back goes out now if the batch
   just sampled lets it (below);
2. **number** it: one past the trainer's version, or past what the master relay refused ours for
   (a restarted trainer whose published mark was lost; :class:`WeightPublisher`). Round schedules
   count versions against batches, so there the number is never moved;
3. **staleness** of each trajectory = this version's predecessor - the version that generated it
   (histogram, max);
4. **screen** out what must not be trained on (:mod:`laminar.rl.screen`, counted and logged by
   :class:`.integrity.IntegrityMonitor`) and **train** on the rest; a batch with nothing left is
   consumed all the same, the weights unchanged, so a poison batch is never retried forever and
   every version still maps to one batch (round schedules wait for ``version == round``);
5. **checkpoint** every ``checkpoint_every`` versions and at ``max_versions``, before the version
   can go out: a version that reached a rollout is recoverable;
6. **publish** through :class:`WeightPublisher` (the stall is one host copy at most: the torch
   trainer's runs during the next step, whose optimizer waits for it, ``weights_wait_s``, which
   counts to the publish's stall; ``roles/trainer/staging.py``) if the schedule lets it out now
   (:func:`laminar.runtime.schedules.may_publish`: ``one_step`` holds version ``v`` until batch
   ``v``
   has been sampled, the global barrier every rollout switches at), else hold it;
7. **record** one metrics line (``metrics_file``, TensorBoard/W&B through
   :class:`TrainerTracking`; each numeric extra of the batch's rewards as its mean,
   ``reward/<name>``: :func:`reward_extras`) and keep it for ``status`` and ``learning`` (the
   admin API's curves); **evaluate** when ``eval_every_s`` has passed and the compute measures
   anything (its result kept the same way).

Time comes only from the service's clock; blocking work runs in the compute's executor.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Gauge, Histogram

from laminar.rl.screen import ExcludeScope, screen_batch
from laminar.roles.trainer.api import EvalPoint, LearningRequest, LearningSeries, VersionPoint
from laminar.roles.trainer.publisher import WeightPublisher
from laminar.runtime.context import ServiceContext
from laminar.runtime.schedules import may_publish
from laminar.tracking import TrackingConfig, TrainerTracking
from laminar.tracking.progress import policy_reward
from laminar.trajectory import Trajectory
from laminar.weights.config import PublishConfig

from .batches import BatchSource
from .integrity import IntegrityMonitor
from .step import Compute, Progress, StepResult

# the fields of a version's record its log line carries
LOGGED = "version tokens train_s reward_mean staleness_max mismatch_kl clip_frac".split()


def reward_extras(batch: Sequence[Trajectory]) -> dict[str, float]:
    """The numeric extras of the batch's rewards (``Trajectory.reward_extras``), each as its mean
    over the trajectories that have it, keyed ``reward/<name>`` (TensorBoard and W&B show them
    as ``train/reward/<name>``)."""
    values: dict[str, list[float]] = {}
    for t in batch:
        for name, value in t.reward_extras.items():
            values.setdefault(name, []).append(value)
    return {f"reward/{name}": sum(v) / len(v) for name, v in sorted(values.items())}


@dataclass(frozen=True)
class LoopSettings:
    """The loop's share of a trainer's config (each service maps its own keys onto it)."""

    rows: int  # trajectories per batch (prompts x samples)
    publish: PublishConfig
    max_versions: int | None
    sample_wait_s: float
    data: str | None  # the data role's address (None: ask the manager)
    checkpoint_every: int | None  # None: never (a compute with nothing to keep)
    metrics_file: str | None
    tracking: TrackingConfig
    config: dict[str, Any] = field(default_factory=dict)  # the whole config, for the tracker
    exclude_scope: ExcludeScope = "trajectory"
    eval_every_s: float | None = None  # None: never evaluate
    eval_at_start: bool = False


class TrainLoop:
    def __init__(
        self, ctx: ServiceContext, log: Any, settings: LoopSettings, compute: Compute
    ) -> None:
        self.ctx, self.log, self.settings, self.compute = ctx, log, settings, compute
        self.progress = Progress()
        self.max_staleness = 0
        self.trained_tokens = 0
        self.training = True
        self.published: list[int] = []  # versions handed to the publisher, in order
        self.records: list[dict[str, Any]] = []  # one per version trained (module docstring)
        self.evals: list[dict[str, Any]] = []  # one per evaluation that measured something
        self.publisher: WeightPublisher | None = None
        self.tracking: TrainerTracking | None = None
        self.source = BatchSource(ctx, log, settings.data, settings.sample_wait_s)
        self.integrity = IntegrityMonitor(ctx.registry, log)
        self._held: int | None = None  # a trained version the schedule does not let out yet
        self._last_eval = float("-inf")
        registry = ctx.registry
        self.m_staleness = Histogram(
            "laminar_staleness",
            "Trainer version minus generating version, per trajectory",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
            registry=registry,
        )
        self.m_max_staleness = Gauge(
            "laminar_staleness_max", "Largest staleness trained on", registry=registry
        )
        self.m_version = Gauge(
            "laminar_trainer_version", "Newest trained version", registry=registry
        )
        self.m_stall = Histogram(
            "laminar_publish_stall_seconds",
            "Trainer stall per publish, until the copy is started or done",
            registry=registry,
        )
        self.m_fence = Histogram(
            "laminar_publish_fence_wait_seconds",
            "Optimizer steps' wait for a publish's background copy (the rest of its stall)",
            registry=registry,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Resume, start the publisher, republish what the compute asks for, start training."""
        s = self.settings
        resumed = await self.compute.resume()
        self.progress = resumed.progress
        self.tracking = TrainerTracking(s.tracking, s.metrics_file, self.log, s.config)
        self.m_version.set(self.progress.version)
        manager = self.ctx.client(self.ctx.manager) if self.ctx.manager else None
        self.publisher = WeightPublisher(
            s.publish,
            self.ctx.options,
            manager=manager,
            log=self.log,
            clock=self.ctx.clock,
            executor=self.ctx.executor("publish-checksums", workers=1),
        )
        self.ctx.spawn(self.publisher.run(), name="publish")
        if resumed.publish:
            await self._offer(self.progress.version)
        self.ctx.spawn(self.run(), name="train")

    async def close(self) -> None:
        # Training has stopped (the host ends a service's tasks before its on_stop), so nothing
        # it would do next (a step, a checkpoint, an evaluation) queues behind the compute's
        # close; a step under way in the compute's thread finishes there, unrecorded, as if the
        # trainer had been killed after it.
        await self.compute.close()
        if self.tracking is not None:
            await self.ctx.executor("tracking", workers=1).run(self.tracking.close)

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        if s.eval_every_s is not None and s.eval_at_start:
            await self._evaluate()
        while s.max_versions is None or self.progress.version < s.max_versions:
            await self.step()
            if s.eval_every_s is not None and self._since_eval() >= s.eval_every_s:
                await self._evaluate()
        if self._held is not None:  # nothing more will be sampled: the barrier is moot
            await self._publish(self._held)
        self.training = False
        self.log.info("training finished", version=self.progress.version)

    async def step(self) -> None:
        """One batch in, one version out (or held); see the module docstring."""
        s, p, clock = self.settings, self.progress, self.ctx.clock
        kind = self.ctx.cluster.schedule.kind
        got = await self.source.next(s.rows, p.version, p.cursor)
        batch = got.items
        sampled_at = clock.wall()
        p.batches += 1
        if self._held is not None and may_publish(kind, self._held, p.batches):
            await self._publish(self._held)
        version = self._next_version()  # may move p.version past a number the master holds
        staleness = [p.version - t.version for t in batch]
        for value in staleness:
            self.m_staleness.observe(value)
        self.max_staleness = max(self.max_staleness, *staleness)
        self.m_max_staleness.set(self.max_staleness)
        screened = screen_batch(batch, s.exclude_scope)
        self.integrity.screened(screened, version)
        train_start, started = clock.wall(), clock.time()
        if screened.kept:
            result = await self.compute.train(screened, version)
        else:  # nothing trainable: the batch is consumed, the weights stay
            result = StepResult(stats={}, grad_norm=None, tokens=0)
        train_s, train_end = clock.time() - started, clock.wall()
        if result.weights_wait_s and self.publisher is not None:  # the last publish's copy
            self.publisher.fenced(result.weights_wait_s)
            self.m_fence.observe(result.weights_wait_s)
        self.integrity.stepped(result, version)
        first = p.cursor + 1
        p.version, p.cursor = version, got.cursor
        self.trained_tokens += result.tokens
        if p.history is not None:
            entry = {"version": version, "seqs": [first, got.cursor]}
            p.history.append({**entry, **self.integrity.history(screened, result)})
        every = s.checkpoint_every
        if every is not None and (version % every == 0 or version == s.max_versions):
            await self.compute.checkpoint(p, clock.wall())
        rewards = screened.rewards
        record: dict[str, Any] = {
            "version": version,
            "cursor": got.cursor,
            "time": train_end,  # set again once the version is out (or held)
            "tokens": result.tokens,
            "trajectories": len(batch),
            "sampled_at": sampled_at,
            "train_start": train_start,
            "train_end": train_end,
            "train_s": train_s,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "excluded": screened.excluded_count,
            "skipped_steps": result.skipped_steps,
            "reward_generated": got.reward_generated,  # filtered groups' rewards too
            **reward_extras(batch),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "staleness_counts": {str(k): staleness.count(k) for k in sorted(set(staleness))},
            "gen_versions": sorted({t.version for t in batch}),
            "grad_norm": result.grad_norm,
            "weights_wait_s": result.weights_wait_s,
            "publish_stall_s": None,  # set when it goes out
            **result.stats,
        }
        self.records.append(record)
        await self._offer(version)
        self.m_version.set(version)
        record["time"] = clock.wall()
        self.log.info("version trained", **{k: record.get(k) for k in LOGGED})
        self._write(record)

    # -- versions ----------------------------------------------------------------------------

    def _next_version(self) -> int:
        """The number of the version being trained (see the module docstring, step 2)."""
        assert self.publisher is not None
        p, newest = self.progress, self.publisher.master_newest
        if not self.ctx.cluster.schedule.rounds and newest > p.version:
            self.log.error(
                "the master relay holds newer versions than this trainer; continuing after them",
                version=p.version,
                master_newest=newest,
            )
            p.version = newest
        return p.version + 1

    async def _offer(self, version: int) -> None:
        """Publish ``version`` now if the schedule lets it out, else hold it (a newer held
        version replaces an older one: rollouts only ever want the newest)."""
        kind = self.ctx.cluster.schedule.kind
        if may_publish(kind, version, self.progress.batches):
            await self._publish(version)
        else:
            self._held = version

    async def _publish(self, version: int) -> None:
        assert self.publisher is not None
        vb = await self.compute.stage(self.publisher, version)
        await self.publisher.hand_off(vb)
        if self._held == version:
            self._held = None
        stall = self.publisher.stalls[-1]
        self.m_stall.observe(stall)
        self.published.append(version)
        for record in reversed(self.records):
            if record["version"] == version:
                record["published_at"] = self.ctx.clock.wall()
                record["publish_stall_s"] = stall
                break

    # -- evaluation and records --------------------------------------------------------------

    def _since_eval(self) -> float:
        return self.ctx.clock.time() - self._last_eval

    async def _evaluate(self) -> None:
        version = self.progress.version
        result = await self.compute.evaluate(version)
        self._last_eval = self.ctx.clock.time()
        if result is None:
            return
        self.log.info(
            "evaluated",
            version=version,
            accuracy=result.get("accuracy"),
            seconds=result.get("eval_s"),
        )
        record = {"eval": True, "version": version, "time": self.ctx.clock.wall(), **result}
        self.evals.append(record)
        self._write(record)

    def learning(self, request: LearningRequest) -> LearningSeries:
        """The learning curves' points (:class:`~laminar.roles.trainer.api.LearningApi`): the
        newest ``limit`` versions after ``since`` and evaluations of versions from ``since``."""
        since, limit = request.since, request.limit
        points: list[VersionPoint] = []
        # newest first, so a long run's answer costs what it returns, not what it kept
        for i in range(len(self.records) - 1, -1, -1):
            record = self.records[i]
            if record["version"] <= since or len(points) == limit:
                break
            before = self.records[i - 1]["time"] if i > 0 else None
            interval = record["time"] - before if before is not None else 0.0
            has_reward = record.get("reward_generated") is not None or (
                record.get("reward_mean") is not None
            )
            points.append(
                VersionPoint(
                    version=record["version"],
                    time=record["time"],
                    reward=policy_reward(record) if has_reward else None,
                    reward_trained=record.get("reward_mean"),
                    tokens=record["tokens"],
                    tokens_per_s=record["tokens"] / interval if interval > 0 else None,
                    staleness_mean=record["staleness_mean"],
                    staleness_max=record["staleness_max"],
                )
            )
        evals = [
            EvalPoint(
                version=e["version"],
                time=e["time"],
                accuracy=e["accuracy"],
                n=e.get("n"),
                buckets={k: b["accuracy"] for k, b in (e.get("buckets") or {}).items()},
            )
            for e in self.evals[-limit:]
            if e["version"] >= since and e.get("accuracy") is not None
        ]
        return LearningSeries(version=self.progress.version, versions=points[::-1], evals=evals)

    def _write(self, record: dict[str, Any]) -> None:
        if self.tracking is not None:
            self.tracking.record(record, record["time"])
        if self.settings.metrics_file is None:
            return
        path = Path(self.settings.metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
