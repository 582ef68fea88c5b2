"""Run a coroutine on a ``VirtualTimeLoop`` and record every real ``select`` it makes.

"No real waiting" is checked by what the loop asked the OS for (every real select's timeout
is 0), not by a stopwatch: wall-time bounds failed on loaded machines (a 5 s bound took 6.4 s
in one CI run)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from laminar.runtime.clock import VirtualTimeLoop

T = TypeVar("T")


def run_virtual_recording(coro: Coroutine[Any, Any, T]) -> tuple[T, list[float | None]]:
    """``run_virtual(coro)``, plus the timeout of every real select the loop made."""
    timeouts: list[float | None] = []

    def factory() -> VirtualTimeLoop:
        loop = VirtualTimeLoop()
        real = loop._selector._real  # type: ignore[attr-defined]
        select = real.select

        def recording(timeout: float | None = None) -> list:  # type: ignore[type-arg]
            timeouts.append(timeout)
            return select(timeout)

        real.select = recording
        return loop

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro), timeouts
