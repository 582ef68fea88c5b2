"""The serving side's bookkeeping for one connection: which requests run, which wait, and how many
stream items each open stream may still send. No I/O here;
:class:`laminar.runtime.rpc.server.RpcServer` wires it
to a connection.

Two bounds, and why each exists:

* **Requests in flight** (:class:`Calls`). Without a bound, a peer that sends faster than handlers
  finish grows this process's tasks and memory without limit, and the transport's flow control
  never engages (every frame is taken at once). At the bound, up to as many requests again are
  held, in arrival order, so CANCELs and pings behind them are still seen; beyond that the server
  stops reading the connection, and TCP's window stops the sender.
* **Stream items in flight** (:class:`Credit`). A stream's consumer grants the producer a window
  of items and tops it up as it takes them, so a slow consumer holds the producer instead of
  growing its own queue. The transport's write buffer alone does not do that: the consumer's RPC
  client reads every frame as it arrives (its replies must not wait behind a stream), so without
  credit a fast stream fills the consumer's memory, not the producer's send buffer.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine
from typing import Any

from laminar.transport import Frame

from .wire import K_NOTIFY


class Credit:
    """Items one stream may still send; ``None`` credit (an old client) means unbounded."""

    def __init__(self, initial: int | None) -> None:
        self.available = initial
        self._granted = asyncio.Event()

    def grant(self, n: int) -> None:
        if self.available is not None:
            self.available += n
            self._granted.set()

    async def take(self) -> None:
        """Wait until one item may be sent, and count it as sent."""
        if self.available is None:
            return
        while self.available <= 0:
            self._granted.clear()
            await self._granted.wait()
        self.available -= 1


class Calls:
    """The requests of one connection: running (at most ``limit``) and held (read ahead)."""

    def __init__(
        self,
        limit: int,
        handler: Callable[[Frame], Coroutine[Any, Any, None]],
        on_room: Callable[[], None],
    ) -> None:
        self.limit = limit
        self.handler = handler
        # Made in the connection's loop, which every task of the connection runs on. Tasks are
        # created through it: asyncio.create_task looks the running loop up, which on Python 3.11
        # is a getpid() system call, one per request (strace).
        self.loop = asyncio.get_running_loop()
        self.on_room = on_room  # a request finished: the connection may read again
        self.running: dict[int, asyncio.Task[None]] = {}  # calls and streams, by call id
        self.oneway: set[asyncio.Task[None]] = set()  # notifies
        self.control: set[asyncio.Task[None]] = set()  # pongs: not requests, never bounded
        self.held: collections.deque[Frame] = collections.deque()
        self.credits: dict[int, Credit] = {}  # open streams, by call id

    def has_room(self) -> bool:
        return len(self.running) + len(self.oneway) < self.limit

    def read_ahead_full(self) -> bool:
        return len(self.held) >= self.limit

    def known(self, call_id: int) -> bool:
        if call_id in self.running:
            return True
        return bool(self.held) and any(f.meta.get("i") == call_id for f in self.held)

    def submit(self, frame: Frame) -> None:
        if self.held or not self.has_room():
            self.held.append(frame)  # nothing overtakes a held request
        else:
            self._start(frame)

    def spawn_control(self, coro: Coroutine[Any, Any, None]) -> None:
        # answered from a task: a full send buffer must not stop the connection reading
        task = self.loop.create_task(coro)
        self.control.add(task)
        task.add_done_callback(self.control.discard)

    def open_stream(self, call_id: int, initial: int | None) -> Credit:
        credit = self.credits[call_id] = Credit(initial)
        return credit

    def grant(self, call_id: Any, n: int) -> None:
        credit = self.credits.get(call_id)
        if credit is not None:  # a stream that already ended: nothing to do
            credit.grant(n)

    def cancel(self, call_id: Any) -> None:
        task = self.running.get(call_id)
        if task is not None:
            task.cancel()
        else:  # not started yet: drop it, as its caller gave up
            self.credits.pop(call_id, None)
            kept = [
                f for f in self.held if f.meta.get("k") == K_NOTIFY or f.meta.get("i") != call_id
            ]
            self.held = collections.deque(kept)

    async def cancel_all(self) -> None:
        self.held.clear()
        pending = [*self.running.values(), *self.oneway, *self.control]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def _start(self, frame: Frame) -> None:
        task = self.loop.create_task(self.handler(frame))
        if frame.meta.get("k") == K_NOTIFY:
            self.oneway.add(task)
            task.add_done_callback(self._oneway_done)
        else:
            call_id = frame.meta["i"]
            self.running[call_id] = task
            task.add_done_callback(lambda _task: self._done(call_id))

    def _done(self, call_id: int) -> None:
        self.running.pop(call_id, None)
        self.credits.pop(call_id, None)
        self._next()

    def _oneway_done(self, task: asyncio.Task[None]) -> None:
        self.oneway.discard(task)
        self._next()

    def _next(self) -> None:
        while self.held and self.has_room():
            self._start(self.held.popleft())
        self.on_room()
