"""The ``prompts`` and ``samples`` tables: the dataset, the queue and the leases.

A sample is ``queued`` -> ``leased`` (to a rollout) -> ``done``; a lease returns to the front of
the queue when its rollout dies, its partial tokens kept, so the next rollout of the same version
resumes instead of restarting. (``parked``, for round schedules, is in ``parking``.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from laminar.trajectory import Assignment, SamplingParams

from .base import StoreBase, i32, ints

#: ``admit(record, epoch, position)``: queue the prompt drawn at ``position`` of ``epoch``?
Admit = Callable[[dict[str, object], int, int], bool]


class Queue(StoreBase):
    if TYPE_CHECKING:  # from ``Partials`` (the other mixins of ``Store``)

        def partial(self, tid: str) -> tuple[list[int], list[float]]: ...

        def partial_env_spans(self, tid: str) -> list[tuple[int, int]]: ...

    # -- the dataset -------------------------------------------------------------------------

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
        with self._transaction():
            self.db.executemany(
                "INSERT INTO prompts (idx, prompt_id, record, token_ids) VALUES (?, ?, ?, ?)",
                (
                    (i, pid, json.dumps(record), i32(ids))
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

    def refill(
        self,
        min_queued: int,
        samples: int,
        seed: int,
        epochs: int | None,
        admit: Admit | None = None,
    ) -> int:
        """Queue whole groups (``samples`` per prompt) until ``min_queued`` are queued.

        Prompts are drawn in a seeded permutation per epoch, so the order is reproducible and a
        restart continues where the cursor stopped. ``admit(record, epoch, position)`` may skip a
        drawn prompt (``focus``): it is not queued in this epoch. Returns how many samples were
        added.
        """
        n_prompts = self.prompt_count()
        added = 0
        with self._transaction():
            queued = self.queued_count()
            epoch = self._meta_int("epoch")
            pos = self._meta_int("cursor")
            seq = self._meta_int("next_seq", 1)
            now = self.now()
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
                prompt_id, record = self.db.execute(
                    "SELECT prompt_id, record FROM prompts WHERE idx = ?", (idx,)
                ).fetchone()
                if admit is not None and not admit(json.loads(record), epoch, pos - 1):
                    continue
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
        epoch = self._meta_int("epoch")
        pos = self._meta_int("cursor")
        return epoch >= epochs or (epoch == epochs - 1 and pos >= self.prompt_count())

    def queued_count(self) -> int:
        return int(
            self.db.execute("SELECT COUNT(*) FROM samples WHERE state = 'queued'").fetchone()[0]
        )

    # -- leases ------------------------------------------------------------------------------

    def lease(
        self,
        rollout: str,
        count: int,
        version: int,
        holding: set[str],
        params: SamplingParams,
        fresh_limit: int | None = None,
        start_new: bool = True,
    ) -> list[Assignment]:
        """Up to ``count`` assignments for ``rollout``: re-deliveries, resumes, then fresh ones.

        Re-deliveries are samples already leased to this rollout that it does not hold (the reply
        of an earlier lease was lost). Resumes are requeued samples with partial tokens of
        ``version``; samples with partials of another version are left for a matching rollout.
        ``fresh_limit`` caps the samples newly leased (backpressure); re-deliveries are already
        leased, so they are never held back. ``start_new=False`` leases no sample that has not
        started yet (the asynchronous ratio): only re-deliveries and resumes. A *suspect*
        (strikes > 0: a rollout died holding it) goes only to a rollout that holds no other
        suspect still without progress, so that if it is what kills rollouts, it does not take
        other suspects down with it again
        (``failures``).
        """
        out: list[Assignment] = []
        now = self.now()
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
        with self._transaction():
            if stale:
                self._requeue(stale)
            for tid in lost:
                out.append(self._assignment(tid))
            want = count - len(out)
            if fresh_limit is not None:
                want = min(want, fresh_limit)
            for tid in self._leasable(rollout, version, want, start_new):
                self.db.execute(
                    "UPDATE samples SET state = 'leased', rollout = ?, version = ?, progress = 0, "
                    "started_at = COALESCE(started_at, ?) WHERE trajectory_id = ?",
                    (rollout, version, now, tid),
                )
                out.append(self._assignment(tid))
        return [a.model_copy(update={"params": params}) for a in out]

    def _leasable(self, rollout: str, version: int, want: int, start_new: bool = True) -> list[str]:
        """Up to ``want`` queued samples for ``rollout``, in queue order, at most one suspect
        (with ``start_new=False`` only resumes: samples bound to ``version``)."""
        if want <= 0:
            return []
        if start_new:
            match = "state = 'queued' AND (version IS NULL OR version = ?)"
        else:
            match = "state = 'queued' AND version = ?"
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
        tokens, logprobs = self.partial(tid)
        return Assignment(
            trajectory_id=tid,
            prompt_id=prompt_id,
            sample_index=k,
            prompt_token_ids=ints(raw),
            params=SamplingParams(),
            queued_at=queued_at,
            version=version,
            resume_token_ids=tokens,
            resume_logprobs=logprobs,
            resume_env_spans=self.partial_env_spans(tid) if tokens else [],
            started_at=started_at,
        )

    def holder(self, tid: str) -> tuple[str, str | None, int | None] | None:
        """``(state, rollout, version)`` of sample ``tid`` (None: no such sample)."""
        row = self.db.execute(
            "SELECT state, rollout, version FROM samples WHERE trajectory_id = ?", (tid,)
        ).fetchone()
        return None if row is None else (row[0], row[1], row[2])

    def release(self, rollout: str) -> list[str]:
        """Return a dead rollout's leases to the front of the queue (partials kept)."""
        tids = self._leased_to(rollout)
        if tids:
            with self._transaction():
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

    def give_back(self, rollout: str, tids: Iterable[str]) -> list[str]:
        """Leases ``rollout`` gives back unstarted: those still leased to it without progress on
        this lease go back to the front of the queue, in queue order (a resume keeps its tokens
        and its version); returns their ids."""
        mine: list[tuple[int, str]] = []
        with self._transaction():
            for tid in dict.fromkeys(tids):
                row = self.db.execute(
                    "SELECT seq FROM samples WHERE trajectory_id = ? AND state = 'leased' "
                    "AND rollout = ? AND progress = 0",
                    (tid, rollout),
                ).fetchone()
                if row is not None:
                    mine.append((row[0], tid))
            released = [tid for _, tid in sorted(mine)]
            self._requeue(released)
            # One that never generated a token never started: its next lease is its first start
            # (a resume keeps the start of the lease that began its tokens).
            self.db.executemany(
                "UPDATE samples SET started_at = NULL WHERE trajectory_id = ? "
                "AND NOT EXISTS (SELECT 1 FROM partials WHERE trajectory_id = ?)",
                [(tid, tid) for tid in released],
            )
        return released

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
            with self._transaction():
                for tid in stale:
                    self.db.execute("DELETE FROM partials WHERE trajectory_id = ?", (tid,))
                    self.db.execute(
                        "UPDATE samples SET version = NULL WHERE trajectory_id = ?", (tid,)
                    )
        return stale

    def transfer(self, tids: Iterable[str], source: str, destination: str) -> list[str]:
        """Move leases of ``source`` to ``destination`` (repack); returns the ids now there."""
        moved = []
        with self._transaction():
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
        """Leased sample ids by rollout (every rollout that holds one)."""
        out: dict[str, list[str]] = {}
        for tid, rollout in self.db.execute(
            "SELECT trajectory_id, rollout FROM samples WHERE state = 'leased'"
        ):
            out.setdefault(rollout, []).append(tid)
        return out
