"""The trainer's side of the experience buffer: the writer that scores, and ``sample``.

The writer scores each new trajectory with the reward plug-in in a worker process (off the event
loop, with a timeout) and records the reward or the reason there is none, and the numeric extras
of a dict reward. A batched reward (TRL's, or ``async def``) gets what is waiting when a worker is
free, up to ``reward_batch``: no wait for a batch to fill, so batches grow only when scoring
falls behind. ``sample`` hands the
trainer scored trajectories chosen by the sampler (``buffer.ExperienceBuffer``: the consume
cursor, whole groups, the staleness bound), long-polling up to the request's ``wait_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from laminar.reward_calls import DECLINED
from laminar.trajectory import Trajectory

from .api import SampleRequest, Trajectories
from .buffer import Batch, ExperienceBuffer
from .context import DataContext
from .episodes import Episodes
from .rewards import RewardItem, RewardPool, RewardResult
from .store import Store


class Sampling:
    """Scores what ``to_score`` gets; ``wake`` tells waiting takes that consumption made room."""

    def __init__(
        self, ctx: DataContext, to_score: asyncio.Queue[str], wake: Callable[[], None]
    ) -> None:
        self.ctx = ctx
        self.to_score = to_score
        self._wake = wake
        self.buffer: ExperienceBuffer | None = None
        self._rewards: RewardPool | None = None
        self._episodes: Episodes | None = None
        self._tokenizer: Any = None
        self._ready = asyncio.Event()  # set when scored trajectories arrive
        self._scored = (0, 0.0)  # trajectories scored since the last sample, their reward sum

    def open(
        self,
        buffer: ExperienceBuffer,
        rewards: RewardPool | None,
        tokenizer: Any,
        episodes: Episodes | None = None,
    ) -> None:
        """What the service made at start-up (before the score loops run): a reward pool for
        single-turn tasks, the episodes for multi-turn ones."""
        self.buffer, self._rewards, self._tokenizer = buffer, rewards, tokenizer
        self._episodes = episodes

    async def sample(self, req: SampleRequest) -> Trajectories:
        self.ctx.need_store()
        buffer = self.buffer
        assert buffer is not None
        buffer.check(req.n, req.whole_groups)
        self.ctx.trainer_version = max(self.ctx.trainer_version, req.trainer_version)
        clock = self.ctx.clock
        deadline = clock.time() + req.wait_s
        while True:
            self._ready.clear()
            final = clock.time() >= deadline
            batch = await self.ctx.db(self._sample_batch, buffer, req, final)
            if self.ctx.config.max_ahead is not None and (
                buffer.filtered or (batch and batch.items)
            ):
                self._wake()  # consumption or filtering made room: waiting takes re-check
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
                async with asyncio.timeout(max(deadline - clock.time(), 0.0)):
                    await self._ready.wait()

    @staticmethod
    def _sample_batch(buffer: ExperienceBuffer, req: SampleRequest, final: bool) -> Batch | None:
        return buffer.sample(
            req.n,
            req.trainer_version,
            after=req.after,
            whole_groups=req.whole_groups,
            partial=final,
        )

    async def score_loop(self) -> None:
        """Score what ``to_score`` gets, as batches of what is waiting: up to the pool's
        ``batch_size`` (1 unless the reward is batched), never waiting for a batch to fill."""
        store, rewards, db = self.ctx.need_store(), self._rewards, self.ctx.db
        assert rewards is not None or self._episodes is not None
        limit = rewards.batch_size if rewards is not None and self._episodes is None else 1
        while True:
            tids = [await self.to_score.get()]
            while len(tids) < limit and not self.to_score.empty():
                tids.append(self.to_score.get_nowait())
            found = await db(self._to_score, store, tids)
            if not found:
                continue
            if self._episodes is not None:  # the environment's steps are the reward
                results = []
                for tid, t, record in found:
                    reward, error = await self._episodes.final_reward(
                        tid, record, list(t.response_token_ids), list(t.env_spans)
                    )
                    results.append(RewardResult(reward, error))
            else:
                assert rewards is not None
                results = await rewards.score_batch([self._item(t, rec) for _, t, rec in found])
            scored = [(tid, r) for (tid, _, _), r in zip(found, results, strict=True)]
            for tid, r in scored:
                if r.error is not None and r.error != DECLINED:  # declining is not failing
                    self.ctx.log.warning("reward failed", trajectory=tid, error=r.error)
            extras = {tid: r.extras for tid, r in scored if r.extras}
            await db(store.set_rewards, [(tid, r.reward, r.error) for tid, r in scored], extras)
            for result in results:
                if result.reward is not None:
                    self._scored = (self._scored[0] + 1, self._scored[1] + result.reward)
            self._ready.set()

    @staticmethod
    def _to_score(store: Store, tids: list[str]) -> list[tuple[str, Trajectory, dict[str, Any]]]:
        """Each trajectory still there, with the record it answers (one withdrawn meanwhile, a
        deferred prompt of tail_batching, is left out)."""
        out = []
        for tid in tids:
            try:
                out.append((tid, store.trajectory(tid), store.record_of(tid)))
            except KeyError:
                continue
        return out

    def _item(self, t: Trajectory, record: dict[str, Any]) -> RewardItem:
        text = self._tokenizer.decode(t.response_token_ids, skip_special_tokens=True)
        return RewardItem(record, text, t.response_token_ids, t.version)
