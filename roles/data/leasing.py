"""The rollouts' side of the prompt pool: ``take`` (leases, long-polled), ``release`` (leases given
back unstarted) and ``transfer`` (repack).

A take queues whole groups as needed (``queue_ahead``; under a round schedule only the open
round's, see ``rounds``) and leases queued samples to the rollout: re-deliveries of leases whose
reply was lost, resumes of requeued samples at the rollout's version, then fresh ones, within
``max_ahead`` (backpressure) and, with ``async_ratio`` set, only to a rollout whose weights are at
most that many versions behind the trainer's (:func:`may_start`; resumes still go to it). With
none to give it waits, up to the request's ``wait_s``, for :meth:`Leasing.wake` (a report ended
a round, the trainer made room, a dead rollout's leases came back).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

from laminar.trajectory import Assignment, SamplingParams

from .api import Assignments, LeaseRelease, LeaseTransfer, Released, TakeRequest, Transferred
from .context import DataContext
from .store import Store

HANDOFF_GRACE_S = 60.0  # a repack handoff not arrived by then is a lost lease (re-delivered)


def may_start(trainer_version: int, rollout_version: int, async_ratio: int | None) -> bool:
    """ROLL Flash's asynchronous ratio: a rollout may start trajectories only while the trainer
    is at most ``async_ratio`` versions ahead of its weights (``None``: no bound)."""
    return async_ratio is None or trainer_version - rollout_version <= async_ratio


def trajectory_seed(seed: int, trajectory_id: str) -> int:
    """A stable 31-bit sampling seed per trajectory (the same on every rollout and every run)."""
    digest = hashlib.blake2b(f"{seed}/{trajectory_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class Leasing:
    def __init__(self, ctx: DataContext) -> None:
        self.ctx = ctx
        c = ctx.config
        self.params = SamplingParams(
            max_tokens=c.sampling.max_tokens,
            temperature=c.sampling.temperature,
            top_p=c.sampling.top_p,
            top_k=c.sampling.top_k,
            ignore_eos=c.sampling.ignore_eos,
        )
        self.episode = False  # multi-turn episodes (``use_episodes``)
        self._work = asyncio.Event()  # set when samples may have become available
        self._rollout_versions: dict[str, int] = {}  # weight version each live rollout last took at
        # Leases repack moved to a rollout whose handoff may still be on its way: its takes must
        # not re-deliver them meanwhile (rollout -> trajectory id -> deadline, clock time).
        self._handoffs: dict[str, dict[str, float]] = {}

    def use_episodes(self, stop_ids: list[int]) -> None:
        """Multi-turn episodes: turns end at ``stop_ids`` too, and assignments say so."""
        self.params = self.params.model_copy(update={"stop_token_ids": list(stop_ids)})
        self.episode = True

    def wake(self) -> None:
        """Samples may have become available: waiting takes look again."""
        self._work.set()

    def forget(self, rollout: str) -> None:
        """``rollout`` is gone: its version no longer binds resumes, its handoffs are void."""
        self._rollout_versions.pop(rollout, None)
        self._handoffs.pop(rollout, None)

    async def take(self, req: TakeRequest) -> Assignments:
        store = self.ctx.need_store()
        clock = self.ctx.clock
        deadline = clock.time() + req.wait_s
        self._rollout_versions[req.rollout] = req.version
        while True:
            self._work.clear()
            alive = set(self._rollout_versions.values())
            in_handoff = self._in_handoff(req.rollout, req.holding)
            out = await self.ctx.db(self._lease, store, req, alive, in_handoff)
            remaining = deadline - clock.time()
            if out or remaining <= 0:
                return Assignments(items=out)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._work.wait()

    def _in_handoff(self, rollout: str, holding: list[str]) -> set[str]:
        """Moved leases ``rollout`` does not hold yet but whose handoff may still arrive."""
        pending = self._handoffs.get(rollout)
        if not pending:
            return set()
        now = self.ctx.clock.time()
        for tid in [*holding, *(t for t, deadline in pending.items() if deadline < now)]:
            pending.pop(tid, None)  # arrived, or given up on: a lost lease again
        return set(pending)

    def _lease(
        self, store: Store, req: TakeRequest, alive_versions: set[int], in_handoff: set[str]
    ) -> list[Assignment]:
        c = self.ctx.config
        restarted = store.unbind_versions(alive_versions)
        if restarted:
            self.ctx.log.info(
                "restarting resumes of a version no rollout holds", count=len(restarted)
            )
        holding = set(req.holding) | in_handoff
        rounds = self.ctx.rounds
        if rounds is not None:  # a round schedule: only the open round, only its version
            out = rounds.lease(store, req.rollout, req.max_count, req.version, holding, self.params)
        else:
            group = c.samples_per_prompt + c.redundant_samples
            focus = self.ctx.focus
            admit = focus.admit if focus is not None else None
            store.refill(c.queue_ahead + req.max_count, group, c.seed, c.epochs, admit)
            fresh = None if c.max_ahead is None else max(0, c.max_ahead - store.ahead())
            start = may_start(self.ctx.trainer_version, req.version, c.async_ratio)
            out = store.lease(
                req.rollout,
                req.max_count,
                req.version,
                holding,
                self.params,
                fresh_limit=fresh,
                start_new=start,
            )
        if self.episode:
            out = [a.model_copy(update={"episode": True}) for a in out]
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

    async def release(self, req: LeaseRelease) -> Released:
        store = self.ctx.need_store()
        released = await self.ctx.db(store.give_back, req.rollout, req.trajectory_ids)
        if released:
            self.wake()  # other rollouts' takes may want them
        return Released(released=released)

    async def transfer(self, req: LeaseTransfer) -> Transferred:
        store = self.ctx.need_store()
        moved = await self.ctx.db(store.transfer, req.trajectory_ids, req.source, req.destination)
        deadline = self.ctx.clock.time() + HANDOFF_GRACE_S
        for tid in moved:
            self._handoffs.get(req.source, {}).pop(tid, None)
            self._handoffs.setdefault(req.destination, {})[tid] = deadline
        if moved:
            self.ctx.log.info(
                "leases moved", source=req.source, destination=req.destination, count=len(moved)
            )
        return Transferred(moved=moved)
