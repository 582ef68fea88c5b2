"""Leases taken ahead: fresh assignments a rollout holds but has not started yet.

Why: a ``take`` is a round trip to the data role, whose process shares the machine with the
engine. Where cores are few the data role's process is at times not scheduled for a large part
of a second, and a rollout that leased only as slots freed would watch its engine drain, down to
one sequence (docs/benchmarks.md, *Generation*). With a few leases in hand, a slot
that frees is refilled at once, and the takes can come in batches (``min_take``), which makes
them, and the data role's wake-ups, several times fewer.

What keeps a trajectory on one weight version: a lease taken ahead remembers the version it was
leased at (``Assignment.version``; the data role binds resumes to it) and starts only on that
version. Once the engine has loaded another, the lease is given back (``DataApi.release``) and
taken afresh. Only fresh leases wait here; a resume continues tokens of one version, so the
rollout starts it at once, as before.

No I/O here: the service decides when to take, start and give back (``tests/unit``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from laminar.trajectory import Assignment


def is_fresh(a: Assignment) -> bool:
    """A lease with no tokens yet: it may wait (a resume may not)."""
    return not a.resume_token_ids


class LeasesAhead:
    """Fresh leases in the order they were taken; ids are unique."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self._items: dict[str, Assignment] = {}
        # Called when leases leave: the room to take more grew, and a puller waiting for room
        # must look again (without it, 88 stale leases given back at a version switch left both
        # rollouts of a run waiting for a wake-up that never came).
        self._on_change = on_change

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, trajectory_id: object) -> bool:
        return trajectory_id in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def add(self, a: Assignment) -> None:
        if not is_fresh(a):
            raise ValueError(f"{a.trajectory_id} is a resume: it must start at once")
        self._items.setdefault(a.trajectory_id, a)

    def stale(self, version: int) -> list[str]:
        """Remove and return the leases taken at another version than ``version``."""
        ids = [
            tid for tid, a in self._items.items() if a.version is not None and a.version != version
        ]
        for tid in ids:
            del self._items[tid]
        if ids:
            self._on_change()
        return ids

    def pop(self, count: int) -> list[Assignment]:
        """Remove and return up to ``count`` of the oldest."""
        out = []
        for tid in list(self._items)[: max(0, count)]:
            out.append(self._items.pop(tid))
        if out:
            self._on_change()
        return out

    def clear(self) -> list[str]:
        """Remove and return every lease held."""
        ids = list(self._items)
        self._items.clear()
        if ids:
            self._on_change()
        return ids


def sizes(concurrency: int, lease_ahead: int | None, min_take: int | None) -> tuple[int, int]:
    """``(lease_ahead, min_take)`` with the config's open ones filled in: half the engine's
    slots held ahead, and a take once half of those are free (so one is under way while the
    other half refills), at least one."""
    ahead = concurrency // 2 if lease_ahead is None else lease_ahead
    return ahead, max(1, ahead // 2) if min_take is None else min_take
