"""Leases a rollout holds ahead of its engine (``roles/rollout/ahead.py``): no I/O, no engine."""

from __future__ import annotations

import pytest

from laminar.roles.rollout.ahead import LeasesAhead, sizes
from laminar.trajectory import Assignment, SamplingParams


def lease(tid: str, version: int | None = 3, resume: list[int] | None = None) -> Assignment:
    return Assignment(
        trajectory_id=tid,
        prompt_id=tid.split("/")[0],
        sample_index=0,
        prompt_token_ids=[1, 2],
        params=SamplingParams(),
        queued_at=0.0,
        version=version,
        resume_token_ids=resume or [],
        resume_logprobs=[-1.0] * len(resume or []),
    )


def test_leases_come_out_oldest_first_once_each() -> None:
    ahead = LeasesAhead()
    for tid in ("a/0", "b/0", "a/0", "c/0"):  # a re-delivery of one it holds is not a second
        ahead.add(lease(tid))
    assert len(ahead) == 3 and list(ahead) == ["a/0", "b/0", "c/0"] and "b/0" in ahead
    assert [a.trajectory_id for a in ahead.pop(2)] == ["a/0", "b/0"]
    assert [a.trajectory_id for a in ahead.pop(5)] == ["c/0"] and ahead.pop(1) == []
    assert ahead.pop(-1) == []


def test_only_leases_of_the_engines_version_stay() -> None:
    ahead = LeasesAhead()
    for tid, version in (("a/0", 3), ("b/0", 4), ("c/0", 3)):
        ahead.add(lease(tid, version))
    assert ahead.stale(3) == ["b/0"] and list(ahead) == ["a/0", "c/0"]
    assert ahead.stale(3) == []
    assert ahead.stale(4) == ["a/0", "c/0"] and len(ahead) == 0
    ahead.add(lease("d/0", None))  # not bound to a version: never stale
    assert ahead.stale(9) == [] and ahead.clear() == ["d/0"] and len(ahead) == 0


def test_a_resume_may_not_wait() -> None:
    with pytest.raises(ValueError, match="a/0 is a resume"):
        LeasesAhead().add(lease("a/0", resume=[5, 6]))


@pytest.mark.parametrize(
    ("concurrency", "ahead", "min_take"), [(32, 16, 8), (4, 2, 1), (1, 0, 1), (3, 1, 1)]
)
def test_defaults_scale_with_the_engine(concurrency: int, ahead: int, min_take: int) -> None:
    assert sizes(concurrency, None, None) == (ahead, min_take)


def test_what_the_config_sets_wins() -> None:
    assert sizes(32, 0, None) == (0, 1)  # lease only as slots free, one at a time
    assert sizes(32, None, 3) == (16, 3) and sizes(8, 5, 2) == (5, 2)


def test_leases_leaving_wake_whoever_waits_for_room() -> None:
    """A rollout's puller waits for room (``Changes.until``); leases given back at a version
    switch make room, and without a wake-up both rollouts of a run once waited for good (88
    stale leases given back, nothing in flight, no newer version coming)."""
    woken: list[int] = []
    ahead = LeasesAhead(on_change=lambda: woken.append(len(ahead)))
    for i in range(4):
        ahead.add(lease(f"t{i}", version=3))
    assert woken == []  # taking leases leaves less room: nobody to wake
    assert ahead.stale(4) == ["t0", "t1", "t2", "t3"] and woken == [0]
    assert ahead.stale(4) == [] and woken == [0]  # nothing left: no wake-up
    ahead.add(lease("u0", version=4))
    ahead.add(lease("u1", version=4))
    assert [a.trajectory_id for a in ahead.pop(1)] == ["u0"] and woken == [0, 1]
    assert ahead.clear() == ["u1"] and woken == [0, 1, 0]
    assert ahead.pop(3) == [] and ahead.clear() == [] and woken == [0, 1, 0]
