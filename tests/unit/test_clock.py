"""Tests for laminar.runtime.clock: the injectable Clock and the virtual-time event loop."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from laminar.runtime.clock import (
    DEFAULT_EPOCH,
    Clock,
    RealClock,
    VirtualClock,
    VirtualTimeLoop,
    get_clock,
    run_virtual,
)
from tests.support.virtual import run_virtual_recording


def test_thousand_tasks_sleep_a_simulated_hour_without_waiting_for_real() -> None:
    # Evenly spread durations, shuffled: sum = 7.2 * 1001 / 2 = 3603.6 s of simulated sleep.
    durations = [7.2 * (i + 1) / 1000 for i in range(1000)]
    random.Random(0).shuffle(durations)
    assert sum(durations) >= 3600
    woke: list[tuple[float, float]] = []

    async def sleeper(d: float) -> None:
        await asyncio.sleep(d)
        woke.append((d, get_clock().time()))

    async def main() -> float:
        await asyncio.gather(*(sleeper(d) for d in durations))
        return asyncio.get_running_loop().time()

    end, real_timeouts = run_virtual_recording(main())

    assert real_timeouts and all(t == 0 for t in real_timeouts), set(real_timeouts)
    assert end == max(durations)
    assert len(woke) == 1000
    assert [d for d, _ in woke] == sorted(durations)  # woke in time order
    assert all(t == d for d, t in woke)  # each woke exactly at its deadline


def test_wake_order_and_time_after_sleep() -> None:
    order: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        clock = get_clock()
        t0 = clock.time()
        await clock.sleep(seconds)
        assert clock.time() == t0 + seconds
        order.append(name)

    async def main() -> tuple[float, float]:
        clock = get_clock()
        before = clock.time()
        await asyncio.gather(sleeper("c", 30.0), sleeper("a", 0.5), sleeper("b", 2.25))
        return before, clock.time()

    before, after = run_virtual(main(), start=100.0)
    assert before == 100.0
    assert after == 130.0
    assert order == ["a", "b", "c"]


def test_call_later_and_call_at_fire_at_their_virtual_times() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[str, float]] = []
        done = loop.create_future()
        loop.call_at(50.0, lambda: fired.append(("at", loop.time())))
        loop.call_later(20.0, lambda: fired.append(("later", loop.time())))
        loop.call_later(60.0, done.set_result, None)
        await done
        return fired

    assert run_virtual(main(), start=10.0) == [("later", 30.0), ("at", 50.0)]


def test_wait_for_timeout_fires_in_virtual_time() -> None:
    # A real one-hour wait would trip pytest-timeout; virtual time just jumps.
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(7200), timeout=3600)
        return loop.time()

    assert run_virtual(main(), start=5.0) == 5.0 + 3600


def test_wait_for_returns_when_inner_finishes_first() -> None:
    async def main() -> tuple[str, float]:
        result = await asyncio.wait_for(asyncio.sleep(10, result="ok"), timeout=3600)
        return result, asyncio.get_running_loop().time()

    assert run_virtual(main()) == ("ok", 10.0)


def test_asyncio_timeout_fires_in_virtual_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(3600):
                await asyncio.Event().wait()
        return loop.time()

    assert run_virtual(main()) == 3600.0


def test_timers_beyond_the_select_cap_still_land_exactly() -> None:
    # asyncio caps one select() at 24 h; a 3-day sleep takes several jumps.
    async def main() -> float:
        await asyncio.sleep(3 * 86400 + 0.1)
        return asyncio.get_running_loop().time()

    assert run_virtual(main()) == 3 * 86400 + 0.1


def test_tcp_echo_works_while_virtual_timers_jump() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def echo() -> bytes:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello laminar\n")
        await writer.drain()
        line = await reader.readline()
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()
        return line

    async def main() -> tuple[bytes, float]:
        # The I/O uses no timers, so the concurrent hour-long sleep cannot time it out; once the
        # sleeper is done the loop has no timers and blocks in a real select for the sockets.
        line, _ = await asyncio.gather(echo(), asyncio.sleep(3600))
        return line, asyncio.get_running_loop().time()

    assert run_virtual(main()) == (b"hello laminar\n", 3600.0)


def test_run_in_executor_completes_without_timers() -> None:
    # No timer is pending, so the loop blocks in a real select until the worker thread wakes it
    # through the self-pipe: deterministic even with the default threshold of 0.
    async def main() -> tuple[None, float]:
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(None, time.sleep, 0.05)
        return result, loop.time()

    assert run_virtual(main(), start=1.0) == (None, 1.0)


def test_threads_take_zero_virtual_time_so_a_virtual_timeout_beats_them() -> None:
    # The documented caveat: with threshold 0 the loop jumps straight to the timeout while the
    # thread is still blocked (a gate makes this deterministic).
    gate = threading.Event()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, gate.wait)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(fut), timeout=1.0)
        jumped_to = loop.time()
        gate.set()
        assert await fut is True
        return jumped_to

    assert run_virtual(main()) == 1.0


def test_autojump_threshold_gives_threads_real_time_to_report_back() -> None:
    # With a (generous) 5 s threshold, the loop waits for real I/O before jumping; the 50 ms
    # thread wakes it through the self-pipe first, so no jump happens and the 60 s virtual
    # timeout never fires.
    async def main() -> tuple[None, float]:
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(None, time.sleep, 0.05)
        result = await asyncio.wait_for(work, timeout=60)
        return result, loop.time()

    assert run_virtual(main(), autojump_threshold=5.0) == (None, 0.0)


def test_explicit_advance() -> None:
    async def main() -> tuple[float, bool, float, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        short = asyncio.create_task(asyncio.sleep(3.0))
        long = asyncio.create_task(asyncio.sleep(10.0))
        await asyncio.sleep(0)  # let both tasks schedule their timers
        loop.advance(5.0)
        advanced_to = loop.virtual_time
        await short  # already due: no jump needed, so time stays at 5
        after_short = loop.time()
        long_done = long.done()
        await long  # jumps to its deadline, 10
        with pytest.raises(ValueError):
            loop.advance(-1.0)
        return advanced_to, long_done, after_short, loop.time()

    assert run_virtual(main()) == (5.0, False, 5.0, 10.0)


def test_loop_usable_directly_and_threshold_validated() -> None:
    loop = VirtualTimeLoop(start=7.0)
    try:
        assert loop.run_until_complete(asyncio.sleep(3.0, result="x")) == "x"
        assert loop.time() == 10.0
    finally:
        loop.close()
    with pytest.raises(ValueError):
        VirtualTimeLoop(autojump_threshold=-1.0)


def test_run_virtual_cancels_leftover_tasks() -> None:
    cancelled: list[bool] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> None:
        asyncio.create_task(forever())  # noqa: RUF006 - deliberately left running
        await asyncio.sleep(1.0)

    run_virtual(main())
    assert cancelled == [True]


def test_get_clock_kinds_and_virtual_wall() -> None:
    assert isinstance(get_clock(), RealClock)  # no running loop

    async def in_real_loop() -> Clock:
        return get_clock()

    assert isinstance(asyncio.run(in_real_loop()), RealClock)

    async def in_virtual_loop() -> tuple[Clock, float, float, float]:
        clock = get_clock()
        wall0 = clock.wall()
        await clock.sleep(10.0)
        return clock, wall0, clock.wall(), clock.time()

    clock, wall0, wall1, t = run_virtual(in_virtual_loop(), start=50.0, epoch=1000.0)
    assert isinstance(clock, VirtualClock)
    assert isinstance(clock, Clock)
    assert (wall0, wall1, t) == (1000.0, 1010.0, 60.0)

    async def default_epoch() -> float:
        return get_clock().wall()

    assert run_virtual(default_epoch(), start=3.0) == DEFAULT_EPOCH


def test_virtual_clock_outside_virtual_loop_raises() -> None:
    async def main() -> None:
        VirtualClock().time()

    with pytest.raises(RuntimeError, match="VirtualTimeLoop"):
        asyncio.run(main())


def test_real_clock_really_sleeps() -> None:
    clock = RealClock()
    assert isinstance(clock, Clock)
    before_wall = time.time()

    async def main() -> tuple[float, float]:
        t0 = clock.time()
        await clock.sleep(0.05)
        return t0, clock.time()

    t0, t1 = asyncio.run(main())
    # asyncio may wake up to a clock tick early; allow 1 ms below the requested time.
    assert t1 - t0 >= 0.049
    assert clock.wall() >= before_wall
    assert clock.time() >= t1  # outside a loop: time.monotonic(), the same clock
