"""The manager's heartbeat timeout counts silence from when the manager was listening
(``roles/manager/liveness.py``; the real-process check is in ``tests/integration/test_processes.py``)."""

from __future__ import annotations

from laminar.roles.manager.liveness import silent_members
from laminar.runtime.membership import Member


def member(name: str, last_seen: float, state: str = "alive") -> Member:
    return Member(
        instance=name, role="rollout", address="tcp://x:1", last_seen=last_seen, state=state
    )  # type: ignore[arg-type]


def test_silence_counts_from_the_later_of_the_last_heartbeat_and_the_wake_up() -> None:
    members = {
        "manager-0": member("manager-0", 0.0),  # the manager itself: never timed out
        "quiet": member("quiet", 10.0),
        "heard": member("heard", 14.0),
        "gone": member("gone", 0.0, state="dead"),  # already dead: not again
    }
    # listening all along: 'quiet' is 6 s silent against a 5 s timeout
    assert [m.instance for m in silent_members(members, "manager-0", 16.0, 0.0, 5.0)] == ["quiet"]
    # the manager woke at 15 after a stall: nobody has been silent for 5 s of listening yet
    assert silent_members(members, "manager-0", 16.0, 15.0, 5.0) == []
    # ... until a whole timeout after the wake-up, for those it has not heard since
    late = silent_members(members, "manager-0", 20.5, 15.0, 5.0)
    assert [m.instance for m in late] == ["quiet", "heard"]
