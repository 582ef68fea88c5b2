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

Tables, one module per group (:class:`Store` puts them together; every SQL statement of the data
role is in this package):

* ``queue`` — ``prompts``, the dataset, loaded once (prompt id, the JSON record, its token ids);
  ``samples``, one row per trajectory to generate: ``queued`` -> ``leased`` (to a rollout) ->
  ``done``. A lease returns to ``queued`` when its rollout dies; the partial tokens stay, so the
  next rollout of the same version resumes instead of restarting. ``strikes`` counts the
  rollouts in a row that died holding it without a token of it acknowledged (``progress``
  during their lease; see ``failures``).
* ``parking`` — the ``parked`` samples of groups a round schedule deferred.
* ``failures`` — samples that are ``done`` without a trajectory: refused by an engine, an invalid
  completion, or quarantined after killing rollouts. Never handed out again.
* ``partials`` — acknowledged in-flight tokens, as chunks keyed by (trajectory, start offset).
* ``trajectories`` — the experience buffer: finished trajectories, their reward (and its
  extras), whether the trainer consumed them (in ``consume_seq`` order) and whether eviction
  dropped them.
* ``base`` — ``meta``: counters: the prompt cursor and epoch, the next queue sequence number, how
  many trajectories were dropped for staleness (``stale_dropped``), as uninformative groups
  (``filtered``) and as members of a group with a failed member (``orphaned``).
* ``schema`` — the tables, and the migrations that bring an older store file up to date.

This class is synchronous and not thread-safe: the data service runs every call on one thread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from laminar.runtime.clock import RealClock

from .failures import UNKNOWN, FailureKind, FailureLedger, Rejection
from .parking import Parking
from .partials import Partials
from .queue import Queue
from .schema import SYNCHRONOUS, connect
from .trajectories import BufferEntry, Trajectories

__all__ = [
    "SYNCHRONOUS",
    "UNKNOWN",
    "BufferEntry",
    "FailureKind",
    "Rejection",
    "Store",
]


class Store(Queue, Parking, Partials, Trajectories, FailureLedger):
    """The store of one data role: the table groups above over one connection.

    ``now`` stamps rows with the wall time (default: the real clock's); it is called on the
    store's thread.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "NORMAL",
        now: Callable[[], float] | None = None,
    ) -> None:
        path = Path(path)
        super().__init__(connect(path, synchronous), path, now or RealClock().wall)

    def ahead(self) -> int:
        """Trajectories leased (in generation) or finished and not yet consumed nor evicted."""
        (leased,) = self.db.execute(
            "SELECT COUNT(*) FROM samples WHERE state = 'leased'"
        ).fetchone()
        return int(leased) + self.waiting_count()

    def counts(self) -> dict[str, int]:
        """Samples by state, the buffer's counters and the failures (the role's status)."""
        out = {"queued": 0, "leased": 0, "done": 0}
        for state, n in self.db.execute("SELECT state, COUNT(*) FROM samples GROUP BY state"):
            if state in out:  # parked ones are counted by ``parked_count``
                out[state] = n
        out.update(self.buffer_counts())
        out["stale_dropped"] = self.stale_dropped()
        out["filtered"] = self.filtered()
        out.update(self.failure_counts())
        out["done"] -= out["failed"]  # done = generated; failed ones are counted apart
        out["orphaned"] = self.orphaned()
        out["cancelled"] = self.cancelled_count()
        out["cursor"] = self.consume_cursor()
        out["partial_tokens"] = self.partial_token_count()
        return out
