"""What the data role's parts share: its config, clock, log, store and round gate.

The service builds one :class:`DataContext` and hands it to each part (leasing, reports,
sampling, the membership watch), so a part sees the few things it uses rather than the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from laminar.runtime.clock import Clock, RealClock

from .focus import Focus
from .rounds import RoundGate
from .store import Store

if TYPE_CHECKING:
    from .config import DataConfig

T = TypeVar("T")


class OnStoreThread(Protocol):
    """Runs a store call on the store's thread (the one place that decides where it runs)."""

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


@dataclass
class DataContext:
    config: DataConfig
    clock: Clock
    log: Any  # the service's bound structlog logger
    db: OnStoreThread
    need_store: Callable[[], Store]  # the open store (a clear error while starting or stopping)
    rounds: RoundGate | None  # round schedules (``rounds``); None under laminar
    trainer_version: int = 0  # the newest the trainer sampled at (its ``SampleRequest``)
    focus: Focus | None = None  # ``data.focus`` (used on the store's thread only)


def store_clock(clock: Clock) -> Callable[[], float]:
    """``clock.wall`` as the store's thread can read it (the store stamps rows with it).

    A clock may need the running event loop (``VirtualClock``), which the store's thread has
    not: such a clock's wall time is read as the loop's time plus the offset between the two now
    (both advance together). The real clock's wall is read as it is (``time.time``, which follows
    the system clock's adjustments).
    """
    if isinstance(clock, RealClock):
        return clock.wall
    loop = asyncio.get_running_loop()
    offset = clock.wall() - loop.time()
    return lambda: offset + loop.time()
