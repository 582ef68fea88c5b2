"""Push delivery (``Connection.deliver_to``): what the RPC layer relies on, on every transport.

Frames reach the sink in order, from the event loop, each once; ``closed`` comes once, after the
last frame the peer sent before it closed; a paused sink gets nothing until it resumes, and then
everything, in order; a sink that raises ``FrameError`` closes the connection as a protocol
error. The default implementation (a pump over ``recv()``, for transports without a data
callback) is held to the same contract.
"""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from laminar.transport import Connection, ConnectionClosed, Frame, FrameError, connect, listen
from laminar.transport.frames import Limits
from laminar.transport.reader import default_allocator
from tests.conftest import TRANSPORTS


class Sink:
    def __init__(self) -> None:
        self.frames: list[int] = []
        self.closed: list[str] = []
        self.arrived = asyncio.Event()
        self.ended = asyncio.Event()

    def frame(self, frame: Frame) -> None:
        self.frames.append(frame.meta["n"])
        self.arrived.set()

    def close(self, reason: str) -> None:
        self.closed.append(reason)
        self.ended.set()


async def _pair(bind: str, options):  # type: ignore[no-untyped-def]
    """A connected (client, server) pair over ``bind``."""
    accepted: asyncio.Queue[Connection] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(conn: Connection) -> None:
        await accepted.put(conn)
        await done.wait()

    listener = await listen(bind, options, handler)
    client = await connect(listener.address, options)
    server = await asyncio.wait_for(accepted.get(), 5)
    return listener, done, client, server


async def _settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


@pytest.mark.parametrize("bind", TRANSPORTS)
async def test_frames_in_order_then_closed_once(options, bind) -> None:  # type: ignore[no-untyped-def]
    listener, done, client, server = await _pair(bind, options)
    try:
        await server.send(Frame({"n": 0}))  # before deliver_to: queued, delivered first
        sink = Sink()
        await asyncio.sleep(0.05)
        client.deliver_to(sink.frame, sink.close)
        for n in range(1, 200):
            await server.send(Frame({"n": n}))
        server.close("done sending")
        await asyncio.wait_for(sink.ended.wait(), 5)
        assert sink.frames == list(range(200))
        await _settle()
        assert len(sink.closed) == 1
    finally:
        done.set()
        client.close()
        await listener.close()


@pytest.mark.parametrize("bind", TRANSPORTS)
async def test_a_paused_sink_gets_nothing_until_it_resumes(options, bind) -> None:  # type: ignore[no-untyped-def]
    listener, done, client, server = await _pair(bind, options)
    sink = Sink()

    def first_then_pause(frame: Frame) -> None:
        sink.frame(frame)
        if len(sink.frames) == 1:
            client.pause_reading()

    try:
        client.deliver_to(first_then_pause, sink.close)
        for n in range(6):
            await server.send(Frame({"n": n}))
        await asyncio.wait_for(sink.arrived.wait(), 5)
        await asyncio.sleep(0.1)
        assert sink.frames == [0]
        client.resume_reading()
        for _ in range(100):
            if len(sink.frames) == 6:
                break
            await asyncio.sleep(0.01)
        assert sink.frames == list(range(6))
    finally:
        done.set()
        client.close()
        await listener.close()


@pytest.mark.parametrize("bind", TRANSPORTS)
async def test_a_sink_raising_frame_error_closes_the_connection(options, bind) -> None:  # type: ignore[no-untyped-def]
    listener, done, client, server = await _pair(bind, options)
    sink = Sink()

    def refuse(frame: Frame) -> None:
        raise FrameError("not for me")

    try:
        client.deliver_to(refuse, sink.close)
        await server.send(Frame({"n": 1}))
        await asyncio.wait_for(sink.ended.wait(), 5)
        assert client.closed and "protocol error: not for me" in (client.close_reason or "")
    finally:
        done.set()
        client.close()
        await listener.close()


class QueueConnection(Connection):
    """A connection with only ``recv()``, as a transport without a data callback has: the
    default ``deliver_to`` pumps it."""

    def __init__(self) -> None:
        super().__init__("queue", Limits(), default_allocator)
        self.inbox: deque[Frame] = deque()
        self.ready = asyncio.Event()
        self.ended = asyncio.Event()

    async def send(self, frame: Frame) -> None:
        self.inbox.append(frame)
        self.ready.set()

    async def recv(self) -> Frame:
        while not self.inbox:
            if self.close_reason is not None:
                raise ConnectionClosed(self.close_reason)
            self.ready.clear()
            await self.ready.wait()
        return self.inbox.popleft()

    def close(self, reason: str = "closed locally") -> None:
        if self.close_reason is None:
            self.close_reason = reason
        self.ready.set()
        self.ended.set()

    async def wait_closed(self) -> None:
        await self.ended.wait()


async def test_the_default_pump_keeps_the_same_contract() -> None:
    conn, sink = QueueConnection(), Sink()
    await conn.send(Frame({"n": 0}))

    def first_then_pause(frame: Frame) -> None:
        sink.frame(frame)
        if len(sink.frames) == 1:
            conn.pause_reading()

    conn.deliver_to(first_then_pause, sink.close)
    for n in range(1, 5):
        await conn.send(Frame({"n": n}))
    await _settle()
    assert sink.frames == [0]
    conn.resume_reading()
    await _settle()
    assert sink.frames == [0, 1, 2, 3, 4]
    conn.close("peer gone")
    await asyncio.wait_for(sink.ended.wait(), 5)
    assert sink.closed == ["peer gone"]
    with pytest.raises(RuntimeError, match="already"):
        conn.deliver_to(sink.frame, sink.close)


@pytest.mark.parametrize("bind", TRANSPORTS)
async def test_try_send_sends_only_what_cannot_wait(options, bind) -> None:  # type: ignore[no-untyped-def]
    """``try_send`` (the RPC client's fast path): where it says it sent, the frame arrives as
    with ``send``, in order with the frames sent either way; a frame that could have to wait (one
    that would fill TCP's write buffer, on a closed connection, on a transport that does not
    implement it) is not sent, and ``send`` then still works."""
    listener, done, client, server = await _pair(bind, options)
    sink = Sink()
    server.deliver_to(sink.frame, sink.close)
    try:
        sent = [client.try_send(Frame({"n": 0})), client.try_send(Frame({"n": 1}))]
        # tcp and shm (a tcp-like stream) write at once; inproc keeps the default
        assert sent == ([False, False] if bind.startswith("inproc") else [True, True])
        await client.send(Frame({"n": 2}))
        # over the write buffer's high-water mark (8 MiB): never sent without waiting
        big = Frame({"n": 3}, b"", [memoryview(bytearray(9 << 20))])
        assert not client.try_send(big)
        for _ in range(200):
            if len(sink.frames) == (3 if sent[0] else 1):
                break
            await asyncio.sleep(0.01)
        assert sink.frames == ([0, 1, 2] if sent[0] else [2])
        client.close("done")
        assert not client.try_send(Frame({"n": 4}))
    finally:
        done.set()
        await listener.close()
