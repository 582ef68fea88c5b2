"""The event-loop watch (laminar.runtime.loopwatch): a loop held by blocking code is said once while it is
held, naming the code, and once more when it turns again; a loop that keeps turning is not said;
and ``laminar serve`` logs both (a role whose endpoint blocks its loop)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from laminar.runtime.loopwatch import LoopWatch, Stall
from tests.support.poll import until

#: A bound on waiting for the watch thread's report: a hang, never a timing check.
SAID_S = 30.0


def said_at_least(said: list[Stall], n: int, ended: int = 0):  # type: ignore[no-untyped-def]
    """A probe for :func:`until`: the watch has said ``n`` things, ``ended`` of them ends."""

    async def probe() -> bool:
        return len(said) >= n and sum(s.ended for s in said) >= ended

    return probe


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # blocking, on purpose


async def test_a_blocked_loop_is_said_with_the_code_holding_it() -> None:
    threshold = 0.25
    said: list[Stall] = []
    watch = LoopWatch(asyncio.get_running_loop(), threshold, said.append)
    watch.start()
    try:
        await asyncio.sleep(3 * threshold)  # turning: nothing to say
        assert said == []
        hold_the_loop(4 * threshold)
        # the watch thread says the end once the loop stamps again
        await until(said_at_least(said, 2, ended=1), SAID_S)
    finally:
        watch.close()
    assert [s.ended for s in said] == [False, True], said
    first, end = said
    assert first.where.endswith("in hold_the_loop") and "test_loopwatch.py" in first.where
    assert first.stack[-1] == first.where and len(first.stack) <= 4
    assert first.seconds >= threshold
    # its whole length, within the watch's interval (threshold / 4) and the scheduler's slack
    assert 3 * threshold <= end.seconds, end
    assert end.where == first.where


async def test_each_stall_is_said_once_and_close_stops_the_watch() -> None:
    said: list[Stall] = []
    watch = LoopWatch(asyncio.get_running_loop(), 0.25, said.append)
    watch.start()
    try:
        for i in range(1, 3):
            hold_the_loop(1.0)
            await until(said_at_least(said, 2 * i, ended=i), SAID_S)  # the loop turns again
    finally:
        watch.close()
    assert [s.ended for s in said] == [False, True, False, True], said
    assert not watch._thread.is_alive()
    hold_the_loop(1.0)
    await asyncio.sleep(0.3)
    assert len(said) == 4


def test_threshold_must_be_positive() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="positive"):
            LoopWatch(loop, 0.0, lambda _: None)
    finally:
        loop.close()


async def test_laminar_serve_logs_stalls_but_not_once_the_role_is_stopping() -> None:
    """``laminar serve``'s reporter: a warning naming the code, then the stall's length; nothing
    once the host is stopping (a rollout's on_stop joins vLLM's processes on the loop)."""
    from laminar.cli.serve import watch_loop

    class Log:
        def __init__(self) -> None:
            self.lines: list[tuple[str, dict[str, object]]] = []

        def warning(self, event: str, **kw: object) -> None:
            self.lines.append((event, kw))

    stopping = False
    log = Log()
    watch = watch_loop(log, 0.25, lambda: stopping)
    try:
        hold_the_loop(1.0)
        await until(lambda: asyncio.sleep(0, len(log.lines) >= 2), SAID_S)  # and its end
        stopping = True
        hold_the_loop(1.0)
        await asyncio.sleep(0.5)
    finally:
        watch.close()
    events = [event for event, _ in log.lines]
    assert len(events) == 2 and events[0].startswith("event loop blocked"), log.lines
    assert events[1] == "event loop turns again", log.lines
    assert str(log.lines[0][1]["at"]).endswith("in hold_the_loop")


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_loop_held_without_python_frames_is_told_apart(loop_kind: str) -> None:
    """A C callback (``time.sleep`` scheduled directly) holds the loop with only the loop's own
    frames on the stack: said as ``idle`` (no Python code of the role to name), under both
    loops; a Python function holding it is not idle."""
    import uvloop

    said: list[Stall] = []

    async def main() -> None:
        watch = LoopWatch(asyncio.get_running_loop(), 0.25, said.append)
        watch.start()
        try:
            asyncio.get_running_loop().call_soon(time.sleep, 1.0)
            await until(said_at_least(said, 2, ended=1), SAID_S)
            hold_the_loop(1.0)
            await until(said_at_least(said, 4, ended=2), SAID_S)
        finally:
            watch.close()

    (uvloop.run if loop_kind == "uvloop" else asyncio.run)(main())
    starts = [s for s in said if not s.ended]
    assert [s.idle for s in starts] == [True, False], said
    assert starts[1].where.endswith("in hold_the_loop")


def one_turn(
    loop_kind: str, first: Callable[[float], object], read_first: Callable[[Stall], bool]
) -> list[Stall]:
    """What the watch said of one turn of the loop in which ``first`` and then ``hold_the_loop``
    each held it for a second. The watch's first reading falls in ``first``'s second unless its
    thread gets no CPU for all of it (a loaded machine): then that reading is of the sleep, and
    the turn is tried again, up to three times (``read_first`` tells a first reading of
    ``first``)."""
    import uvloop

    async def main(said: list[Stall]) -> None:
        loop = asyncio.get_running_loop()
        watch = LoopWatch(loop, 0.25, said.append)
        watch.start()
        try:
            await asyncio.sleep(0.1)
            loop.call_soon(first, 1.0)
            loop.call_soon(hold_the_loop, 1.0)
            await asyncio.sleep(0.01)  # the two run here, in one turn of the loop
            await until(said_at_least(said, 1, ended=1), SAID_S)  # the watch sees it turn again
        finally:
            watch.close()

    for _ in range(3):
        said: list[Stall] = []
        (uvloop.run if loop_kind == "uvloop" else asyncio.run)(main(said))
        if said and read_first(said[0]):
            break
    return said


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_stall_said_idle_names_the_code_that_holds_the_loop_next(loop_kind: str) -> None:
    """One stall, held first without Python frames (a process waiting for a CPU looks the same)
    and then by a Python function, in the same turn of the loop: said as idle, then again naming
    that function, and its end names it too (a suite run on a loaded machine saw a role starved
    right before its blocking call reported as idle only)."""
    said = one_turn(loop_kind, time.sleep, lambda stall: stall.idle)
    assert [(s.ended, s.idle) for s in said] == [(False, True), (False, False), (True, False)], said
    assert said[1].where.endswith("in hold_the_loop") and said[2].where == said[1].where
    assert said[2].seconds >= 1.75, said[2]


def spin(seconds: float) -> int:
    """Holds the loop computing: its line changes from one reading to the next, its holder not."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_one_stall_held_by_two_callbacks_names_each_and_a_busy_one_once(loop_kind: str) -> None:
    """Two callbacks in one turn of the loop, one computing, then one sleeping: one stall, said
    once per holder (the computing one read many times at changing lines is said once), and its
    end names the last. (A CI run on a loaded machine read a slow connection callback first and
    never named the ``time.sleep`` that held the loop right after it.)"""
    said = one_turn(loop_kind, spin, lambda stall: stall.where.endswith("in spin"))
    assert [(s.ended, s.idle) for s in said] == [(False, False), (False, False), (True, False)], (
        said
    )
    assert said[0].where.endswith("in spin") and said[1].where.endswith("in hold_the_loop")
    assert said[2].where == said[1].where and said[2].seconds >= 1.75, said[2]
