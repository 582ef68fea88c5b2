"""The trajectories a rollout has in its engine, and what the data role has acknowledged of each.

Why a table of its own: three parties change it (the output stream finishes flights, a report
reply drops them, a repack migration moves them out and maybe back) and one more waits on it (a
weight load waits for it to empty). Each removal calls ``on_change`` so whoever waits rechecks; the
migration module uses this table without knowing the service that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterator, ValuesView
from dataclasses import dataclass, field

from laminar.engines import InflightSequence
from laminar.tools.env import spans_within
from laminar.trajectory import Assignment, PartialChunk, Trajectory


@dataclass
class Flight:
    """One trajectory in the engine: its lease, its version, the tokens so far."""

    assignment: Assignment
    version: int
    started_at: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    acked: int = 0  # tokens the data role has acknowledged
    # Episodes: the environment's spans of ``tokens``, and whether the episode waits for the
    # environment's answer to its last turn (then it is not in the engine: no KV held).
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    waiting: bool = False
    asked: int = 0  # bumped per wait: an older ask's late answer is ignored

    def unsent(self, trajectory_id: str) -> PartialChunk | None:
        """The tokens the data role has not acknowledged, as one report chunk (None: none)."""
        if len(self.tokens) <= self.acked:
            return None
        return PartialChunk(
            trajectory_id=trajectory_id,
            version=self.version,
            offset=self.acked,
            token_ids=self.tokens[self.acked :],
            logprobs=self.logprobs[self.acked :],
            env_spans=spans_within(self.env_spans, self.acked, len(self.tokens)),
        )

    def sequence(self, trajectory_id: str) -> InflightSequence:
        """The flight as an engine sequence without KV (to import, or to hand over)."""
        a = self.assignment
        return InflightSequence(
            request_id=trajectory_id,
            prompt_token_ids=a.prompt_token_ids,
            response_token_ids=self.tokens,
            response_logprobs=self.logprobs,
            params=a.params,
            version=self.version,
        )

    def trajectory(self, reason: str | None, finished_at: float, rollout: str) -> Trajectory:
        a = self.assignment
        return Trajectory(
            trajectory_id=a.trajectory_id,
            prompt_id=a.prompt_id,
            sample_index=a.sample_index,
            prompt_token_ids=a.prompt_token_ids,
            response_token_ids=self.tokens,
            logprobs=self.logprobs,
            version=self.version,
            finish_reason=reason or "stop",
            queued_at=a.queued_at,
            started_at=self.started_at,
            finished_at=finished_at,
            rollout=rollout,
            env_spans=list(self.env_spans),
        )


def _nothing() -> None:
    pass


class FlightTable:
    """Trajectory id -> :class:`Flight`; reads like a dict, changes through ``add`` and ``pop``."""

    def __init__(self, on_change: Callable[[], None] = _nothing) -> None:
        self._flights: dict[str, Flight] = {}
        self._on_change = on_change

    def add(self, trajectory_id: str, flight: Flight) -> None:
        self._flights[trajectory_id] = flight

    def pop(self, trajectory_id: str, *, quiet: bool = False) -> Flight | None:
        """Remove and return it (None if it is not here); waiters are told unless ``quiet`` (the
        caller finishes with the engine first, then calls :meth:`changed`)."""
        flight = self._flights.pop(trajectory_id, None)
        if flight is not None and not quiet:
            self._on_change()
        return flight

    def changed(self) -> None:
        """Tell waiters to look again (after a ``quiet`` pop)."""
        self._on_change()

    def pop_many(self, trajectory_ids: list[str]) -> dict[str, Flight]:
        """Those of ``trajectory_ids`` that are here, removed (one wake-up for all)."""
        out = {t: f for t in trajectory_ids if (f := self._flights.pop(t, None)) is not None}
        self._on_change()
        return out

    def snapshot(self) -> list[str]:
        """The ids in flight now (a list: safe to keep while the table changes)."""
        return list(self._flights)

    def get(self, trajectory_id: str) -> Flight | None:
        return self._flights.get(trajectory_id)

    def __getitem__(self, trajectory_id: str) -> Flight:
        return self._flights[trajectory_id]

    def __contains__(self, trajectory_id: object) -> bool:
        return trajectory_id in self._flights

    def __iter__(self) -> Iterator[str]:
        return iter(self._flights)

    def __len__(self) -> int:
        return len(self._flights)

    def values(self) -> ValuesView[Flight]:
        return self._flights.values()

    def items(self) -> ItemsView[str, Flight]:
        return self._flights.items()
