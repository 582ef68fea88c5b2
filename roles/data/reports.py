"""The acknowledgement path: a rollout's ``report`` of new tokens, finished and failed samples.

A report is stored item by item (``api``): new tokens go to the partial-response pool, finished
trajectories to the experience buffer exactly once (their partials dropped), and failures are
recorded for good (``store.failures``). A bad item (a gap, an unknown trajectory, a non-finite
logprob) is refused alone and named in the reply; the rest is stored. The reply follows the
commit, so an acknowledged item survives the data role being killed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Literal

from prometheus_client import CollectorRegistry, Counter

from laminar.trajectory import Trajectory

from .api import RejectedItem, Report, ReportReply
from .context import DataContext
from .store import Rejection, Store


def invalid(t: Trajectory) -> str | None:
    """Why a completion cannot be trained on (None: it can)."""
    bad = next((i for i, lp in enumerate(t.logprobs) if not math.isfinite(lp)), None)
    if bad is not None:
        return f"behaviour logprob of response token {bad} is {t.logprobs[bad]}"
    return None


class Reports:
    """Stores reports; new trajectories go to ``to_score``, ``wake`` tells waiting takes."""

    def __init__(
        self,
        ctx: DataContext,
        registry: CollectorRegistry,
        to_score: asyncio.Queue[str],
        wake: Callable[[], None],
        on_cancel: Callable[[list[str]], None] = lambda ids: None,
    ) -> None:
        self.ctx = ctx
        self._on_cancel = on_cancel  # redundant samples withdrawn (their episodes are forgotten)
        self._to_score = to_score
        self._wake = wake
        self._m_rejected = Counter(
            "laminar_data_report_items_rejected",
            "Report items refused (the rest of their report was stored), by item",
            ["item"],
            registry=registry,
        )

    async def report(self, req: Report) -> ReportReply:
        """Store what a report carries, item by item (``api``: a bad item is refused alone)."""
        store = self.ctx.need_store()
        db = self.ctx.db
        reply = ReportReply()
        if req.partials:
            reply.drop, refused = await db(store.append_partials, req.rollout, req.partials)
            self._refuse_items(reply, req.rollout, "partial", refused)
        failed = [(f.trajectory_id, f.reason) for f in req.failed]
        bad = [(t.trajectory_id, why) for t in req.completed if (why := invalid(t))]
        if failed or bad:
            refused = await db(self._fail, store, req.rollout, failed, bad)
            self._refuse_items(reply, req.rollout, "failed", refused)
        bad_ids = {tid for tid, _ in bad}
        completed = [t for t in req.completed if t.trajectory_id not in bad_ids]
        self._refuse_items(reply, req.rollout, "completed", bad)
        if completed:
            new, reply.duplicates, refused = await db(self._complete, store, req.rollout, completed)
            self._refuse_items(reply, req.rollout, "completed", refused)
            for tid in new:
                self._to_score.put_nowait(tid)
            if self.ctx.config.redundant_samples:
                cancelled = await db(store.take_cancelled)
                if cancelled:
                    self.ctx.log.info("redundant samples cancelled", count=len(cancelled))
                    self._on_cancel(cancelled)
        if self.ctx.rounds is not None and not self.ctx.rounds.open:
            self._wake()  # a round ended: waiting takes re-check for the next one
        return reply

    def _refuse_items(
        self,
        reply: ReportReply,
        rollout: str,
        item: Literal["partial", "completed", "failed"],
        refused: list[Rejection],
    ) -> None:
        for tid, reason in refused:
            self.ctx.log.warning("report item refused", rollout=rollout, item=item,
                                 trajectory=tid, reason=reason)  # fmt: skip
            reply.rejected.append(RejectedItem(trajectory_id=tid, item=item, reason=reason))
            self._m_rejected.labels(item).inc()

    def _fail(
        self, store: Store, rollout: str, failed: list[Rejection], bad: list[Rejection]
    ) -> list[Rejection]:
        """Record failures (the engine's refusals, invalid completions); returns refused ones."""
        recorded, refused = store.fail(rollout, failed, "refused")
        recorded += store.fail(rollout, bad, "invalid")[0]  # unknown ones: refused later
        for tid, reason in [*failed, *bad]:
            if tid in recorded:
                self.ctx.log.error(
                    "trajectory failed", trajectory=tid, rollout=rollout, reason=reason
                )
        if recorded and self.ctx.rounds is not None:
            self.ctx.rounds.note_failed(store, recorded)
        return refused

    def _complete(
        self, store: Store, rollout: str, completed: list[Trajectory]
    ) -> tuple[list[str], int, list[Rejection]]:
        rounds = self.ctx.rounds
        if rounds is None:
            c = self.ctx.config
            keep = c.samples_per_prompt if c.redundant_samples else None
            return store.complete(rollout, completed, keep)
        # round schedules: completions of deferred samples are ignored; a round may end here
        new, dupes, refused = store.complete(rollout, rounds.filter_completed(store, completed))
        rounds.note_completed(store, new)
        return new, dupes, refused
