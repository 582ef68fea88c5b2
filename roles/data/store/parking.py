"""Samples of the round schedules (``sync``, ``one_step``, ``tail_batching``; ``rounds``).

A group that a round defers is *parked*: its samples are ``parked`` (neither queued nor leased)
until a later long round puts them back in the queue. Parking withdraws whatever the group had
made (partial tokens, finished members not yet consumed): a deferred prompt restarts from
scratch on a later version, so that round's batch stays on-policy. A rollout still generating a
parked sample learns at its next report that it is no longer its lease (``drop``), and a
completion that arrives later is ignored (:meth:`Parking.parked_ids`).

Stores written before the ``parked`` state held parked samples as leases of a pseudo-rollout;
opening one reads those as parked (``schema``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .base import StoreBase


class Parking(StoreBase):
    if TYPE_CHECKING:  # from ``Queue`` (the other mixins of ``Store``)

        def _requeue(self, tids: list[str]) -> None: ...

    def queued_groups(self) -> list[str]:
        """Prompt ids (groups) with a queued sample, in queue order."""
        return [
            pid
            for (pid,) in self.db.execute(
                "SELECT DISTINCT prompt_id FROM samples WHERE state = 'queued'"
            )
        ]

    def last_queued_group(self) -> str | None:
        """The prompt id of the sample queued last (the group a refill just added)."""
        row = self.db.execute(
            "SELECT prompt_id FROM samples WHERE state = 'queued' ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        return row[0] if row else None

    def park(self, groups: Iterable[str]) -> None:
        """Park every sample of ``groups``, withdrawing their tokens and unconsumed trajectories."""
        with self._transaction():
            for pid in groups:
                for (tid,) in self.db.execute(
                    "SELECT trajectory_id FROM samples WHERE prompt_id = ?", (pid,)
                ).fetchall():
                    self.db.execute("DELETE FROM partials WHERE trajectory_id = ?", (tid,))
                    self.db.execute(
                        "DELETE FROM trajectories WHERE trajectory_id = ? AND consumed = 0", (tid,)
                    )
                self.db.execute(
                    "UPDATE samples SET state = 'parked', rollout = NULL, version = NULL, "
                    "started_at = NULL WHERE prompt_id = ?",
                    (pid,),
                )

    def unpark(self, groups: Iterable[str]) -> None:
        """Queue the parked samples of ``groups`` again (in their original queue order)."""
        with self._transaction():
            for pid in groups:
                self.db.execute(
                    "UPDATE samples SET state = 'queued', rollout = NULL, version = NULL "
                    "WHERE prompt_id = ? AND state = 'parked'",
                    (pid,),
                )

    def parked_ids(self, tids: Iterable[str]) -> set[str]:
        """Which of ``tids`` are parked."""
        return {
            tid
            for tid in tids
            if self.db.execute(
                "SELECT 1 FROM samples WHERE trajectory_id = ? AND state = 'parked'", (tid,)
            ).fetchone()
        }

    def release_parked(self) -> list[str]:
        """Every parked sample back to the front of the queue (the rounds that deferred them
        are gone: a data role that restarts starts with a fresh round)."""
        tids = [
            tid
            for (tid,) in self.db.execute(
                "SELECT trajectory_id FROM samples WHERE state = 'parked' ORDER BY seq"
            )
        ]
        if tids:
            with self._transaction():
                self._requeue(tids)
        return tids

    def parked_count(self) -> int:
        return int(
            self.db.execute("SELECT COUNT(*) FROM samples WHERE state = 'parked'").fetchone()[0]
        )
