"""Streams are flow-controlled by credit: the producer sends at most the consumer's window of
items ahead of what the consumer has taken, so a slow consumer holds the producer instead of
queueing everything the producer can make (laminar/runtime/rpc/calls.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pydantic import BaseModel

from laminar.runtime.endpoint import stream
from laminar.runtime.rpc.client import RpcClient
from laminar.runtime.rpc.server import RpcServer
from laminar.runtime.rpc.wire import K_STREAM, encode_model
from laminar.transport import Frame, connect
from tests.support.poll import until


class Item(BaseModel):
    n: int


class Producer:
    """A stream that never ends on its own and never waits: only credit can hold it."""

    def __init__(self) -> None:
        self.made = 0

    @stream
    async def count(self) -> AsyncIterator[Item]:
        while True:
            self.made += 1
            yield Item(n=self.made)


@pytest.fixture
async def producer(options):  # type: ignore[no-untyped-def]
    target = Producer()
    server = RpcServer(target, options, role="producer", instance="producer-0")
    yield target, server
    await server.close()


async def _settle(target: Producer) -> int:
    """Let the loop run until the producer stops making items; how many it made."""
    while True:
        before = target.made
        for _ in range(200):
            await asyncio.sleep(0)
        if target.made == before:
            return before


@pytest.mark.parametrize("bind", ["tcp://127.0.0.1:0", "inproc://*"])
async def test_a_slow_consumer_holds_the_producer_to_its_window(producer, options, bind) -> None:  # type: ignore[no-untyped-def]
    target, server = producer
    listener = await server.listen(bind)
    client = RpcClient(listener.address, options, stream_window=8)
    items = client.stream("count", None, Item)
    try:
        assert (await anext(items)).n == 1
        made = await _settle(target)
        # the window, plus the item the generator made while it waited for credit
        assert made <= 8 + 1, made
        taken = [(await anext(items)).n for _ in range(40)]  # taking tops the window up
        assert taken == list(range(2, 42))
        assert 41 < await _settle(target) <= 41 + 8 + 1
    finally:
        await items.aclose()  # type: ignore[attr-defined]
        await client.close()
    await until(lambda: _no_streams(server), 5)


async def _no_streams(server: RpcServer) -> bool:
    return not server.connections


async def test_a_stream_without_a_window_is_not_held(producer, options) -> None:  # type: ignore[no-untyped-def]
    """An old client sends no window (``c``): its stream runs as before, held only by the
    transport, so mixing versions never deadlocks a stream."""
    target, server = producer
    listener = await server.listen("inproc://*")
    conn = await connect(listener.address, options)
    try:
        payload, buffers = encode_model(None)
        await conn.send(Frame({"k": K_STREAM, "i": 1, "m": "count"}, payload, buffers))
        for _ in range(200):
            assert (await asyncio.wait_for(conn.recv(), 5)).meta["i"] == 1
        assert target.made >= 200
    finally:
        conn.close()


async def test_a_bad_window_or_credit_closes_the_connection(producer, options) -> None:  # type: ignore[no-untyped-def]
    from laminar.runtime.rpc.wire import K_CREDIT

    _, server = producer
    listener = await server.listen("inproc://*")
    for meta in ({"k": K_STREAM, "i": 1, "m": "count", "c": 0}, {"k": K_CREDIT, "i": 1, "n": -3}):
        conn = await connect(listener.address, options)
        payload, buffers = encode_model(None)
        await conn.send(Frame(meta, payload, buffers))
        await asyncio.wait_for(conn.wait_closed(), 5)
        assert conn.closed


async def test_a_held_stream_cancelled_before_it_starts_leaves_no_credit() -> None:
    from laminar.runtime.rpc.calls import Calls

    release = asyncio.Event()

    async def handler(frame: Frame) -> None:
        await release.wait()

    calls = Calls(1, handler, on_room=lambda: None)
    calls.submit(Frame({"k": K_STREAM, "i": 1, "m": "count"}))  # runs
    calls.open_stream(1, 8)
    calls.open_stream(2, 8)
    calls.submit(Frame({"k": K_STREAM, "i": 2, "m": "count"}))  # held: the bound is one
    calls.cancel(2)  # its caller gave up before it started
    assert set(calls.credits) == {1} and not calls.held
    release.set()
    await calls.cancel_all()
