"""Waiting on another process's state: poll a probe until it returns something truthy."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: How long a test waits for a service it runs in its own loop to stop: a bound on a hang, never a
#: timing check (a data role's stop, which ends its reward workers, took over 10 s in a
#: fresh-clone suite run while three vLLM engines started beside it).
STOP_S = 60.0


async def until(probe: Callable[[], Awaitable[T]], timeout: float, interval: float = 0.05) -> T:
    """The first truthy result of ``probe()``; TimeoutError after ``timeout`` seconds.

    Remote state has no event to wait on from here, so polling is the honest tool.
    """
    async with asyncio.timeout(timeout):
        while not (result := await probe()):  # noqa: ASYNC110 - no remote event to await
            await asyncio.sleep(interval)
        return result
