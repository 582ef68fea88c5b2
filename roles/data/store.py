"""The data role's durable state: one SQLite database in WAL mode.

Why SQLite: the data role must survive ``kill -9`` without losing a completed trajectory or an
acknowledged partial token. Every endpoint that acknowledges something commits first. One
embedded file, no server to run, and the whole state is inspectable with the ``sqlite3`` shell.

What survives what depends on ``synchronous`` (the data role's ``store_synchronous``):

* ``NORMAL`` (the default): a commit is written to the WAL file but not fsynced. It survives the
  data role being killed (``kill -9``, a crash, an OOM kill): the bytes are in the OS's page cache
  and reach the disk without the process. An OS crash or power loss can drop the transactions
  committed since the last checkpoint (the database stays consistent, never corrupt): trajectories
  a rollout was told were stored are gone, and the trainer's cursor may point past them.
* ``FULL``: every commit is fsynced before it is acknowledged, so it also survives an OS crash or
  power loss (on a disk that honours fsync). The price is one fsync per report, take and sample:
  milliseconds each on an SSD, more on network storage.

Tables:

* ``prompts`` — the dataset, loaded once (prompt id, the JSON record, its token ids).
* ``samples`` — one row per trajectory to generate: ``queued`` -> ``leased`` (to a rollout) ->
  ``done``. A lease returns to ``queued`` when its rollout dies; the partial tokens stay, so the
  next rollout of the same version resumes instead of restarting. ``strikes`` counts the
  rollouts in a row that died holding it without a token of it acknowledged (``progress``
  during their lease; see ``failures``).
* ``failures`` — samples that are ``done`` without a trajectory: refused by an engine, an invalid
  completion, or quarantined after killing rollouts (``failures``). Never handed out again.
* ``partials`` — acknowledged in-flight tokens, as chunks keyed by (trajectory, start offset).
* ``trajectories`` — the experience buffer: finished trajectories (msgpack body), their reward
  (NULL until scored), whether the trainer consumed them and whether eviction dropped them.
  ``consume_seq`` numbers consumed trajectories 1, 2, 3, ... in the order the trainer got them
  (the trainer's *cursor*: after a crash it asks again from its last committed cursor and gets the
  ones it had taken but not committed, in the same order). NULL until consumed; the counter is
  ``MAX(consume_seq)``, so it is as durable as the rows.
* ``meta`` — counters: the prompt cursor and epoch, the next queue sequence number, how many
  trajectories were dropped for staleness (``stale_dropped``) and as uninformative groups
  (``filtered``).

This class is synchronous and not thread-safe: the data service runs every call on one thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from laminar.trajectory import Assignment, PartialChunk, SamplingParams, Trajectory

from .failures import UNKNOWN, FailureLedger, Rejection

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS prompts (
    idx INTEGER PRIMARY KEY,           -- position in the dataset file
    prompt_id TEXT NOT NULL UNIQUE,
    record TEXT NOT NULL,              -- the JSON record (what the reward function sees)
    token_ids BLOB NOT NULL            -- int32 little-endian
);
CREATE TABLE IF NOT EXISTS samples (
    trajectory_id TEXT PRIMARY KEY,
    prompt_id TEXT NOT NULL,           -- dataset prompt id, + "~eN" after the first epoch
    prompt_idx INTEGER NOT NULL REFERENCES prompts (idx),
    sample_index INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'leased', 'done')),
    seq INTEGER NOT NULL,              -- queue order (requeues go to the front)
    rollout TEXT,
    version INTEGER,                   -- the version its partial tokens were made by
    queued_at REAL NOT NULL,
    started_at REAL,
    strikes INTEGER NOT NULL DEFAULT 0, -- holders in a row that died without progress
    progress INTEGER NOT NULL DEFAULT 0 -- 1: tokens were acknowledged during the current lease
);
CREATE INDEX IF NOT EXISTS samples_queue ON samples (state, seq);
CREATE INDEX IF NOT EXISTS samples_rollout ON samples (rollout, state);
CREATE TABLE IF NOT EXISTS partials (
    trajectory_id TEXT NOT NULL,
    start INTEGER NOT NULL,
    stop INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,            -- float32
    PRIMARY KEY (trajectory_id, start)
);
CREATE TABLE IF NOT EXISTS trajectories (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    trajectory_id TEXT NOT NULL UNIQUE,
    prompt_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    finished_at REAL NOT NULL,
    reward REAL,
    reward_error TEXT,
    scored INTEGER NOT NULL DEFAULT 0,
    consumed INTEGER NOT NULL DEFAULT 0,
    evicted INTEGER NOT NULL DEFAULT 0,
    body BLOB NOT NULL,                -- msgpack of the Trajectory as generated
    consume_seq INTEGER                -- order of consumption (1, 2, ...); NULL until consumed
);
CREATE INDEX IF NOT EXISTS trajectories_ready ON trajectories (scored, consumed, evicted);
CREATE TABLE IF NOT EXISTS failures (
    trajectory_id TEXT PRIMARY KEY,
    prompt_id TEXT NOT NULL,           -- its group: the group can never be whole
    kind TEXT NOT NULL,                -- refused / invalid / quarantined
    reason TEXT NOT NULL,
    rollout TEXT,
    failed_at REAL NOT NULL
);
"""

# Run after the columns added since the first release exist (older stores are migrated first).
INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS trajectories_consume_seq ON trajectories (consume_seq);
"""

# Columns added after the first release: (table, column, declaration) for ALTER TABLE ADD COLUMN.
MIGRATIONS = (
    ("trajectories", "consume_seq", "INTEGER"),
    ("samples", "strikes", "INTEGER NOT NULL DEFAULT 0"),
    ("samples", "progress", "INTEGER NOT NULL DEFAULT 0"),
)

SYNCHRONOUS = ("NORMAL", "FULL")  # see the module docstring


def _i32(values: Sequence[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def _f32(values: Sequence[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


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


class Store(FailureLedger):
    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL") -> None:
        if synchronous not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS}, got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Owner-only whatever the umask (`laminar serve` has no supervisor to set one): the
        # store holds prompts and model outputs. SQLite gives its WAL and SHM files this mode.
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(self.path, 0o600)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={synchronous}")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self._migrate()
        self.db.executescript(INDEXES)

    def _migrate(self) -> None:
        """Add the columns a store written by an older release lacks (NULL in old rows)."""
        for table, column, decl in MIGRATIONS:
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def close(self) -> None:
        self.db.close()

    # -- meta --------------------------------------------------------------------------------

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def _set_meta(self, key: str, value: object) -> None:
        self.db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, str(value)),
        )

    # -- prompts -----------------------------------------------------------------------------

    def prompt_count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM prompts").fetchone()[0])

    def load_prompts(
        self, rows: Iterable[tuple[str, dict[str, object], list[int]]], fingerprint: str
    ) -> None:
        """Store the dataset once; refuse a different dataset for an existing store."""
        known = self.get_meta("dataset")
        if known is not None:
            if known != fingerprint:
                raise ValueError(
                    f"{self.path} holds a run over another dataset ({known}, now {fingerprint}); "
                    "use a new store path to start a new run"
                )
            return
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT INTO prompts (idx, prompt_id, record, token_ids) VALUES (?, ?, ?, ?)",
                (
                    (i, pid, json.dumps(record), _i32(ids))
                    for i, (pid, record, ids) in enumerate(rows)
                ),
            )
            self._set_meta("dataset", fingerprint)

    def record_of(self, trajectory_id: str) -> dict[str, object]:
        """The dataset record a trajectory answers (what the reward function sees)."""
        row = self.db.execute(
            "SELECT p.record FROM samples s JOIN prompts p ON p.idx = s.prompt_idx "
            "WHERE s.trajectory_id = ?",
            (trajectory_id,),
        ).fetchone()
        if row is None:
            raise KeyError(trajectory_id)
        return json.loads(row[0])

    # -- the queue ---------------------------------------------------------------------------

    def refill(self, min_queued: int, samples: int, seed: int, epochs: int | None) -> int:
        """Queue whole groups (``samples`` per prompt) until ``min_queued`` are queued.

        Prompts are drawn in a seeded permutation per epoch, so the order is reproducible and a
        restart continues where the cursor stopped. Returns how many samples were added.
        """
        n_prompts = self.prompt_count()
        added = 0
        with self.db:
            self.db.execute("BEGIN")
            queued = self.queued_count()
            epoch = int(self.get_meta("epoch", "0") or 0)
            pos = int(self.get_meta("cursor", "0") or 0)
            seq = int(self.get_meta("next_seq", "1") or 1)
            now = time.time()
            rows = []
            order = np.random.default_rng([seed, epoch]).permutation(n_prompts)
            while queued + added < min_queued and n_prompts:
                if pos >= n_prompts:
                    epoch, pos = epoch + 1, 0
                    order = np.random.default_rng([seed, epoch]).permutation(n_prompts)
                if epochs is not None and epoch >= epochs:
                    break
                idx = int(order[pos])
                pos += 1
                (prompt_id,) = self.db.execute(
                    "SELECT prompt_id FROM prompts WHERE idx = ?", (idx,)
                ).fetchone()
                pid = prompt_id if epoch == 0 else f"{prompt_id}~e{epoch}"
                for k in range(samples):
                    rows.append((f"{pid}/{k}", pid, idx, k, seq, now))
                    seq += 1
                added += samples
            self.db.executemany(
                "INSERT INTO samples "
                "(trajectory_id, prompt_id, prompt_idx, sample_index, state, seq, queued_at) "
                "VALUES (?, ?, ?, ?, 'queued', ?, ?)",
                rows,
            )
            self._set_meta("epoch", epoch)
            self._set_meta("cursor", pos)
            self._set_meta("next_seq", seq)
        return added

    def exhausted(self, epochs: int | None) -> bool:
        """Every epoch's prompts have been queued (nothing more will be added)."""
        if epochs is None:
            return False
        epoch = int(self.get_meta("epoch", "0") or 0)
        pos = int(self.get_meta("cursor", "0") or 0)
        return epoch >= epochs or (epoch == epochs - 1 and pos >= self.prompt_count())

    def queued_count(self) -> int:
        return int(
            self.db.execute("SELECT COUNT(*) FROM samples WHERE state = 'queued'").fetchone()[0]
        )

    def lease(
        self,
        rollout: str,
        count: int,
        version: int,
        holding: set[str],
        params: SamplingParams,
        fresh_limit: int | None = None,
    ) -> list[Assignment]:
        """Up to ``count`` assignments for ``rollout``: re-deliveries, resumes, then fresh ones.

        Re-deliveries are samples already leased to this rollout that it does not hold (the reply
        of an earlier lease was lost). Resumes are requeued samples with partial tokens of
        ``version``; samples with partials of another version are left for a matching rollout.
        ``fresh_limit`` caps the samples newly leased (backpressure); re-deliveries are already
        leased, so they are never held back. A *suspect* (strikes > 0: a rollout died holding it)
        goes only to a rollout that holds no other suspect still without progress, so that if it
        is what kills rollouts, it does not take other suspects down with it again
        (``failures``).
        """
        out: list[Assignment] = []
        now = time.time()
        leased = self.db.execute(
            "SELECT trajectory_id, version FROM samples WHERE rollout = ? AND state = 'leased'",
            (rollout,),
        ).fetchall()
        missing = [(tid, v) for (tid, v) in leased if tid not in holding]
        # A lost lease leased at another version than the rollout holds now (it loaded weights
        # since) cannot continue there: its engine would refuse the resume. It goes back to the
        # queue, bound to its version, for a rollout that holds it (or a restart from scratch).
        stale = [tid for tid, v in missing if v is not None and v != version]
        lost = [tid for tid, v in missing if v is None or v == version][:count]
        with self.db:
            self.db.execute("BEGIN")
            if stale:
                self._requeue(stale)
            for tid in lost:
                out.append(self._assignment(tid))
            want = count - len(out)
            if fresh_limit is not None:
                want = min(want, fresh_limit)
            for tid in self._leasable(rollout, version, want):
                self.db.execute(
                    "UPDATE samples SET state = 'leased', rollout = ?, version = ?, progress = 0, "
                    "started_at = COALESCE(started_at, ?) WHERE trajectory_id = ?",
                    (rollout, version, now, tid),
                )
                out.append(self._assignment(tid))
        return [a.model_copy(update={"params": params}) for a in out]

    def _leasable(self, rollout: str, version: int, want: int) -> list[str]:
        """Up to ``want`` queued samples for ``rollout``, in queue order, at most one suspect."""
        if want <= 0:
            return []
        match = "state = 'queued' AND (version IS NULL OR version = ?)"
        rows = self.db.execute(
            f"SELECT seq, trajectory_id FROM samples WHERE {match} AND strikes = 0 "
            "ORDER BY seq LIMIT ?",
            (version, want),
        ).fetchall()
        holds_suspect = self.db.execute(
            "SELECT 1 FROM samples WHERE rollout = ? AND state = 'leased' AND strikes > 0 "
            "AND progress = 0 LIMIT 1",
            (rollout,),
        ).fetchone()
        if holds_suspect is None:
            rows += self.db.execute(
                f"SELECT seq, trajectory_id FROM samples WHERE {match} AND strikes > 0 "
                "ORDER BY seq LIMIT 1",
                (version,),
            ).fetchall()
        return [tid for _, tid in sorted(rows)[:want]]

    def _assignment(self, tid: str) -> Assignment:
        prompt_id, idx, k, version, queued_at, started_at = self.db.execute(
            "SELECT prompt_id, prompt_idx, sample_index, version, queued_at, started_at "
            "FROM samples WHERE trajectory_id = ?",
            (tid,),
        ).fetchone()
        (raw,) = self.db.execute("SELECT token_ids FROM prompts WHERE idx = ?", (idx,)).fetchone()
        ids = np.frombuffer(raw, dtype="<i4").tolist()
        tokens, logprobs = self.partial(tid)
        return Assignment(
            trajectory_id=tid,
            prompt_id=prompt_id,
            sample_index=k,
            prompt_token_ids=ids,
            params=SamplingParams(),
            queued_at=queued_at,
            version=version,
            resume_token_ids=tokens,
            resume_logprobs=logprobs,
            started_at=started_at,
        )

    def release(self, rollout: str) -> list[str]:
        """Return a dead rollout's leases to the front of the queue (partials kept)."""
        tids = self._leased_to(rollout)
        if tids:
            with self.db:
                self.db.execute("BEGIN")
                self._requeue(tids)
        return tids

    def _leased_to(self, rollout: str) -> list[str]:
        return [
            tid
            for (tid,) in self.db.execute(
                "SELECT trajectory_id FROM samples WHERE rollout = ? AND state = 'leased' "
                "ORDER BY seq",
                (rollout,),
            )
        ]

    def _requeue(self, tids: list[str]) -> None:
        """Leased samples back to the front of the queue, in order (inside a transaction)."""
        front = int(self.db.execute("SELECT COALESCE(MIN(seq), 0) FROM samples").fetchone()[0])
        for i, tid in enumerate(tids):
            has_partial = self.db.execute(
                "SELECT 1 FROM partials WHERE trajectory_id = ? LIMIT 1", (tid,)
            ).fetchone()
            self.db.execute(
                "UPDATE samples SET state = 'queued', rollout = NULL, seq = ?, "
                "version = CASE WHEN ? THEN version ELSE NULL END WHERE trajectory_id = ?",
                (front - len(tids) + i, has_partial is not None, tid),
            )

    def unbind_versions(self, alive: set[int]) -> list[str]:
        """Restart queued resumes whose version no live rollout holds any more.

        Their partial tokens can only continue on that exact version; once every rollout moved on
        they would wait forever, so they start over (fresh lease, any version).
        """
        rows = self.db.execute(
            "SELECT trajectory_id, version FROM samples "
            "WHERE state = 'queued' AND version IS NOT NULL"
        ).fetchall()
        stale = [tid for tid, version in rows if version not in alive]
        if stale:
            with self.db:
                self.db.execute("BEGIN")
                for tid in stale:
                    self.db.execute("DELETE FROM partials WHERE trajectory_id = ?", (tid,))
                    self.db.execute(
                        "UPDATE samples SET version = NULL WHERE trajectory_id = ?", (tid,)
                    )
        return stale

    def transfer(self, tids: Iterable[str], source: str, destination: str) -> list[str]:
        """Move leases of ``source`` to ``destination`` (repack); returns the ids now there."""
        moved = []
        with self.db:
            self.db.execute("BEGIN")
            for tid in tids:
                row = self.db.execute(
                    "SELECT state, rollout FROM samples WHERE trajectory_id = ?", (tid,)
                ).fetchone()
                if row is None or row[0] != "leased" or row[1] not in (source, destination):
                    continue
                self.db.execute(
                    "UPDATE samples SET rollout = ? WHERE trajectory_id = ?", (destination, tid)
                )
                moved.append(tid)
        return moved

    def leases(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for tid, rollout in self.db.execute(
            "SELECT trajectory_id, rollout FROM samples WHERE state = 'leased'"
        ):
            out.setdefault(rollout, []).append(tid)
        return out

    # -- partial tokens ----------------------------------------------------------------------

    def append_partials(
        self, rollout: str, chunks: Iterable[PartialChunk]
    ) -> tuple[list[str], list[Rejection]]:
        """Store new tokens; returns (ids the rollout should drop, chunks refused and why).

        Drop: not leased to it any more. Refused: a chunk that would leave a gap (the rollout
        drops that trajectory; its next ``take`` gets it back from the stored tokens). The other
        chunks are stored either way. Idempotent: a chunk that overlaps what is stored keeps only
        its new suffix. Stored tokens are progress of the current lease (``failures``).
        """
        drop: list[str] = []
        refused: list[Rejection] = []
        with self.db:
            self.db.execute("BEGIN")
            for c in chunks:
                row = self.db.execute(
                    "SELECT state, rollout FROM samples WHERE trajectory_id = ?",
                    (c.trajectory_id,),
                ).fetchone()
                if row is None or row[0] != "leased" or row[1] != rollout:
                    drop.append(c.trajectory_id)
                    continue
                end = self._partial_end(c.trajectory_id)
                if c.offset > end:
                    refused.append(
                        (
                            c.trajectory_id,
                            f"chunk starts at token {c.offset} but only {end} are stored (a gap)",
                        )
                    )
                    continue
                skip = end - c.offset
                if skip >= len(c.token_ids):
                    continue
                self.db.execute(
                    "UPDATE samples SET progress = 1 WHERE trajectory_id = ? AND progress = 0",
                    (c.trajectory_id,),
                )
                self.db.execute(
                    "INSERT INTO partials (trajectory_id, start, stop, token_ids, logprobs) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (
                        c.trajectory_id,
                        end,
                        c.offset + len(c.token_ids),
                        _i32(c.token_ids[skip:]),
                        _f32(c.logprobs[skip:]),
                    ),
                )
        return drop, refused

    def _partial_end(self, tid: str) -> int:
        return int(
            self.db.execute(
                "SELECT COALESCE(MAX(stop), 0) FROM partials WHERE trajectory_id = ?", (tid,)
            ).fetchone()[0]
        )

    def partial(self, tid: str) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        logprobs: list[float] = []
        for ids, lps in self.db.execute(
            "SELECT token_ids, logprobs FROM partials WHERE trajectory_id = ? ORDER BY start",
            (tid,),
        ):
            tokens += np.frombuffer(ids, dtype="<i4").tolist()
            logprobs += np.frombuffer(lps, dtype="<f4").tolist()
        return tokens, logprobs

    def partial_lengths(self) -> dict[str, int]:
        return dict(
            self.db.execute("SELECT trajectory_id, MAX(stop) FROM partials GROUP BY trajectory_id")
        )

    # -- completion and the experience buffer -------------------------------------------------

    def complete(
        self, rollout: str, trajectories: Iterable[Trajectory]
    ) -> tuple[list[str], int, list[Rejection]]:
        """Record finished trajectories exactly once.

        Returns (new ids, duplicates ignored, refused and why): a trajectory this store never
        queued is refused alone; the others are stored. A completion of a sample that is done
        (generated, or failed) is a duplicate.
        """
        new: list[str] = []
        dupes = 0
        refused: list[Rejection] = []
        with self.db:
            self.db.execute("BEGIN")
            for t in trajectories:
                row = self.db.execute(
                    "SELECT state FROM samples WHERE trajectory_id = ?", (t.trajectory_id,)
                ).fetchone()
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
        return new, dupes, refused

    def unscored(self) -> list[str]:
        return [
            r[0] for r in self.db.execute("SELECT trajectory_id FROM trajectories WHERE scored = 0")
        ]

    def set_rewards(self, results: Iterable[tuple[str, float | None, str | None]]) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "UPDATE trajectories SET reward = ?, reward_error = ?, scored = 1 "
                "WHERE trajectory_id = ?",
                ((reward, error, tid) for tid, reward, error in results),
            )

    def trajectory(self, tid: str) -> Trajectory:
        row = self.db.execute(
            "SELECT body, reward, reward_error FROM trajectories WHERE trajectory_id = ?", (tid,)
        ).fetchone()
        if row is None:
            raise KeyError(tid)
        return self._decode(*row)

    @staticmethod
    def _decode(body: bytes, reward: float | None, error: str | None) -> Trajectory:
        t = Trajectory.model_validate(msgpack.unpackb(body))
        return t.model_copy(update={"reward": reward, "reward_error": error})

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
        with self.db:
            self.db.execute("BEGIN")
            out = []
            seq = self.consume_cursor()
            for tid in tids:
                row = self.db.execute(
                    "SELECT body, reward, reward_error FROM trajectories "
                    "WHERE trajectory_id = ? AND consumed = 0",
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
            (seq, self._decode(body, reward, error))
            for seq, body, reward, error in self.db.execute(
                "SELECT consume_seq, body, reward, reward_error FROM trajectories "
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
        with self.db:
            self.db.execute("BEGIN")
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
                self._set_meta("orphaned", int(self.get_meta("orphaned", "0") or 0) + dropped)

    def stale_dropped(self) -> int:
        return int(self.get_meta("stale_dropped", "0") or 0)

    def filtered(self) -> int:
        return int(self.get_meta("filtered", "0") or 0)

    def mean_reward(self) -> float | None:
        (mean,) = self.db.execute(
            "SELECT AVG(reward) FROM trajectories WHERE reward IS NOT NULL"
        ).fetchone()
        return mean

    def completed_ids(self) -> list[str]:
        return [
            r[0] for r in self.db.execute("SELECT trajectory_id FROM trajectories ORDER BY seq")
        ]

    def ahead(self) -> int:
        """Trajectories leased (in generation) or finished and not yet consumed nor evicted."""
        (leased,) = self.db.execute(
            "SELECT COUNT(*) FROM samples WHERE state = 'leased'"
        ).fetchone()
        (waiting,) = self.db.execute(
            "SELECT COUNT(*) FROM trajectories WHERE consumed = 0 AND evicted = 0"
        ).fetchone()
        return int(leased) + int(waiting)

    def counts(self) -> dict[str, int]:
        out = {"queued": 0, "leased": 0, "done": 0}
        for state, n in self.db.execute("SELECT state, COUNT(*) FROM samples GROUP BY state"):
            out[state] = n
        row = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(scored), 0), COALESCE(SUM(consumed), 0), "
            "COALESCE(SUM(evicted), 0), COALESCE(SUM(reward_error IS NOT NULL), 0), "
            "COALESCE(SUM(n_tokens), 0) FROM trajectories"
        ).fetchone()
        out.update(
            trajectories=row[0],
            scored=row[1],
            consumed=row[2],
            evicted=row[3],
            reward_errors=row[4],
            tokens=row[5],
        )
        out["stale_dropped"] = self.stale_dropped()
        out["filtered"] = self.filtered()
        out.update(self.failure_counts())
        out["done"] -= out["failed"]  # done = generated; failed ones are counted apart
        out["orphaned"] = int(self.get_meta("orphaned", "0") or 0)
        out["cursor"] = self.consume_cursor()
        out["partial_tokens"] = int(
            self.db.execute("SELECT COALESCE(SUM(stop - start), 0) FROM partials").fetchone()[0]
        )
        return out
