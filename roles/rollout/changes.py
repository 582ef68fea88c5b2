"""One wake-up for everything a rollout's tasks wait on: a phase change or a flight leaving.

Why one event, not one per condition: the conditions (a free slot, nothing in flight, the
operator's resume) are all questions about the same two objects, the phase machine and the flight
table, and both call :meth:`Changes.notify` on every change. A waiter states its condition as a
predicate and rechecks it after each wake-up; a wake-up that was not for it costs one check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Changes:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds (at once if it already does)."""
        while not condition():
            # clear-then-wait with no await between the check and the wait: no lost wake-up
            self._event.clear()
            await self._event.wait()
