"""Where blocking work runs: one small interface, threads in production, the event loop in tests.

Why: roles do blocking work the event loop must not wait on (SQLite commits, CRCs of a version,
staging weights, reaping a reward worker, a torch step). If each role picks its own threads
(``asyncio.to_thread``, ``run_in_executor``), a test that runs the role on virtual time cannot
control them: a thread runs in real time, invisible to the virtual clock, so the same run gives
different interleavings. So a role asks its context for a named executor
(``ctx.executor("data-store")``) and the host decides what runs it:

- :class:`ThreadExecutor` (the default): named threads, ``workers`` of them. One worker
  serialises, which is what an owner of non-thread-safe state needs (the data store's SQLite
  connection, the torch model: steps, checkpoints and staging never race each other).
- :class:`InLoopExecutor` (the in-process test cluster): the call runs on the event loop itself,
  ``cost_s`` of virtual time after it was submitted (1 ms by default: about an SQLite commit),
  in submission order. Not zero, so that a loop polling the store cannot stand virtual time
  still; constant, so calls complete in the order they were submitted.

An executor belongs to whoever made it (for roles: the
:class:`~laminar.runtime.context.ServiceContext`,
which closes it at stop). Code outside a role that takes an executor argument (a test's own
publisher, a benchmark) gets :data:`LOOP_DEFAULT`: the running loop's default executor, what
``run_in_executor(None, ...)`` has always meant.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "LOOP_DEFAULT",
    "Executor",
    "ExecutorClosed",
    "ExecutorFactory",
    "InLoopExecutor",
    "LoopDefaultExecutor",
    "ThreadExecutor",
]

T = TypeVar("T")


@runtime_checkable
class Executor(Protocol):
    """Runs a blocking call off the caller's task; ``await run(fn, *args)`` is its result (or
    its exception). Cancelling the awaiting task abandons a call that has not started."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T: ...

    def close(self) -> None:
        """No new calls; calls not yet started are cancelled, a running one finishes."""
        ...


#: What a host gives :meth:`ServiceContext.executor`: ``(name, workers) -> Executor``.
ExecutorFactory = Callable[[str, int], Executor]


class ExecutorClosed(RuntimeError):
    """A call submitted to an executor after :meth:`Executor.close`."""


class ThreadExecutor:
    """``workers`` threads named ``name-N`` (started when first needed); see the module docstring.

    The call runs in a copy of the caller's context variables, as with ``asyncio.to_thread``.
    """

    def __init__(self, name: str, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"executor {name!r} needs at least one worker, not {workers}")
        self.name = name
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise ExecutorClosed(f"executor {self.name!r} is closed")
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        # Not waiting: a running call (a torch step) may take long and the loop must not block
        # on it; the interpreter joins the thread at exit.
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)


class InLoopExecutor:
    """Calls run on the event loop, ``cost_s`` after submission, in submission order (see the
    module docstring). The cost is time on the loop's clock, the one ``ctx.clock`` reads: virtual
    under :class:`~laminar.runtime.clock.VirtualTimeLoop`. A call blocks the loop while it runs, so
    this
    is for tests and simulation, where that is the point."""

    def __init__(self, name: str = "in-loop", *, cost_s: float = 1e-3) -> None:
        if cost_s < 0:
            raise ValueError(f"cost_s must be >= 0, not {cost_s}")
        self.name = name
        self.cost_s = cost_s
        self._queue: collections.deque[tuple[float, asyncio.Future[Any], Callable[[], Any]]] = (
            collections.deque()
        )
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue the call; the future holds its outcome (what ``run_in_executor`` returns)."""
        if self._closed:
            raise ExecutorClosed(f"executor {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        # Equal costs make due times non-decreasing, so the queue is in due order; a FIFO rather
        # than a timer per call because the loop's timer heap does not keep ties in order.
        self._queue.append((loop.time() + self.cost_s, future, functools.partial(fn, *args)))
        if self._timer is None:
            self._arm(loop)
        return future

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_at(self._queue[0][0], self._due, loop)

    def _due(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        while self._queue and self._queue[0][0] <= now:
            _, future, call = self._queue.popleft()
            if future.cancelled():  # its caller gave up before it started
                continue
            try:
                result = call()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
        if self._queue and self._timer is None:
            self._arm(loop)

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue:
            self._queue.popleft()[1].cancel()


class LoopDefaultExecutor:
    """The running loop's default executor (``run_in_executor(None, ...)``): for callers outside
    a role, which have no context to ask. Owns nothing, so closing it does nothing."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))

    def close(self) -> None:
        pass


#: The executor of code that is given none (see :class:`LoopDefaultExecutor`).
LOOP_DEFAULT = LoopDefaultExecutor()
