"""The ``partials`` table: acknowledged in-flight tokens, chunks keyed by (trajectory, start).

A rollout reports new tokens every flush interval; they outlive the rollout, so a trajectory
whose rollout dies resumes from them on another rollout of the same version.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from laminar.tools.env import add_span, spans_within
from laminar.trajectory import PartialChunk

from .base import StoreBase, f32, floats, i32, ints
from .failures import Rejection


class Partials(StoreBase):
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
        with self._transaction():
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
                stop = c.offset + len(c.token_ids)
                spans = spans_within(c.env_spans, end, stop)
                self.db.execute(
                    "INSERT INTO partials (trajectory_id, start, stop, token_ids, logprobs, "
                    "env_spans) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        c.trajectory_id,
                        end,
                        stop,
                        i32(c.token_ids[skip:]),
                        f32(c.logprobs[skip:]),
                        json.dumps(spans) if spans else None,
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
            tokens += ints(ids)
            logprobs += floats(lps)
        return tokens, logprobs

    def partial_env_spans(self, tid: str) -> list[tuple[int, int]]:
        """The environment's spans among ``tid``'s stored tokens (an episode's observations)."""
        spans: list[tuple[int, int]] = []
        for (raw,) in self.db.execute(
            "SELECT env_spans FROM partials WHERE trajectory_id = ? AND env_spans IS NOT NULL "
            "ORDER BY start",
            (tid,),
        ):
            for a, b in json.loads(raw):
                add_span(spans, int(a), int(b))
        return spans

    def partial_lengths(self) -> dict[str, int]:
        return dict(
            self.db.execute("SELECT trajectory_id, MAX(stop) FROM partials GROUP BY trajectory_id")
        )

    def partial_token_count(self) -> int:
        return int(
            self.db.execute("SELECT COALESCE(SUM(stop - start), 0) FROM partials").fetchone()[0]
        )
