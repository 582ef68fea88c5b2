"""The event loop of the in-process cluster (:mod:`laminar.harness.inproc`): virtual time, no
threads, real I/O that freezes the clock, and tasks that know which member started them.

What makes a run deterministic (the same events, in the same order, at the same virtual times):

- **No threads.** Every role's blocking work (the data store, CRC checks, weight staging, reward
  worker reaping, the trainer's compute) goes through its context's executors, and the cluster
  makes them :class:`~laminar.runtime.executor.InLoopExecutor` s (:meth:`InprocLoop.executor`): the
  call
  runs on the loop, in submission order, ``executor_cost_s`` of virtual time after it was
  submitted (1 ms: about an SQLite commit). Not zero, so that no loop that polls the store can
  stand virtual time still (one did while the role code was being rewritten; with the code as it
  is, every schedule also runs at zero cost, at most two leases per rollout at one instant).
  Code that is given no executor (a test's own helpers; every role hands its parts one) uses the
  loop's default one (``run_in_executor(None, ...)``), and that runs on the loop the same way,
  through one shared in-loop executor. A thread pool of one's own
  (a ``ThreadExecutor`` that was not replaced) is refused with an error naming the call.
- **Real I/O freezes virtual time.** The one real I/O left is a reward worker's pipes, waited on
  with ``loop.add_reader``/``add_writer``. While such a wait is registered, an idle loop blocks on
  the real selector instead of jumping its clock (a reward takes zero virtual time), for at most
  ``stall_s`` real seconds (after that, a hung reward lets virtual time pass, timer by timer).
  Real I/O is only polled when the loop is idle, so a reply lands at a fixed point of the run.
- **Seeded randomness.** ``random`` (RPC back-off jitter) is seeded; the data role's prompt order
  and every sim engine take ``seed``. A set's iteration order of strings still depends on
  ``PYTHONHASHSEED``: runs in one process agree; across processes they may differ.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import random
import selectors
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

from laminar.runtime.clock import VirtualTimeLoop, _AutojumpSelector
from laminar.runtime.executor import Executor, InLoopExecutor

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: The member whose code created the running task (None: the test itself).
MEMBER: contextvars.ContextVar[str | None] = contextvars.ContextVar("inproc_member", default=None)


class InprocLoop(VirtualTimeLoop):
    """A :class:`VirtualTimeLoop` with no threads, real I/O that freezes virtual time, and tasks
    tagged with the member that started them (see the module docstring)."""

    _selector: Any  # the base loop's, wrapped below

    def __init__(self, *, stall_s: float = 5.0, executor_cost_s: float = 1e-3) -> None:
        super().__init__()
        self.stall_s = stall_s
        self.executor_cost_s = executor_cost_s
        self._in_loop_default = InLoopExecutor("loop-default", cost_s=executor_cost_s)
        self.tasks: dict[str | None, weakref.WeakSet[asyncio.Task[Any]]] = {}
        self._io_waits: set[tuple[str, int]] = set()
        self._selector = _IdleIoSelector(self._selector._real, self)
        self.set_task_factory(self._tagged_task)

    # -- tasks belong to members ---------------------------------------------------------------

    def _tagged_task(
        self, loop: asyncio.AbstractEventLoop, coro: Any, context: contextvars.Context | None = None
    ) -> asyncio.Task[Any]:
        member = MEMBER.get() if context is None else context.get(MEMBER)
        task = asyncio.Task(coro, loop=loop, context=context)
        self.tasks.setdefault(member, weakref.WeakSet()).add(task)
        return task

    def live_tasks(self, member: str) -> list[asyncio.Task[Any]]:
        return [t for t in self.tasks.get(member, ()) if not t.done()]

    # -- executors: on the loop ------------------------------------------------------------------

    def executor(self, name: str, workers: int) -> Executor:
        """The members' executor factory (``ServiceContext(executors=loop.executor)``): one
        in-loop executor per name and member, whatever ``workers`` says."""
        return InLoopExecutor(name, cost_s=self.executor_cost_s)

    def run_in_executor(
        self,
        executor: concurrent.futures.Executor | None,
        func: Callable[[*Ts], T],
        *args: *Ts,
    ) -> asyncio.Future[T]:
        """The loop's default executor (``executor=None``) runs on the loop (see the module
        docstring). A thread pool of one's own would run in real time, beside virtual time:
        refused, so that a role picking its threads by hand fails here, loudly."""
        if executor is not None:
            raise RuntimeError(
                f"{func!r} sent to a thread pool of its own in the in-process cluster: "
                "take an executor from the service context (ctx.executor)"
            )
        return self._in_loop_default.submit(func, *args)

    # -- real I/O waits (a reward worker's pipes) ----------------------------------------------

    def add_reader(
        self, fd: FileDescriptorLike, callback: Callable[[*Ts], Any], *args: *Ts
    ) -> None:
        super().add_reader(fd, callback, *args)
        self._io_waits.add(("r", _fileno(fd)))

    def remove_reader(self, fd: FileDescriptorLike) -> bool:
        self._io_waits.discard(("r", _fileno(fd)))
        return super().remove_reader(fd)

    def add_writer(
        self, fd: FileDescriptorLike, callback: Callable[[*Ts], Any], *args: *Ts
    ) -> None:
        super().add_writer(fd, callback, *args)
        self._io_waits.add(("w", _fileno(fd)))

    def remove_writer(self, fd: FileDescriptorLike) -> bool:
        self._io_waits.discard(("w", _fileno(fd)))
        return super().remove_writer(fd)

    @property
    def waiting_on_real_io(self) -> bool:
        return bool(self._io_waits)


def _fileno(fd: Any) -> int:
    return fd if isinstance(fd, int) else fd.fileno()


class _IdleIoSelector(_AutojumpSelector):
    """Real I/O is looked at only when the loop is idle; virtual time jumps only when none is
    awaited (see the module docstring). Registration is the clock's selector's (it delegates)."""

    def __init__(self, real: selectors.BaseSelector, loop: InprocLoop) -> None:
        super().__init__(real, 0.0, loop._jump)
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout == 0:  # callbacks are ready: they run first, I/O waits for the idle point
            return []
        if timeout is None:  # no timers: only real I/O can wake us
            return self._real.select(None)
        if self._loop.waiting_on_real_io:
            events = self._real.select(self._loop.stall_s)
            if events:
                return events
        else:
            events = self._real.select(0)
            if events:
                return events
        self._jump(timeout)
        return []


def run_inproc(main: Callable[[], Coroutine[Any, Any, T]], *, seed: int) -> T:
    """Run ``main()`` on a fresh :class:`InprocLoop` (virtual time from 0), ``random`` seeded."""
    random.seed(seed)
    with asyncio.Runner(loop_factory=InprocLoop) as runner:
        return runner.run(main())


# -- the cluster ---------------------------------------------------------------------------------
