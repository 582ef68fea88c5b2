"""The ``trajectories`` table: the experience buffer.

Finished trajectories (msgpack body), their reward (NULL until scored) and its numeric extras
(``reward_extras``, JSON: a dict reward's other fields), whether the trainer consumed them and
whether eviction dropped them. ``consume_seq`` numbers consumed trajectories 1, 2, 3, ... in the
order the trainer got them (the trainer's *cursor*: after a crash it asks again from its last
committed cursor and gets the ones it had taken but not committed, in the same order). NULL
until consumed; the counter is ``MAX(consume_seq)``, so it is as durable as the rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgpack

from laminar.trajectory import Trajectory

from .base import StoreBase
from .failures import UNKNOWN, Rejection

# What a scored trajectory is read back from (``Trajectories._decode``'s arguments, in order).
SCORED = "body, reward, reward_error, reward_extras"


@dataclass(frozen=True, slots=True)
class BufferEntry:
    """What samplers and eviction policies see of a buffered trajectory (no token payload)."""

    seq: int
    trajectory_id: str
    prompt_id: str
    version: int
    n_tokens: int
    finished_at: float
    reward: float | None
    sample_index: int = 0  # position in its prompt's group (``prompt_id`` is the group)


class Trajectories(StoreBase):
    def complete(
        self, rollout: str, trajectories: Iterable[Trajectory], keep: int | None = None
    ) -> tuple[list[str], int, list[Rejection]]:
        """Record finished trajectories exactly once.

        Returns (new ids, duplicates ignored, refused and why): a trajectory this store never
        queued is refused alone; the others are stored. A completion of a sample that is done
        (generated, or failed) is a duplicate, and so is one of a cancelled sample.

        ``keep`` (redundant samples): once a prompt has ``keep`` trajectories, its samples still
        queued or leased are cancelled (:meth:`take_cancelled` hands their ids out once).
        """
        new: list[str] = []
        dupes = 0
        refused: list[Rejection] = []
        with self._transaction():
            for t in trajectories:
                row = self.db.execute(
                    "SELECT state FROM samples WHERE trajectory_id = ?", (t.trajectory_id,)
                ).fetchone()
                if row is None and self._is_cancelled(t.trajectory_id):
                    dupes += 1
                    continue
                if row is None:
                    refused.append((t.trajectory_id, UNKNOWN))
                    continue
                if row[0] == "done":
                    dupes += 1
                    continue
                body = msgpack.packb(t.model_dump(mode="json"))
                self.db.execute(
                    "INSERT INTO trajectories "
                    "(trajectory_id, prompt_id, version, n_tokens, finished_at, body) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        t.trajectory_id,
                        t.prompt_id,
                        t.version,
                        len(t.response_token_ids),
                        t.finished_at,
                        body,
                    ),
                )
                self.db.execute(
                    "UPDATE samples SET state = 'done', rollout = ? WHERE trajectory_id = ?",
                    (rollout, t.trajectory_id),
                )
                self.db.execute("DELETE FROM partials WHERE trajectory_id = ?", (t.trajectory_id,))
                new.append(t.trajectory_id)
                if keep is not None:
                    self._cancel_rest(t.prompt_id, keep)
        return new, dupes, refused

    def _is_cancelled(self, tid: str) -> bool:
        row = self.db.execute("SELECT 1 FROM cancelled WHERE trajectory_id = ?", (tid,))
        return row.fetchone() is not None

    def _cancel_rest(self, prompt_id: str, keep: int) -> None:
        """``prompt_id`` has ``keep`` trajectories: withdraw its samples not yet done."""
        (have,) = self.db.execute(
            "SELECT COUNT(*) FROM trajectories WHERE prompt_id = ?", (prompt_id,)
        ).fetchone()
        if have < keep:
            return
        rest = [
            tid
            for (tid,) in self.db.execute(
                "SELECT trajectory_id FROM samples WHERE prompt_id = ? "
                "AND state IN ('queued', 'leased', 'parked')",
                (prompt_id,),
            )
        ]
        for tid in rest:
            self.db.execute(
                "INSERT OR IGNORE INTO cancelled (trajectory_id, prompt_id) VALUES (?, ?)",
                (tid, prompt_id),
            )
            self.db.execute("DELETE FROM partials WHERE trajectory_id = ?", (tid,))
            self.db.execute("DELETE FROM samples WHERE trajectory_id = ?", (tid,))
        self.cancelled_new += rest

    def take_cancelled(self) -> list[str]:
        """The samples cancelled since the last call (their episodes can be forgotten)."""
        out, self.cancelled_new = self.cancelled_new, []
        return out

    def cancelled_count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM cancelled").fetchone()[0])

    # -- scoring -----------------------------------------------------------------------------

    def unscored(self) -> list[str]:
        return [
            r[0] for r in self.db.execute("SELECT trajectory_id FROM trajectories WHERE scored = 0")
        ]

    def set_rewards(
        self,
        results: Iterable[tuple[str, float | None, str | None]],
        extras: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        """Record (trajectory id, reward, why there is none) and, by trajectory id, the numeric
        extras of a dict reward (``Trajectory.reward_extras``)."""
        extras = extras or {}

        def row(tid: str, reward: float | None, error: str | None) -> tuple[object, ...]:
            more = extras.get(tid)
            return reward, error, json.dumps(dict(more)) if more else None, tid

        with self._transaction():
            self.db.executemany(
                "UPDATE trajectories SET reward = ?, reward_error = ?, reward_extras = ?, "
                "scored = 1 WHERE trajectory_id = ?",
                (row(*r) for r in results),
            )

    def trajectory(self, tid: str) -> Trajectory:
        row = self.db.execute(
            f"SELECT {SCORED} FROM trajectories WHERE trajectory_id = ?", (tid,)
        ).fetchone()
        if row is None:
            raise KeyError(tid)
        return self._decode(*row)

    @staticmethod
    def _decode(
        body: bytes, reward: float | None, error: str | None, extras: str | None
    ) -> Trajectory:
        t = Trajectory.model_validate(msgpack.unpackb(body))
        update = {"reward": reward, "reward_error": error}
        return t.model_copy(update={**update, "reward_extras": json.loads(extras or "{}")})

    # -- consumption -------------------------------------------------------------------------

    def ready_entries(self) -> list[BufferEntry]:
        """Scored, unconsumed, not evicted: what the trainer may sample, oldest first."""
        return [
            BufferEntry(*row)
            for row in self.db.execute(
                "SELECT t.seq, t.trajectory_id, t.prompt_id, t.version, t.n_tokens, "
                "t.finished_at, t.reward, COALESCE(s.sample_index, 0) "
                "FROM trajectories t LEFT JOIN samples s ON s.trajectory_id = t.trajectory_id "
                "WHERE t.scored = 1 AND t.consumed = 0 AND t.evicted = 0 ORDER BY t.seq"
            )
        ]

    def consume(self, tids: Sequence[str]) -> list[Trajectory]:
        return [t for _, t in self.consume_numbered(tids)]

    def consume_numbered(self, tids: Sequence[str]) -> list[tuple[int, Trajectory]]:
        """Mark ``tids`` consumed, in this order, each with the next consume seq.

        Returns (consume seq, trajectory) pairs; ids unknown or already consumed are skipped.
        """
        with self._transaction():
            out = []
            seq = self.consume_cursor()
            for tid in tids:
                row = self.db.execute(
                    f"SELECT {SCORED} FROM trajectories WHERE trajectory_id = ? AND consumed = 0",
                    (tid,),
                ).fetchone()
                if row is None:
                    continue
                seq += 1
                self.db.execute(
                    "UPDATE trajectories SET consumed = 1, consume_seq = ? WHERE trajectory_id = ?",
                    (seq, tid),
                )
                out.append((seq, self._decode(*row)))
        return out

    def consumed_after(self, after: int, limit: int) -> list[tuple[int, Trajectory]]:
        """Already consumed trajectories with consume seq > ``after``, in consume order."""
        return [
            (seq, self._decode(*scored))
            for seq, *scored in self.db.execute(
                f"SELECT consume_seq, {SCORED} FROM trajectories "
                "WHERE consume_seq > ? ORDER BY consume_seq LIMIT ?",
                (after, limit),
            )
        ]

    def consume_cursor(self) -> int:
        """The highest consume seq handed out so far (0 before the first)."""
        (cursor,) = self.db.execute(
            "SELECT COALESCE(MAX(consume_seq), 0) FROM trajectories"
        ).fetchone()
        return int(cursor)

    # -- eviction ----------------------------------------------------------------------------

    def evict(
        self,
        tids: Sequence[str],
        *,
        stale: bool = False,
        filtered: bool = False,
        orphaned: bool = False,
    ) -> None:
        """Drop ``tids`` from the buffer for good; ``stale`` counts them in ``stale_dropped``,
        ``filtered`` in ``filtered``, ``orphaned`` in ``orphaned``."""
        with self._transaction():
            dropped = 0
            for tid in tids:
                dropped += self.db.execute(
                    "UPDATE trajectories SET evicted = 1 "
                    "WHERE trajectory_id = ? AND evicted = 0 AND consumed = 0",
                    (tid,),
                ).rowcount
            if stale and dropped:
                self._set_meta("stale_dropped", self.stale_dropped() + dropped)
            if filtered and dropped:
                self._set_meta("filtered", self.filtered() + dropped)
            if orphaned and dropped:
                self._set_meta("orphaned", self.orphaned() + dropped)

    def stale_dropped(self) -> int:
        return self._meta_int("stale_dropped")

    def filtered(self) -> int:
        return self._meta_int("filtered")

    def orphaned(self) -> int:
        return self._meta_int("orphaned")

    # -- summaries ---------------------------------------------------------------------------

    def mean_reward(self) -> float | None:
        """The mean of every reward stored (from the trigger-kept totals: no scan)."""
        n, total = self.db.execute(
            "SELECT rewards, reward_sum FROM trajectory_totals WHERE id = 0"
        ).fetchone()
        return total / n if n else None

    def completed_ids(self) -> list[str]:
        return [
            r[0] for r in self.db.execute("SELECT trajectory_id FROM trajectories ORDER BY seq")
        ]

    def buffer_counts(self) -> dict[str, int]:
        """Trajectories stored, scored, consumed, evicted, without a reward, and their tokens
        (from the totals the schema's triggers keep: one row, not a scan of the table)."""
        row = self.db.execute(
            "SELECT trajectories, scored, consumed, evicted, reward_errors, tokens "
            "FROM trajectory_totals WHERE id = 0"
        ).fetchone()
        return dict(
            trajectories=row[0],
            scored=row[1],
            consumed=row[2],
            evicted=row[3],
            reward_errors=row[4],
            tokens=row[5],
        )

    def waiting_count(self) -> int:
        """Finished trajectories neither consumed nor evicted."""
        (waiting,) = self.db.execute(
            "SELECT COUNT(*) FROM trajectories WHERE consumed = 0 AND evicted = 0"
        ).fetchone()
        return int(waiting)
