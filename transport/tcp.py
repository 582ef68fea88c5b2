"""``tcp://host:port`` (and Unix-domain sockets, used by ``shm://``) over asyncio protocols.

Receiving uses ``asyncio.BufferedProtocol`` with :class:`FrameReader`, so large buffers are read
straight into their destination memory (``recv_into``), several times faster than
``StreamReader``. Sending hands the head and each buffer to the transport without joining them:
uvloop writes a memoryview without copying it, so a sender must not modify a buffer until ``send``
has returned *and* the peer has acknowledged it (the RPC reply does that).

Dead peers: a host that crashed or a link that was cut sends no reset. With the kernel's defaults,
data written to such a peer is retransmitted for ~15 minutes and an idle connection is probed
after 2 hours. Each TCP connection therefore sets ``TCP_USER_TIMEOUT`` (unacknowledged data for
longer than ``peer_timeout`` aborts the connection) and keepalive probes that give up within about
``peer_timeout`` too; the RPC client's pings cover a peer whose kernel still answers but whose
process does not (stopped, or its event loop wedged).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import structlog

from .base import (
    Connection,
    ConnectionClosed,
    FrameSink,
    Handler,
    Listener,
    Transport,
    TransportOptions,
    parse_host_port,
    register_transport,
)
from .frames import Frame, FrameError, Limits, encode_head
from .reader import Allocator, FrameReader

log = structlog.get_logger("laminar.transport")

_WRITE_HIGH_WATER = 8 << 20
_HEAD_ALLOWANCE = 64 << 10  # prefix and meta of a frame, generously
_MAX_QUEUED_FRAMES = 256  # frames parsed but not yet taken by recv(); beyond this stop reading


class StreamConnection(Connection, asyncio.BufferedProtocol):
    """A Connection that is also the asyncio protocol of its socket."""

    def __init__(
        self, peer: str, limits: Limits, allocator: Allocator, peer_timeout: float | None = None
    ) -> None:
        Connection.__init__(self, peer, limits, allocator)
        self.peer_timeout = peer_timeout
        self._reader = FrameReader(limits, allocator)
        self._transport: asyncio.Transport | None = None
        self._frames: deque[Frame] = deque()
        self._recv_waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._closed = asyncio.get_running_loop().create_future()
        self._reading_paused = False
        self._sink: FrameSink | None = None  # push delivery (deliver_to), else recv()
        self._on_closed: Callable[[str], None] | None = None
        self._sink_paused = False
        self.on_made: Callable[[], None] | None = None  # server side: starts the handler

    # -- Connection --

    async def send(self, frame: Frame) -> None:
        if self.close_reason is not None or self._transport is None:
            raise ConnectionClosed(self.close_reason or "not connected")
        self._write(frame)
        if self._drain_waiter is not None:
            await asyncio.shield(self._drain_waiter)
            if self.close_reason is not None:
                raise ConnectionClosed(self.close_reason)

    def try_send(self, frame: Frame) -> bool:
        # Writes never wait below the write buffer's high-water mark: send() waits only once the
        # transport has paused writing (pause_writing), which a frame that keeps the buffer under
        # the mark cannot cause.
        transport = self._transport
        if self.close_reason is not None or transport is None or self._drain_waiter is not None:
            return False
        if transport.get_write_buffer_size() + frame.nbytes + _HEAD_ALLOWANCE >= _WRITE_HIGH_WATER:
            return False
        self._write(frame)
        return True

    def _write(self, frame: Frame) -> None:
        assert self._transport is not None
        head = encode_head(frame, self.limits)
        self._transport.write(head)
        sent = len(head)
        for buf in frame.buffers:
            if buf.nbytes:
                self._transport.write(buf)
                sent += buf.nbytes
        self.bytes_sent += sent

    async def recv(self) -> Frame:
        while not self._frames:
            if self.close_reason is not None:
                raise ConnectionClosed(self.close_reason)
            self._recv_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._recv_waiter
            finally:
                self._recv_waiter = None
        frame = self._frames.popleft()
        if self._reading_paused and len(self._frames) < _MAX_QUEUED_FRAMES // 2:
            self._reading_paused = False
            if self._transport is not None and self.close_reason is None:
                self._transport.resume_reading()
        return frame

    def deliver_to(self, sink: FrameSink, closed: Callable[[str], None]) -> None:
        if self._sink is not None:
            raise RuntimeError("deliver_to() was already called on this connection")
        self._sink, self._on_closed = sink, closed
        if self._reading_paused:  # recv()'s queue bound no longer applies
            self._reading_paused = False
            self._set_reading(True)
        self._push()  # what arrived during the handshake
        if self._closed.done():
            self._notify_closed()

    def pause_reading(self) -> None:
        if not self._sink_paused:
            self._sink_paused = True
            self._set_reading(False)

    def resume_reading(self) -> None:
        if self._sink_paused:
            self._sink_paused = False
            self._push()
            self._set_reading(True)

    def close(self, reason: str = "closed locally") -> None:
        if self.close_reason is None:
            self.close_reason = reason
        if self._transport is not None:
            self._transport.close()
        else:
            self._finish()
        self._wake()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    @property
    def backlog(self) -> int:
        transport = self._transport
        return transport.get_write_buffer_size() if transport is not None else 0

    @property
    def reserved_bytes(self) -> int:
        return self._reader.reserved_bytes

    # -- limits can be raised after the handshake --

    @property
    def limits(self) -> Limits:
        return self._limits

    @limits.setter
    def limits(self, value: Limits) -> None:
        self._limits = value
        if hasattr(self, "_reader"):
            self._reader.limits = value

    # -- asyncio protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer_host = str(peer[0])
            if self.peer == "tcp":  # server side: name the client
                self.peer = f"tcp://{peer[0]}:{peer[1]}"
        self._transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self.peer_timeout is not None:
                set_dead_peer_timeouts(sock, self.peer_timeout)
        if self.on_made is not None:
            self.on_made()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        try:
            frames = self._reader.buffer_updated(nbytes)
            if frames:
                self.deliver(frames)
        except FrameError as exc:
            log.warning("closing connection: malformed input", peer=self.peer, error=str(exc))
            self.close(f"protocol error: {exc}")

    def deliver(self, frames: list[Frame]) -> None:
        """Queue parsed frames for recv() or the sink; subclasses may transform them (FrameError
        closes)."""
        self._frames.extend(frames)
        if self._sink is not None:
            self._push()
            return
        self._wake()
        if len(self._frames) >= _MAX_QUEUED_FRAMES and not self._reading_paused:
            self._reading_paused = True
            assert self._transport is not None
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        if self.close_reason is None:
            self.close_reason = (
                "peer closed the connection"
                if self._reader.idle
                else "peer closed the connection in the middle of a frame"
            )
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.close_reason is None:
            self.close_reason = f"connection lost: {exc}" if exc else "peer closed the connection"
        self._finish()
        self._wake()

    def pause_writing(self) -> None:
        if self._drain_waiter is None:
            self._drain_waiter = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- internals --

    def _push(self) -> None:
        """Hand queued frames to the sink until it pauses or the queue is empty."""
        sink = self._sink
        while sink is not None and self._frames and not self._sink_paused:
            frame = self._frames.popleft()
            try:
                sink(frame)
            except FrameError as exc:
                log.warning("closing connection: protocol error", peer=self.peer, error=str(exc))
                self.close(f"protocol error: {exc}")
                return

    def _set_reading(self, on: bool) -> None:
        transport = self._transport
        if transport is None or self.close_reason is not None:
            return
        if on:
            transport.resume_reading()
        else:
            transport.pause_reading()

    def _notify_closed(self) -> None:
        callback, self._on_closed = self._on_closed, None
        if callback is not None:
            callback(self.close_reason or "connection closed")

    def _wake(self) -> None:
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self) -> None:
        if not self._closed.done():
            self._closed.set_result(None)
        self.resume_writing()
        self._notify_closed()


def set_dead_peer_timeouts(sock: socket.socket, timeout: float) -> None:
    """Make the kernel give up on a silent peer within about ``timeout`` seconds.

    Keepalive: first probe after a third of it, then every third, three probes. User timeout:
    data unacknowledged for ``timeout`` aborts the connection (it also bounds keepalive on Linux).
    Options the platform lacks are skipped; the RPC client's pings still apply.
    """
    step = max(1, math.ceil(timeout / 3))
    options = [
        ("TCP_KEEPIDLE", step),
        ("TCP_KEEPINTVL", step),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", max(1, int(timeout * 1000))),
    ]
    for name, value in options:
        opt = getattr(socket, name, None)
        if opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class StreamListener(Listener):
    def __init__(self, server: asyncio.Server, address: str) -> None:
        super().__init__(address)
        self._server = server

    async def close(self) -> None:
        self._server.close()
        await self.cancel_handlers()
        await self._server.wait_closed()


def protocol_factory(
    options: TransportOptions,
    listener_box: list[StreamListener],
    handler: Handler,
    label: str,
    cls: type[StreamConnection] = StreamConnection,
) -> Any:
    """Server-side factory: each accepted connection gets a handler task on the listener."""

    def factory() -> StreamConnection:
        conn = cls(label, Limits.handshake(), options.allocator, options.peer_timeout)
        listener = listener_box[0]

        async def serve() -> None:
            try:
                await handler(conn)
            finally:
                conn.close("server side finished")

        # started from connection_made, so the handler sees the peer's address (the handshake
        # gate caps pending connections per address)
        conn.on_made = lambda: listener.track(asyncio.get_running_loop().create_task(serve()))
        return conn

    return factory


class TcpTransport(Transport):
    scheme = "tcp"

    async def connect(self, rest: str, options: TransportOptions) -> Connection:
        host, port = parse_host_port("tcp", rest)
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: StreamConnection(
                f"tcp://{host}:{port}", Limits.handshake(), options.allocator, options.peer_timeout
            ),
            host,
            port,
        )
        return conn

    async def listen(
        self, rest: str, options: TransportOptions, on_connection: Handler
    ) -> Listener:
        host, port = parse_host_port("tcp", rest)
        box: list[StreamListener] = []
        server = await asyncio.get_running_loop().create_server(
            protocol_factory(options, box, on_connection, "tcp"), host, port, reuse_address=True
        )
        bound = server.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        box.append(StreamListener(server, f"tcp://{shown}:{bound[1]}"))
        return box[0]


register_transport("tcp", TcpTransport)
