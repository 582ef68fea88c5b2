"""Waiting on another process's state: poll a probe until it returns something truthy."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def until(probe: Callable[[], Awaitable[T]], timeout: float, interval: float = 0.05) -> T:
    """The first truthy result of ``probe()``; TimeoutError after ``timeout`` seconds.

    Remote state has no event to wait on from here, so polling is the honest tool.
    """
    async with asyncio.timeout(timeout):
        while not (result := await probe()):  # noqa: ASYNC110 - no remote event to await
            await asyncio.sleep(interval)
        return result
