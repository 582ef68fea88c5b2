"""What every table group of the store shares: the connection, the time, the ``meta`` table."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np


def i32(values: Sequence[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def f32(values: Sequence[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def ints(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<i4").tolist()


def floats(raw: bytes) -> list[float]:
    return np.frombuffer(raw, dtype="<f4").tolist()


class StoreBase:
    """The connection and clock the table groups (mixins of ``Store``) work on.

    ``now`` gives the wall time (seconds since the epoch) stamped into rows (``queued_at``,
    ``started_at``, ``failed_at``); it is called on the store's thread, so it must not need the
    event loop. Tests inject their own.
    """

    db: sqlite3.Connection
    path: Path

    def __init__(self, db: sqlite3.Connection, path: Path, now: Callable[[], float]) -> None:
        self.db = db
        self.path = path
        self.now = now
        self.cancelled_new: list[str] = []  # redundant samples cancelled, not yet handed out

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction: committed on exit, rolled back on an exception."""
        with self.db:
            self.db.execute("BEGIN")
            yield

    # -- meta: counters and the dataset fingerprint --------------------------------------------

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def _meta_int(self, key: str, default: int = 0) -> int:
        return int(self.get_meta(key, str(default)) or default)

    def _set_meta(self, key: str, value: object) -> None:
        self.db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, str(value)),
        )
