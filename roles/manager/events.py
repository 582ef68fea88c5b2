"""The manager's event log: what happened in the cluster, in order, for operators and the dashboard.

Why a log and not only metrics: an operator watching a repack wants the *story* (this plan, these
trajectories moved from A to B, how long it took, A then loaded version 7), and the dashboard wants
to draw the weight-version timeline from the same facts. Events are numbered; a reader that
reconnects with ``since=N`` (SSE's ``Last-Event-ID``) gets everything after N that is still in the
bounded window, then new ones as they happen. A slow reader never blocks the manager: the window
is a ring, and a reader that falls behind it skips ahead (it sees the gap in the numbers).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, Field

EventKind = Literal[
    "repack", "publish", "pull", "failure", "membership", "policy", "drain", "resume", "alert"
]

# What each kind means (the admin API page is generated from this; a new kind needs a line).
EVENT_KINDS: dict[str, str] = {
    "repack": "a repack ran: the plan, its moves, the trajectories moved and the overhead",
    "publish": "the master relay has a new weight version",
    "pull": "a rollout loaded a weight version",
    "failure": "a member died, or a migration failed",
    "membership": "a member joined, left or came back",
    "policy": "the repack policy changed",
    "drain": "an operator drained a rollout",
    "resume": "an operator resumed a rollout",
    "alert": "a member reported something to look at: trajectories excluded from training "
    "(failed reward, non-finite logprobs) or optimizer steps skipped (non-finite loss)",
}


class ClusterEvent(BaseModel):
    seq: int
    at: float  # wall clock
    kind: EventKind
    data: dict[str, Any] = Field(default_factory=dict)


class EventLog:
    def __init__(self, keep: int = 2000) -> None:
        self._events: deque[ClusterEvent] = deque(maxlen=keep)
        self._seq = 0
        self._changed = asyncio.Event()

    @property
    def last_seq(self) -> int:
        return self._seq

    def publish(self, kind: EventKind, at: float, **data: Any) -> ClusterEvent:
        self._seq += 1
        event = ClusterEvent(seq=self._seq, at=at, kind=kind, data=data)
        self._events.append(event)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return event

    def recent(
        self, since: int = 0, kinds: set[str] | None = None, limit: int | None = None
    ) -> list[ClusterEvent]:
        out = [e for e in self._events if e.seq > since and (kinds is None or e.kind in kinds)]
        return out[-limit:] if limit is not None else out

    async def follow(self, since: int = 0) -> AsyncIterator[ClusterEvent]:
        """Events after ``since`` still in the window, then every new one, forever."""
        seen = since
        while True:
            changed = self._changed
            fresh = self.recent(seen)
            for event in fresh:
                yield event
                seen = event.seq
            if not fresh:
                await changed.wait()
