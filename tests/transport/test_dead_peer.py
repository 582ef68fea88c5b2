"""A peer that stops answering without closing (host crash, cut link, stopped process) is noticed:
pending calls and idle streams fail with PeerUnavailable instead of hanging, and the client
re-dials. The bounds below are generous; what is asserted is *that* it is noticed."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from dataclasses import replace

import pytest

from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import transport_options
from laminar.runtime.errors import PeerUnavailable
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.transport import Connection, TransportOptions, listen
from tests.support.poll import until
from tests.support.procs import SUPPORT_ROLES, TOKEN, laminar, start, stop
from tests.support.roles import Calculator, Item, Pair, Sleep, Tag

NOTICE_BOUND_S = 30.0  # far above the 1 s peer timeout: a bound for a broken build, not a timing


def quick_options(peer_timeout: float = 1.0) -> TransportOptions:
    return replace(transport_options(ClusterConfig(), TOKEN.encode()), peer_timeout=peer_timeout)


@pytest.mark.integration
async def test_a_stopped_server_is_noticed_and_the_client_reconnects() -> None:
    proc, info = start(
        laminar(
            "serve",
            "--role",
            f"{SUPPORT_ROLES}:Calculator",
            "--standalone",
            "--set",
            "calculator.metrics=null",
        )
    )
    client = RpcClient(info["address"], quick_options(), timeout=600)
    proxy = remote(Calculator, client)
    stopped = False
    try:
        assert (await proxy.add.call(Pair(a=1, b=2))).value == 3
        call = asyncio.ensure_future(proxy.sleep.call(Sleep(seconds=600, tag="c")))
        stream = proxy.stall.stream(Sleep(seconds=600, tag="s"))  # no per-item timeout
        assert await anext(stream) == Item(i=0)
        idle = asyncio.ensure_future(anext(stream))
        os.kill(proc.pid, signal.SIGSTOP)  # its kernel still acknowledges; the process is silent
        stopped = True
        done = await asyncio.wait_for(
            asyncio.gather(call, idle, return_exceptions=True), NOTICE_BOUND_S
        )
        assert all(isinstance(r, PeerUnavailable) for r in done), done
        assert "silent" in str(done[0])
        os.kill(proc.pid, signal.SIGCONT)
        stopped = False
        assert (await proxy.add.call(Pair(a=2, b=2))).value == 4  # a fresh connection
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        await client.close()
        stop(proc)


async def test_a_peer_that_never_reads_is_dropped_even_when_we_only_notify() -> None:
    # A real listener that authenticates and then never reads nor answers, like a wedged
    # process. The client sends only one-way calls (as heartbeats do): nothing ever fails on
    # the caller's side, so only the pings can tell; the client must re-dial.
    accepted: list[Connection] = []

    async def mute(conn: Connection) -> None:
        accepted.append(conn)
        await asyncio.Event().wait()

    options = quick_options()
    listener = await listen("tcp://127.0.0.1:0", options, mute)
    client = RpcClient(listener.address, options, timeout=5)
    try:
        proxy = remote(Calculator, client)

        async def redialled() -> bool:
            proxy.note.notify(Tag(tag="beat"))
            return len(accepted) >= 2

        await until(redialled, NOTICE_BOUND_S, interval=0.1)
        first = accepted[0]
        assert first.closed or await _closes(first)
    finally:
        await client.close()
        await listener.close()


async def _closes(conn: Connection) -> bool:
    await asyncio.wait_for(conn.wait_closed(), NOTICE_BOUND_S)
    return True


async def test_a_busy_peer_is_not_mistaken_for_a_dead_one(serve) -> None:  # type: ignore[no-untyped-def]
    # the handler runs three peer timeouts long; the server answers pings meanwhile
    host, _ = await serve(Calculator, "tcp://127.0.0.1:0")
    client = RpcClient(host.ctx.address, quick_options(0.6), timeout=30)
    try:
        reply = await remote(Calculator, client).sleep.call(Sleep(seconds=1.8, tag="busy"))
        assert reply.tag == "busy"
    finally:
        await client.close()


async def test_sockets_give_up_on_a_silent_peer_within_the_peer_timeout() -> None:
    # A crashed host sends no reset: the kernel must stop retransmitting / probing within about
    # the peer timeout instead of ~15 minutes (retransmissions) or 2 hours (keepalive).
    async def idle(conn: Connection) -> None:
        await asyncio.Event().wait()

    options = quick_options(6.0)
    listener = await listen("tcp://127.0.0.1:0", options, idle)
    client = RpcClient(listener.address, options, timeout=5)
    try:
        await client._connection()
        conn = client._conn
        assert conn is not None
        sock = conn._transport.get_extra_info("socket")  # type: ignore[attr-defined]
        get = sock.getsockopt
        assert get(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert get(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 6000
        assert get(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 2
        assert get(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
        assert get(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
    finally:
        await client.close()
        await listener.close()


@pytest.mark.timeout(30)
async def test_a_refused_connection_fails_at_once_not_at_the_call_timeout() -> None:
    """A restarted role listens on a new port: retrying the old one until the call's timeout kept
    rollouts paused and the trainer idle for 30 s (issue 15's chaos benchmark). A refused
    connection fails the call at once, so the caller looks the peer up again."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RpcClient(f"tcp://127.0.0.1:{port}", quick_options(), timeout=600.0)
    try:
        with pytest.raises(PeerUnavailable, match="ConnectionRefusedError"):
            await remote(Calculator, client).add.call(Pair(a=1, b=1))  # 600 s timeout
    finally:
        await client.close()
