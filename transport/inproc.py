"""``inproc://name``: peers in the same event loop, no sockets.

A whole cluster can run in one process (tests, and the virtual-clock simulator) with the same role
code. Frames are handed over as objects: the payload is immutable ``bytes`` and buffers are passed
as read-only views, so nothing is copied and the receiver cannot write into the sender's memory
(the sender must not modify a buffer it sent, as with every transport). A receiver that chose
where its buffers land (an allocator other than the default, e.g. a relay receiving a weight
version into its shared-memory buffer) gets them copied there, as a socket reader would write
them. Limits are enforced exactly as on a socket, and the handshake runs the same way.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable

from .base import (
    Connection,
    ConnectionClosed,
    FrameSink,
    Handler,
    Listener,
    Transport,
    TransportOptions,
    register_transport,
)
from .frames import PREFIX_SIZE, Frame, FrameError, Limits, check_outgoing
from .reader import Allocator, default_allocator

_QUEUE_FRAMES = 64  # a sender waits when its peer has this many frames unread
_ids = itertools.count(1)


class InprocConnection(Connection):
    can_stall = False  # a peer in this loop cannot go silent without closing

    def __init__(self, peer: str, limits: Limits, allocator: Allocator) -> None:
        super().__init__(peer, limits, allocator)
        self.remote: InprocConnection | None = None
        self._inbox: deque[Frame] = deque()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._closed = asyncio.Event()
        self._sink: FrameSink | None = None  # push delivery (deliver_to), else recv()
        self._on_closed: Callable[[str], None] | None = None
        self._sink_paused = False

    def _check(self, frame: Frame) -> None:
        # The same limits a socket reader enforces, so tests over inproc mean something.
        lim = self.limits
        sizes = [b.nbytes for b in frame.buffers]
        total = PREFIX_SIZE + len(frame.payload) + sum(sizes)
        if len(frame.payload) > lim.max_payload_bytes:
            raise FrameError(f"payload of {len(frame.payload)} bytes over the limit")
        if total > lim.max_frame_bytes:
            raise FrameError(f"frame of {total} bytes over the limit {lim.max_frame_bytes}")
        if len(sizes) > lim.max_buffers:
            raise FrameError(f"{len(sizes)} buffers over the limit {lim.max_buffers}")

    def _land(self, frame: Frame) -> list[memoryview]:
        """The buffers of ``frame`` as this (receiving) end holds them."""
        if not frame.buffers or self.allocator is default_allocator:
            return [b.toreadonly() for b in frame.buffers]
        sizes = [b.nbytes for b in frame.buffers]
        dests = self.allocator(dict(frame.meta), sizes)
        if [d.nbytes for d in dests] != sizes:
            raise FrameError("allocator returned buffers of the wrong sizes")
        for dest, src in zip(dests, frame.buffers, strict=True):
            dest.cast("B")[:] = src.cast("B")
        return dests

    async def send(self, frame: Frame) -> None:
        remote = self.remote
        if self.close_reason is not None or remote is None:
            raise ConnectionClosed(self.close_reason or "not connected")
        # what a socket's encode_head checks (the meta is not encoded here; it is routing-only)
        check_outgoing(0, len(frame.payload), [b.nbytes for b in frame.buffers], self.limits)
        while len(remote._inbox) >= _QUEUE_FRAMES:
            remote._writable.clear()
            await remote._writable.wait()
            if self.close_reason is not None:
                raise ConnectionClosed(self.close_reason)
        try:
            remote._check(frame)
        except FrameError as exc:
            remote.close(f"protocol error: {exc}")
            self.close(f"peer refused a frame: {exc}")
            raise ConnectionClosed(self.close_reason or "") from exc
        handed = Frame(dict(frame.meta), bytes(frame.payload), remote._land(frame))
        remote._inbox.append(handed)
        remote._readable.set()
        if remote._sink is not None:
            # from the loop, as a socket's data callback would: never inside this send()
            asyncio.get_running_loop().call_soon(remote._push)
        self.bytes_sent += handed.nbytes
        remote.bytes_received += handed.nbytes
        await asyncio.sleep(0)  # let the peer run, as a socket write would

    async def recv(self) -> Frame:
        while not self._inbox:
            if self.close_reason is not None:
                raise ConnectionClosed(self.close_reason)
            self._readable.clear()
            await self._readable.wait()
        frame = self._inbox.popleft()
        if len(self._inbox) < _QUEUE_FRAMES:
            self._writable.set()
        return frame

    def deliver_to(self, sink: FrameSink, closed: Callable[[str], None]) -> None:
        if self._sink is not None:
            raise RuntimeError("deliver_to() was already called on this connection")
        self._sink, self._on_closed = sink, closed
        self._push()  # what arrived during the handshake
        if self.close_reason is not None:
            self._notify_closed()

    def pause_reading(self) -> None:
        self._sink_paused = True

    def resume_reading(self) -> None:
        if self._sink_paused:
            self._sink_paused = False
            asyncio.get_running_loop().call_soon(self._push)

    def _push(self) -> None:
        sink = self._sink
        while sink is not None and self._inbox and not self._sink_paused:
            frame = self._inbox.popleft()
            if len(self._inbox) < _QUEUE_FRAMES:
                self._writable.set()
            try:
                sink(frame)
            except FrameError as exc:
                self.close(f"protocol error: {exc}")
                return

    def _notify_closed(self) -> None:
        callback, self._on_closed = self._on_closed, None
        if callback is not None:
            callback(self.close_reason or "connection closed")

    def close(self, reason: str = "closed locally") -> None:
        if self.close_reason is not None:
            return
        self.close_reason = reason
        self._readable.set()
        self._writable.set()
        self._closed.set()
        if self._sink is not None:
            # after the pushes already scheduled: frames the peer sent before closing come first
            asyncio.get_running_loop().call_soon(self._notify_closed)
        if self.remote is not None:
            self.remote.close("peer closed the connection")

    async def wait_closed(self) -> None:
        await self._closed.wait()


class InprocListener(Listener):
    def __init__(self, name: str, options: TransportOptions, handler: Handler) -> None:
        super().__init__(f"inproc://{name}")
        self.name = name
        self.options = options
        self.handler = handler

    def accept(self, client: InprocConnection) -> None:
        server = InprocConnection(
            f"inproc://{self.name}#{next(_ids)}", Limits.handshake(), self.options.allocator
        )
        server.remote, client.remote = client, server
        self.track(asyncio.get_running_loop().create_task(self._serve(server)))

    async def _serve(self, conn: InprocConnection) -> None:
        try:
            await self.handler(conn)
        finally:
            conn.close("server side finished")

    async def close(self) -> None:
        _LISTENERS.pop(self.name, None)
        await self.cancel_handlers()


_LISTENERS: dict[str, InprocListener] = {}


class InprocTransport(Transport):
    scheme = "inproc"

    async def connect(self, rest: str, options: TransportOptions) -> Connection:
        listener = _LISTENERS.get(rest)
        if listener is None:
            raise ConnectionRefusedError(f"no inproc listener named {rest!r}")
        client = InprocConnection(f"inproc://{rest}", Limits.handshake(), options.allocator)
        listener.accept(client)
        return client

    async def listen(
        self, rest: str, options: TransportOptions, on_connection: Handler
    ) -> Listener:
        name = rest if rest not in ("", "*") else f"auto-{next(_ids)}"
        if name in _LISTENERS:
            raise OSError(f"inproc name {name!r} is already in use")
        listener = InprocListener(name, options, on_connection)
        _LISTENERS[name] = listener
        return listener


register_transport("inproc", InprocTransport)
