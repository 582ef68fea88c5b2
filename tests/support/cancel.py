"""Cancel a task at a chosen moment and check that it ends: how lost cancellations are caught.

A cancellation is lost when the task it lands in swallows it (``asyncio.wait_for`` on Python 3.11
when its inner awaitable finishes at the same moment, cpython gh-86296; ``await task`` under a
``suppress`` of ``CancelledError``) and the task goes on. Where it lands depends on how many loop
turns the task ran first, so the tests cancel after a seeded number of turns, many times.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: how long an ended task may take: a kept cancellation ends the task within a loop turn or so, a
#: lost one never does
END_BOUND_S = 2.0


async def cancel_after(task: asyncio.Task[Any], turns: int, what: str) -> None:
    """Let ``task`` run ``turns`` loop turns, cancel it once, and wait for it to end.

    AssertionError naming ``what`` if it has not ended within :data:`END_BOUND_S`: the
    cancellation was lost. The task is ended before that is raised (cancelled again until it
    stops: a second cancel is often lost too), so a failure leaves nothing running.
    """
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=END_BOUND_S)
    if done:
        return
    for _ in range(1000):
        task.cancel()
        await asyncio.wait([task], timeout=0.01)
        if task.done():
            break
    raise AssertionError(f"{what} was lost: the task went on after its cancellation")
