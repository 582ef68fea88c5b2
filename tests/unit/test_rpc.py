"""Typed call / notify / stream round trips, errors, timeouts and cancellation, on every transport
that runs in one process (tcp, inproc, shm)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from laminar.runtime.errors import (
    BadRequest,
    CallTimeout,
    PeerUnavailable,
    RemoteError,
    UnknownMethod,
)
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.transport import Blob
from tests.conftest import TRANSPORTS
from tests.support.poll import until
from tests.support.roles import Calculator, Pair, Payload, Sleep, Tag, Upto

#: A bound on waiting for the server to see a call (or its cancellation): a hang, never a timing.
SEEN_S = 30.0

pytestmark = pytest.mark.parametrize("bind", TRANSPORTS)


@pytest.fixture
async def calc(serve, options, bind):  # type: ignore[no-untyped-def]
    host, service = await serve(Calculator, bind)
    client = RpcClient(host.ctx.address, options, timeout=5.0)
    yield remote(Calculator, client), service
    await client.close()


async def test_call_returns_typed_reply(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, _ = calc
    reply = await proxy.add.call(Pair(a=2, b=40))
    assert reply.value == 42
    # many calls in flight on one connection are matched to their replies
    replies = await asyncio.gather(*(proxy.add.call(Pair(a=i, b=i)) for i in range(200)))
    assert [r.value for r in replies] == [2 * i for i in range(200)]


async def test_notify_runs_without_reply(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, service = calc
    proxy.note.notify(Tag(tag="one"))
    proxy.note.notify(Tag(tag="two"))
    # fire-and-forget: delivery is not ordered with later calls, but notifies keep their order
    await until(lambda: asyncio.sleep(0, len(service.notes) == 2), SEEN_S)
    assert service.notes == ["one", "two"]
    proxy.fail.notify(Tag(tag="ignored"))  # a failing one-way call is logged, never raised here
    assert (await proxy.add.call(Pair(a=1, b=2))).value == 3


async def test_stream_yields_items_in_order(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, _ = calc
    items = [item.i async for item in proxy.count.stream(Upto(n=50))]
    assert items == list(range(50))
    assert [item async for item in proxy.count.stream(Upto(n=0))] == []


async def test_stream_error_arrives_after_items(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, _ = calc
    got = []
    with pytest.raises(RemoteError) as info:
        async for item in proxy.count.stream(Upto(n=10, fail_at=3)):
            got.append(item.i)
    assert got == [0, 1, 2]
    assert info.value.cause_type == "RuntimeError" and info.value.method == "count"


async def test_remote_exception_names_role_method_and_cause(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, _ = calc
    with pytest.raises(RemoteError) as info:
        await proxy.fail.call(Tag(tag="x"))
    err = info.value
    assert (err.role, err.method, err.cause_type) == ("calculator", "fail", "ValueError")
    assert "refusing 'x'" in str(err) and "calculator" in str(err)
    assert "ValueError" in (err.remote_traceback or "")
    assert (await proxy.add.call(Pair(a=1, b=1))).value == 2  # connection still fine


async def test_bad_request_never_reaches_the_handler(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, service = calc
    client = proxy.client
    with pytest.raises(BadRequest) as info:
        await client.call("sleep", Pair(a=1, b=2), None)  # wrong model for this endpoint
    assert "seconds" in str(info.value)
    assert service.started == []
    with pytest.raises(UnknownMethod):
        await client.call("nope", None, None)
    with pytest.raises(BadRequest):
        await client.call("count", Upto(n=1), None)  # a stream endpoint called as a call


async def test_client_side_type_check(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, _ = calc
    with pytest.raises(TypeError, match="expects one Pair"):
        await proxy.add.call(Tag(tag="x"))


@pytest.mark.parametrize("connected", [False, True], ids=["connecting", "connected"])
async def test_timeout_raises_and_cancels_on_server(calc, connected) -> None:  # type: ignore[no-untyped-def]
    # A connected client times out the reply alone (a timer on its future; RpcClient.call), a
    # connecting one the connection, the send and the reply (asyncio.timeout): both must.
    proxy, service = calc
    if connected:
        await proxy.add.call(Pair(a=1, b=1))
    with pytest.raises(CallTimeout) as info:
        await proxy.sleep.options(timeout=0.2).call(Sleep(seconds=30, tag="slow"))
    assert info.value.method == "sleep"
    await until(lambda: asyncio.sleep(0, "slow" in service.cancelled), SEEN_S)
    assert service.cancelled == ["slow"] and service.finished == []


@pytest.mark.parametrize("connected", [False, True], ids=["connecting", "connected"])
async def test_caller_cancellation_reaches_server(calc, connected) -> None:  # type: ignore[no-untyped-def]
    proxy, service = calc
    if connected:
        await proxy.add.call(Pair(a=1, b=1))
    task = asyncio.create_task(proxy.sleep.call(Sleep(seconds=30, tag="c1")))
    await until(lambda: asyncio.sleep(0, "c1" in service.started), SEEN_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def cancelled() -> bool:
        return "cancelled:c1" in (await proxy.history.call()).tags

    await until(cancelled, SEEN_S)


async def test_abandoned_stream_is_cancelled(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, _ = calc
    async for item in proxy.count.stream(Upto(n=1_000_000)):
        if item.i == 5:
            break
    assert (await proxy.add.call(Pair(a=3, b=4))).value == 7


async def test_blobs_travel_out_of_band(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, _ = calc
    big = np.arange(3 << 20, dtype=np.uint8)
    small = b"tiny"
    digest = await proxy.digest.call(
        Payload(name="w", data=Blob(big), extra=[Blob(small), Blob(b"")])
    )
    expected = 0
    for buf in (memoryview(big), memoryview(small), memoryview(b"")):
        expected = (expected * 31 + sum(buf[::4096])) % (1 << 61)
    assert digest.sizes == [3 << 20, 4, 0] and digest.checksum == expected
    back = await proxy.mirror.call(Payload(name="m", data=Blob(big)))
    assert bytes(back.data) == big.tobytes()


async def test_server_gone_fails_pending_calls_and_reconnect_backs_off(  # type: ignore[no-untyped-def]
    serve, options, bind
) -> None:
    host, service = await serve(Calculator, bind)
    client = RpcClient(host.ctx.address, options, timeout=5.0)
    proxy = remote(Calculator, client)
    pending = asyncio.create_task(proxy.sleep.call(Sleep(seconds=30, tag="p")))
    await until(lambda: asyncio.sleep(0, bool(service.started)), SEEN_S)
    host.stop()
    with pytest.raises(PeerUnavailable):  # the stop fails it; had it run its 30 s, it would return
        await pending
    with pytest.raises(PeerUnavailable):  # nobody listens now: fails within the call timeout
        await proxy.add.options(timeout=0.5).call(Pair(a=1, b=1))
    await client.close()


async def test_stalled_stream_times_out_as_call_timeout(calc) -> None:  # type: ignore[no-untyped-def]
    proxy, service = calc
    got = []
    with pytest.raises(CallTimeout):
        async for item in proxy.stall.options(timeout=0.3).stream(Sleep(seconds=30, tag="st")):
            got.append(item.i)
    assert got == [0]
    await until(lambda: asyncio.sleep(0, "st" in service.cancelled), SEEN_S)
    assert service.cancelled == ["st"]  # the server-side generator was cancelled too
