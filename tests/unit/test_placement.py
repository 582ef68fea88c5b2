"""laminar.proc.placement's parts that need no process of their own: the niceness bounds, thread
ids, the spare cores, who gives way. ``give_way`` and ``keep_off_bound_cores`` themselves run in a
child process (``tests/integration/test_placement.py``): niceness cannot be lowered again without
a privilege, and the test runner's cores are not for a test to move."""

from __future__ import annotations

import os

import pytest

from laminar.proc.placement import (
    Placed,
    give_way,
    niceness,
    niceness_for,
    spare_cores,
    thread_ids,
)


def test_niceness_outside_0_to_19_is_refused() -> None:
    with pytest.raises(ValueError, match="outside 0-19"):
        give_way(20)
    with pytest.raises(ValueError, match="outside 0-19"):
        give_way(-1)


def test_thread_ids_lists_this_process_and_reads_one() -> None:
    tids = thread_ids()
    assert os.getpid() in tids
    assert niceness(os.getpid()) == os.getpriority(os.PRIO_PROCESS, 0)
    assert thread_ids(2**22 + 12345) == []  # no such process


def test_spare_cores_are_what_the_bound_processes_leave() -> None:
    assert spare_cores({0, 1}, [{0}]) == (1,)  # vLLM's worker on 0: the rest may use 1
    assert spare_cores({0, 1, 2, 3}, [{0, 1}, {2}, {0, 1, 2, 3}]) == (3,)
    assert spare_cores({0, 1}, [{0, 1}]) == ()  # nothing narrowed (a GPU worker, a reward pool)
    assert spare_cores({0, 1}, []) == ()
    assert spare_cores({0, 1}, [{0}, {1}]) == ()  # bound ones cover every core
    assert spare_cores({0}, [{0}]) == ()  # a rollout given one core (`laminar run`'s plan)
    assert spare_cores({1, 2}, [{0}]) == ()  # not a subset of ours: not ours to avoid


def test_who_gives_way() -> None:
    stayed, moved = Placed(bound=(), cores=()), Placed(bound=(0,), cores=(1,))
    assert niceness_for(10, computes=False, feeds_engine=False, placed=stayed) == 10  # data role
    assert niceness_for(10, computes=True, feeds_engine=False, placed=moved) == 0  # trainer
    # a rollout on its engine's cores feeds it: not; moved off them: it may
    assert niceness_for(10, computes=False, feeds_engine=True, placed=stayed) == 0
    assert niceness_for(10, computes=False, feeds_engine=True, placed=moved) == 10
    assert niceness_for(0, computes=False, feeds_engine=False, placed=stayed) == 0  # off
