"""The heartbeat timeout: which members have been silent too long, counted from when the manager
was listening.

Why "listening": a check that wakes much later than it asked to (by over a quarter of the timeout)
means the manager's process was not running (stopped, swapped out, starved of CPU, a VM paused) and
heard nothing meanwhile: the members' heartbeats sit unread in its sockets, or their calls timed out
and they are reconnecting. Judged by their last heartbeat, every member would look silent and be
marked dead at once (a manager stopped for longer than the timeout would mark all its members dead
on waking, each then revived; the data role requeues a dead rollout's trajectories, and repeated
false deaths can quarantine them). So after a late check a member's silence counts from the wake-up:
it gets a whole timeout to be heard. A manager late on every check would never time anyone out; a
closed connection (a killed process) is still noticed at once, elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from laminar.runtime.clock import Clock
from laminar.runtime.membership import Member


def silent_members(
    members: Mapping[str, Member], me: str, now: float, listening_since: float, timeout: float
) -> list[Member]:
    """Alive members other than ``me`` not heard from for over ``timeout`` seconds of the time
    since ``listening_since`` (wall times)."""
    return [
        m
        for m in members.values()
        if m.state == "alive"
        and m.instance != me
        and now - max(m.last_seen, listening_since) > timeout
    ]


async def check_liveness(
    members: Mapping[str, Member],
    me: str,
    clock: Clock,
    timeout: float,
    interval: float,
    mark_dead: Callable[[Member, str], None],
    log: Any,
) -> None:
    """Every ``interval``: ``mark_dead`` each silent member (see the module docstring). Runs
    until cancelled."""
    planned = clock.time()
    listening_since = 0.0
    while True:
        late = clock.time() - planned
        now = clock.wall()
        if late > max(interval, timeout / 4):
            listening_since = now
            log.info("liveness check woke late: silence counts from now", late_s=round(late, 2))
        for member in silent_members(members, me, now, listening_since, timeout):
            mark_dead(member, f"no heartbeat for {now - member.last_seen:.1f} s")
        planned = clock.time() + interval
        await clock.sleep(interval)
