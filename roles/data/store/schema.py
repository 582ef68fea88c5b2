"""The store's tables, and how a store file written by an older release is brought up to date.

Migrations are idempotent steps run on every open (there is no schema version number): each looks
at the file and changes only what it lacks, so a store from any earlier release opens, and one
already current is left alone.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

SAMPLES = """
    trajectory_id TEXT PRIMARY KEY,
    prompt_id TEXT NOT NULL,           -- dataset prompt id, + "~eN" after the first epoch
    prompt_idx INTEGER NOT NULL REFERENCES prompts (idx),
    sample_index INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'leased', 'done', 'parked')),
    seq INTEGER NOT NULL,              -- queue order (requeues go to the front)
    rollout TEXT,
    version INTEGER,                   -- the version its partial tokens were made by
    queued_at REAL NOT NULL,
    started_at REAL,
    strikes INTEGER NOT NULL DEFAULT 0, -- holders in a row that died without progress
    progress INTEGER NOT NULL DEFAULT 0 -- 1: tokens were acknowledged during the current lease
"""

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS prompts (
    idx INTEGER PRIMARY KEY,           -- position in the dataset file
    prompt_id TEXT NOT NULL UNIQUE,
    record TEXT NOT NULL,              -- the JSON record (what the reward function sees)
    token_ids BLOB NOT NULL            -- int32 little-endian
);
CREATE TABLE IF NOT EXISTS samples ({SAMPLES});
CREATE INDEX IF NOT EXISTS samples_queue ON samples (state, seq);
CREATE INDEX IF NOT EXISTS samples_rollout ON samples (rollout, state);
CREATE TABLE IF NOT EXISTS partials (
    trajectory_id TEXT NOT NULL,
    start INTEGER NOT NULL,
    stop INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,            -- float32
    env_spans TEXT,                    -- JSON [[start, end], ...]: the environment's tokens
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
    consume_seq INTEGER,               -- order of consumption (1, 2, ...); NULL until consumed
    reward_extras TEXT                 -- JSON object, name -> number: the extras of a dict reward
);
CREATE INDEX IF NOT EXISTS trajectories_ready ON trajectories (scored, consumed, evicted);
CREATE TABLE IF NOT EXISTS cancelled (  -- redundant samples whose group finished without them
    trajectory_id TEXT PRIMARY KEY,
    prompt_id TEXT NOT NULL
);
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
CREATE INDEX IF NOT EXISTS samples_queue ON samples (state, seq);
CREATE INDEX IF NOT EXISTS samples_rollout ON samples (rollout, state);
"""

# The buffer's totals, kept by triggers so that the role's status (read every heartbeat, and by
# whoever polls it) is one row instead of a scan of every trajectory ever stored: the scans grew
# with the store and were the data role's largest CPU cost in a long generation run (py-spy,
# docs/benchmarks.md). Every write to ``trajectories`` goes through a trigger, whichever code
# makes it; ``connect`` recounts the row from the table on every open, so a store written before
# the triggers (or by anything that bypassed them) opens with exact totals.
TOTALS = """
CREATE TABLE IF NOT EXISTS trajectory_totals (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    trajectories INTEGER NOT NULL, scored INTEGER NOT NULL, consumed INTEGER NOT NULL,
    evicted INTEGER NOT NULL, reward_errors INTEGER NOT NULL, tokens INTEGER NOT NULL,
    rewards INTEGER NOT NULL, reward_sum REAL NOT NULL
);
CREATE TRIGGER IF NOT EXISTS trajectory_totals_insert AFTER INSERT ON trajectories BEGIN
    UPDATE trajectory_totals SET trajectories = trajectories + 1,
        scored = scored + NEW.scored, consumed = consumed + NEW.consumed,
        evicted = evicted + NEW.evicted,
        reward_errors = reward_errors + (NEW.reward_error IS NOT NULL),
        tokens = tokens + NEW.n_tokens, rewards = rewards + (NEW.reward IS NOT NULL),
        reward_sum = reward_sum + COALESCE(NEW.reward, 0.0);
END;
CREATE TRIGGER IF NOT EXISTS trajectory_totals_delete AFTER DELETE ON trajectories BEGIN
    UPDATE trajectory_totals SET trajectories = trajectories - 1,
        scored = scored - OLD.scored, consumed = consumed - OLD.consumed,
        evicted = evicted - OLD.evicted,
        reward_errors = reward_errors - (OLD.reward_error IS NOT NULL),
        tokens = tokens - OLD.n_tokens, rewards = rewards - (OLD.reward IS NOT NULL),
        reward_sum = reward_sum - COALESCE(OLD.reward, 0.0);
END;
CREATE TRIGGER IF NOT EXISTS trajectory_totals_update AFTER UPDATE ON trajectories BEGIN
    UPDATE trajectory_totals SET
        scored = scored - OLD.scored + NEW.scored,
        consumed = consumed - OLD.consumed + NEW.consumed,
        evicted = evicted - OLD.evicted + NEW.evicted,
        reward_errors = reward_errors
            - (OLD.reward_error IS NOT NULL) + (NEW.reward_error IS NOT NULL),
        tokens = tokens - OLD.n_tokens + NEW.n_tokens,
        rewards = rewards - (OLD.reward IS NOT NULL) + (NEW.reward IS NOT NULL),
        reward_sum = reward_sum - COALESCE(OLD.reward, 0.0) + COALESCE(NEW.reward, 0.0);
END;
"""
RECOUNT_TOTALS = """
INSERT OR REPLACE INTO trajectory_totals
SELECT 0, COUNT(*), COALESCE(SUM(scored), 0), COALESCE(SUM(consumed), 0),
    COALESCE(SUM(evicted), 0), COALESCE(SUM(reward_error IS NOT NULL), 0),
    COALESCE(SUM(n_tokens), 0), COUNT(reward), COALESCE(SUM(reward), 0.0)
FROM trajectories
"""

# Columns added after the first release: (table, column, declaration) for ALTER TABLE ADD COLUMN.
MIGRATIONS = (
    ("trajectories", "consume_seq", "INTEGER"),
    ("samples", "strikes", "INTEGER NOT NULL DEFAULT 0"),
    ("samples", "progress", "INTEGER NOT NULL DEFAULT 0"),
    ("partials", "env_spans", "TEXT"),
    ("trajectories", "reward_extras", "TEXT"),
)

SAMPLE_COLUMNS = (
    "trajectory_id, prompt_id, prompt_idx, sample_index, state, seq, rollout, version, "
    "queued_at, started_at, strikes, progress"
)

# Before the ``parked`` state, a deferred sample of a round schedule was ``leased`` to this
# pseudo-rollout; such rows are read as parked (``_park_pseudo_leases``).
LEGACY_PARKED_ROLLOUT = "~deferred"

SYNCHRONOUS = ("NORMAL", "FULL")  # see the package docstring


def connect(path: Path, synchronous: str) -> sqlite3.Connection:
    """Open (creating if need be) the store file at ``path``, migrated to the current schema."""
    if synchronous not in SYNCHRONOUS:
        raise ValueError(f"synchronous must be one of {SYNCHRONOUS}, got {synchronous!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Owner-only whatever the umask (`laminar serve` has no supervisor to set one): the store
    # holds prompts and model outputs. SQLite gives its WAL and SHM files this mode.
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    os.chmod(path, 0o600)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={synchronous}")
    db.execute("PRAGMA foreign_keys=ON")
    db.executescript(SCHEMA)
    _add_columns(db)
    _allow_parked(db)
    _park_pseudo_leases(db)
    db.executescript(INDEXES)
    db.executescript(f"BEGIN IMMEDIATE; {TOTALS} {RECOUNT_TOTALS}; COMMIT;")
    return db


def _add_columns(db: sqlite3.Connection) -> None:
    """Add the columns a store written by an older release lacks (NULL in old rows)."""
    for table, column, decl in MIGRATIONS:
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def _allow_parked(db: sqlite3.Connection) -> None:
    """Rebuild an older ``samples`` table whose state check predates ``parked``.

    SQLite cannot alter a CHECK constraint, so the table is copied into one created from the
    current schema, in one transaction (its indexes are re-created by ``INDEXES``).
    """
    (sql,) = db.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'samples'"
    ).fetchone()
    if "'parked'" in sql:
        return
    with db:
        db.execute("BEGIN")
        db.execute(f"CREATE TABLE samples_new ({SAMPLES})")
        db.execute(
            f"INSERT INTO samples_new ({SAMPLE_COLUMNS}) SELECT {SAMPLE_COLUMNS} FROM samples"
        )
        db.execute("DROP TABLE samples")
        db.execute("ALTER TABLE samples_new RENAME TO samples")


def _park_pseudo_leases(db: sqlite3.Connection) -> None:
    """Samples an older release parked as leases of a pseudo-rollout are parked samples."""
    db.execute(
        "UPDATE samples SET state = 'parked', rollout = NULL "
        "WHERE state = 'leased' AND rollout = ?",
        (LEGACY_PARKED_ROLLOUT,),
    )
