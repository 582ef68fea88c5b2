"""A connection runs at most ``max_in_flight`` requests at once; beyond that the server reads a
little ahead and then stops reading, so the transport's flow control pushes back on the sender.
Pings and cancels are still handled while requests wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from pydantic import BaseModel

from laminar.runtime.endpoint import endpoint
from laminar.runtime.rpc.server import (
    K_CALL,
    K_CANCEL,
    K_PING,
    K_PONG,
    K_REPLY,
    RpcServer,
    encode_model,
)
from laminar.transport import Blob, Connection, Frame, connect
from tests.support.poll import until


class Hold(BaseModel):
    tag: int
    pad: Blob | None = None


class Gate:
    """Handlers that wait until the test lets them finish."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.release = asyncio.Event()

    @endpoint
    async def hold(self, req: Hold) -> Hold:
        self.started.append(req.tag)
        await self.release.wait()
        return Hold(tag=req.tag)


@pytest.fixture
async def gate(options) -> AsyncIterator[tuple[Gate, RpcServer]]:  # type: ignore[no-untyped-def]
    target = Gate()
    server = RpcServer(target, options, role="gate", instance="gate-0", max_in_flight=2)
    yield target, server
    target.release.set()
    await server.close()


async def _send_hold(conn: Connection, call_id: int, pad: bytes | None = None) -> None:
    payload, buffers = encode_model(Hold(tag=call_id, pad=Blob(pad) if pad else None))
    await conn.send(Frame({"k": K_CALL, "i": call_id, "m": "hold"}, payload, buffers))


async def _probe(value: object) -> object:
    return value


@pytest.mark.parametrize("bind", ["tcp://127.0.0.1:0", "inproc://*"])
async def test_requests_beyond_the_bound_wait_while_pings_and_cancels_pass(
    gate, options, bind
) -> None:  # type: ignore[no-untyped-def]
    target, server = gate
    listener = await server.listen(bind)
    conn = await connect(listener.address, options)
    try:
        for call_id in range(1, 4):  # two run, the third is read ahead and held
            await _send_hold(conn, call_id)
        await conn.send(Frame({"k": K_CANCEL, "i": 3}))  # its caller gives up before it starts
        await _send_hold(conn, 4)
        await conn.send(Frame({"k": K_PING}))
        pong = await asyncio.wait_for(conn.recv(), 5)
        # the server has read every frame before the ping, and still started only two
        assert pong.meta["k"] == K_PONG
        assert target.started == [1, 2]
        target.release.set()
        replies = [(await asyncio.wait_for(conn.recv(), 5)).meta for _ in range(3)]
        assert sorted(m["i"] for m in replies) == [1, 2, 4]  # 3 never ran
        assert all(m["k"] == K_REPLY for m in replies)
        assert target.started == [1, 2, 4]
    finally:
        conn.close()


async def test_a_full_connection_stops_reading_so_tcp_pushes_back(gate, options) -> None:  # type: ignore[no-untyped-def]
    target, server = gate
    listener = await server.listen("tcp://127.0.0.1:0")
    conn = await connect(listener.address, options)
    pad = bytes(64 << 10)
    count = 600  # ~38 MiB: more than the server's frame queue and both socket buffers hold

    async def flood() -> None:
        for call_id in range(1, count + 1):
            await _send_hold(conn, call_id, pad)

    sender = asyncio.create_task(flood())
    try:
        await until(lambda: _probe(len(target.started) == 2 and conn.backlog > 0), 10)
        # With the bound the sender stays blocked in send() for good; without it the server would
        # read every frame (and start every handler) within milliseconds.
        done, _ = await asyncio.wait({sender}, timeout=0.5)
        assert not done and target.started == [1, 2]
        target.release.set()
        await asyncio.wait_for(sender, 30)
        await until(lambda: _probe(len(target.started) == count), 30)
    finally:
        sender.cancel()
        conn.close()


async def test_a_connection_that_stopped_reading_still_answers_pings(options) -> None:  # type: ignore[no-untyped-def]
    """Its peer's pings wait unread behind the held requests: pongs go out unasked instead, so
    a busy server is not taken for a dead one and cut off."""
    target = Gate()
    options = replace(options, peer_timeout=0.3)
    server = RpcServer(target, options, role="gate", instance="gate-0", max_in_flight=1)
    listener = await server.listen("tcp://127.0.0.1:0")
    conn = await connect(listener.address, options)
    try:
        for call_id in (1, 2, 3):  # one runs, one is held, the third is not read
            await _send_hold(conn, call_id)
        await conn.send(Frame({"k": K_PING}))
        pong = await asyncio.wait_for(conn.recv(), 10)
        assert pong.meta["k"] == K_PONG and target.started == [1]
        target.release.set()
        replies = set()
        while len(replies) < 3:
            frame = await asyncio.wait_for(conn.recv(), 5)
            if frame.meta["k"] == K_REPLY:
                replies.add(frame.meta["i"])
        assert target.started == [1, 2, 3]
    finally:
        target.release.set()
        conn.close()
        await server.close()
