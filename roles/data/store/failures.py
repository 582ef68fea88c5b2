"""Failed trajectories, recorded for good: one bad input fails alone.

Why: a trajectory that cannot be generated (its prompt does not fit the model's context, holds
token ids outside its vocabulary, or kills every rollout that takes it) must not be handed out
again and again. Before this, a lease whose rollout died went back to the front of the queue; a
prompt that crashed its rollout was taken by the next one, which crashed too, until the
supervisor gave up on every rollout and training stopped.

A sample fails in one of three ways (``failures.kind``):

* ``refused`` — its rollout's engine refused the request and the rollout said so
  (``Report.failed``): the engine and the rollout go on.
* ``invalid`` — the data role refused its completion (a non-finite behaviour logprob).
* ``quarantined`` — ``quarantine_after`` rollouts in a row died while holding it, none of them
  with a token of it acknowledged during its lease (whatever killed them, the engine did not
  catch it). Each death is a *strike* on every lease the dead rollout held without progress; a
  lease that made progress starts over at no strikes (it ran, so it is probably not what
  killed). A positional crasher (one that kills at its n-th token) still converges: each holder
  resumes from the tokens acknowledged before, so soon the holders die before acknowledging
  any. This spares the innocent leases of a rollout killed for another reason (they had
  progress). A *suspect* (strikes > 0) is leased to a rollout only while that rollout holds no
  other suspect without progress (``Store.lease``): the innocents that died beside a poison
  before their first token are spread out, so the poison's next victim takes none of them along
  and only the poison gets its next strike.

A failed sample is ``done`` with a row here instead of a trajectory: never queued, leased or
resumed again, and a late completion of it is a duplicate. Its group can never be whole, so with
whole-group sampling the group's other members are evicted when they reach the buffer (counted
as ``orphaned``) rather than waiting there forever. Failures are counted (``failed``,
``quarantined`` in the data role's status, stats and metrics) and logged with their reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .base import StoreBase

FailureKind = str  # "refused" | "invalid" | "quarantined"
Rejection = tuple[str, str]  # (trajectory id, why it was refused)
UNKNOWN = "unknown trajectory: this data role never queued it"


class FailureLedger(StoreBase):
    """The ``failures`` table's side of :class:`~laminar.roles.data.store.Store` (a mixin)."""

    if TYPE_CHECKING:  # from ``Queue`` (the other mixins of ``Store``)

        def _leased_to(self, rollout: str) -> list[str]: ...

        def _requeue(self, tids: list[str]) -> None: ...

    def fail(
        self, rollout: str, items: Iterable[Rejection], kind: FailureKind
    ) -> tuple[list[str], list[Rejection]]:
        """Record samples ``rollout`` holds as failed: returns (recorded ids, refused and why).

        A sample this store never queued is refused. One that is done already, or not leased to
        ``rollout`` (reassigned meanwhile: its new holder decides), is left alone.
        """
        recorded: list[str] = []
        refused: list[Rejection] = []
        with self._transaction():
            for tid, reason in items:
                row = self.db.execute(
                    "SELECT state, rollout FROM samples WHERE trajectory_id = ?", (tid,)
                ).fetchone()
                if row is None:
                    refused.append((tid, UNKNOWN))
                elif row[0] == "leased" and row[1] == rollout:
                    self._record_failure(tid, kind, reason, rollout)
                    recorded.append(tid)
        return recorded, refused

    def release_dead(
        self, rollout: str, quarantine_after: int
    ) -> tuple[list[str], list[Rejection]]:
        """Like :meth:`release`, for a rollout that died: each lease it held without progress
        gets a strike (one with progress starts over at none), and one with ``quarantine_after``
        strikes is recorded as failed instead (``failures``).

        Returns (requeued ids, quarantined ids with the reason recorded).
        """
        tids = self._leased_to(rollout)
        if not tids:
            return [], []
        quarantined: list[Rejection] = []
        with self._transaction():
            for tid in tids:
                self.db.execute(
                    "UPDATE samples SET strikes = CASE WHEN progress THEN 0 ELSE strikes + 1 END "
                    "WHERE trajectory_id = ?",
                    (tid,),
                )
                (strikes,) = self.db.execute(
                    "SELECT strikes FROM samples WHERE trajectory_id = ?", (tid,)
                ).fetchone()
                if strikes >= quarantine_after:
                    why = (f"quarantined: {strikes} rollouts in a row died holding it, with no "
                           f"token acknowledged in between (the last: {rollout})")  # fmt: skip
                    self._record_failure(tid, "quarantined", why, rollout)
                    quarantined.append((tid, why))
            gone = {tid for tid, _ in quarantined}
            requeued = [tid for tid in tids if tid not in gone]
            self._requeue(requeued)
        return requeued, quarantined

    def _record_failure(self, tid: str, kind: FailureKind, reason: str, rollout: str) -> None:
        """Mark ``tid`` failed for good (inside the caller's transaction)."""
        self.db.execute(
            "INSERT OR IGNORE INTO failures "
            "(trajectory_id, prompt_id, kind, reason, rollout, failed_at) "
            "SELECT trajectory_id, prompt_id, ?, ?, ?, ? FROM samples WHERE trajectory_id = ?",
            (kind, reason, rollout, self.now(), tid),
        )
        self.db.execute(
            "UPDATE samples SET state = 'done', rollout = ? WHERE trajectory_id = ?", (rollout, tid)
        )
        self.db.execute("DELETE FROM partials WHERE trajectory_id = ?", (tid,))

    def failed_per_group(self) -> dict[str, int]:
        """Groups (prompt ids, an epoch's repeat apart) with failed members: how many failed."""
        rows = self.db.execute("SELECT prompt_id, COUNT(*) FROM failures GROUP BY prompt_id")
        return {pid: int(n) for pid, n in rows}

    def failures(self) -> list[tuple[str, str, str]]:
        """Every failed sample as (trajectory id, kind, reason), in the order they failed."""
        return [
            (tid, kind, reason)
            for tid, kind, reason in self.db.execute(
                "SELECT trajectory_id, kind, reason FROM failures ORDER BY failed_at, rowid"
            )
        ]

    def failure_counts(self) -> dict[str, int]:
        failed, quarantined = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(kind = 'quarantined'), 0) FROM failures"
        ).fetchone()
        return {"failed": int(failed), "quarantined": int(quarantined)}
