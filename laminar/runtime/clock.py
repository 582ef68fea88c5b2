"""An injectable clock and a virtual-time asyncio event loop.

Why: the runtime is mostly waiting (on rollouts, timeouts, heartbeats, back-off). Testing such
code against the real clock is slow and flaky. Under ``VirtualTimeLoop`` the event loop's clock is
simulated, so an hour of timers passes in milliseconds of wall time and the schedule is
deterministic, with unchanged code: ``asyncio.sleep``, ``wait_for``, ``asyncio.timeout``,
``call_later`` and ``call_at`` all read ``loop.time()``.

What advances virtual time: only an idle loop. When no callback is ready, asyncio's ``_run_once``
computes ``timeout = next_timer_when - loop.time()`` and calls ``selector.select(timeout)``. Our
selector wrapper first polls real I/O (sockets, the self-pipe that ``call_soon_threadsafe`` and
``run_in_executor`` write to) for at most ``autojump_threshold`` real seconds; if nothing arrived,
it jumps the virtual clock straight to that next timer (trio's ``MockClock(autojump_threshold)``).
``loop.advance(seconds)`` moves it explicitly. When there are no timers at all (``timeout is
None``) the select blocks for real: a thread or socket may still wake the loop, and no time is
invented.

What does not advance it: CPU work, and real time in general. Callbacks take zero virtual time.

Caveats:
- Threads and subprocesses run in real time but are invisible to the jump: with the default
  threshold 0.0, a virtual timeout racing ``run_in_executor`` fires before the thread reports
  back. Give them real time with ``autojump_threshold > 0`` (each jump then costs that much wall).
- The same holds for real network peers racing a virtual timeout.
- Code that reads ``time.monotonic()``/``time.time()`` directly is not virtualised; roles should
  take a ``Clock`` (or call ``get_clock()``) instead.
- A loop that polls with short sleeps (``while not done: await asyncio.sleep(0.01)``) burns virtual
  time as fast as it can spin while it waits on real work.
"""

from __future__ import annotations

import asyncio
import selectors
import time as _time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "DEFAULT_EPOCH",
    "Clock",
    "RealClock",
    "VirtualClock",
    "VirtualTimeLoop",
    "get_clock",
    "run_virtual",
]

T = TypeVar("T")

DEFAULT_EPOCH = 1_704_067_200.0  # 2024-01-01T00:00:00Z: deterministic wall() under virtual time


@runtime_checkable
class Clock(Protocol):
    """What role code uses instead of ``time`` and ``asyncio.sleep``."""

    def time(self) -> float:
        """Monotonic seconds (the event loop's clock)."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch, for timestamps in records."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling task for ``seconds``."""
        ...


class RealClock:
    """The real clocks: ``loop.time()`` (``time.monotonic()`` outside a loop), ``time.time()``."""

    def time(self) -> float:
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return _time.monotonic()

    def wall(self) -> float:
        return _time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class VirtualClock:
    """The clock of the running ``VirtualTimeLoop``; ``wall()`` = its epoch + elapsed time."""

    def _loop(self) -> VirtualTimeLoop:
        loop = asyncio.get_running_loop()
        if not isinstance(loop, VirtualTimeLoop):
            raise RuntimeError(f"VirtualClock needs a running VirtualTimeLoop, not {loop!r}")
        return loop

    def time(self) -> float:
        return self._loop().time()

    def wall(self) -> float:
        loop = self._loop()
        return loop.epoch + (loop.time() - loop.start)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _AutojumpSelector(selectors.BaseSelector):
    """Delegates to a real selector; an idle ``select(timeout)`` jumps virtual time instead."""

    def __init__(
        self, real: selectors.BaseSelector, threshold: float, jump: Callable[[float], None]
    ) -> None:
        self._real = real
        self._threshold = threshold
        self._jump = jump

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timers: only real I/O or another thread can wake us
            return self._real.select(None)
        events = self._real.select(min(timeout, self._threshold))
        if not events and timeout > 0:
            self._jump(timeout)
        return events

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual and jumps to the next timer when idle.

    ``start``: initial virtual time. ``autojump_threshold``: real seconds to wait for real I/O
    (sockets, threads) before jumping. ``epoch``: what ``VirtualClock.wall()`` reads at ``start``.
    """

    def __init__(
        self,
        start: float = 0.0,
        autojump_threshold: float = 0.0,
        epoch: float = DEFAULT_EPOCH,
    ) -> None:
        self._virtual_time = float(start)
        self.start = float(start)
        self.epoch = float(epoch)
        self.autojump_threshold = float(autojump_threshold)
        selector = _AutojumpSelector(selectors.DefaultSelector(), autojump_threshold, self._jump)
        super().__init__(selector)
        if autojump_threshold < 0:
            self.close()
            raise ValueError("autojump_threshold must be >= 0")

    def time(self) -> float:
        return self._virtual_time

    @property
    def virtual_time(self) -> float:
        return self._virtual_time

    def advance(self, seconds: float) -> None:
        """Move virtual time forward; timers now due run on the next loop iteration."""
        if seconds < 0:
            raise ValueError("cannot move virtual time backwards")
        self._virtual_time += seconds

    def _jump(self, timeout: float) -> None:
        # _run_once passed timeout = min(when - time(), MAXIMUM_SELECT_TIMEOUT) for the earliest
        # timer. When it was not capped, land exactly on `when` (time + (when - time) may round).
        now = self._virtual_time
        # ignored below: asyncio keeps the loop's timers in a private heap, with no public reader
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if scheduled and scheduled[0].when() - now <= timeout:
            self._virtual_time = max(now, scheduled[0].when())
        else:
            self._virtual_time = now + timeout


def run_virtual(
    coro: Coroutine[Any, Any, T],
    *,
    start: float = 0.0,
    autojump_threshold: float = 0.0,
    epoch: float = DEFAULT_EPOCH,
) -> T:
    """Like ``asyncio.run`` on a fresh ``VirtualTimeLoop``: cancels leftovers and closes it."""

    def factory() -> VirtualTimeLoop:
        return VirtualTimeLoop(start=start, autojump_threshold=autojump_threshold, epoch=epoch)

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


_REAL_CLOCK = RealClock()
_VIRTUAL_CLOCK = VirtualClock()


def get_clock() -> Clock:
    """The ``VirtualClock`` inside a running ``VirtualTimeLoop``, else the ``RealClock``."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return _REAL_CLOCK
    return _VIRTUAL_CLOCK if isinstance(loop, VirtualTimeLoop) else _REAL_CLOCK
