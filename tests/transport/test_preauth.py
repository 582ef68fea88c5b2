"""Before the handshake a peer has earned nothing: hundreds of idle or garbage connections cannot
lock members out, nor make the server hold a session-sized buffer for each of them."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import replace

import pytest

from laminar.runtime.context import transport_options
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.transport import Limits
from tests.support.poll import until
from tests.support.procs import TOKEN
from tests.support.roles import Calculator, Pair

IDLE, GARBAGE = 300, 40


@pytest.fixture
def options(cluster):  # type: ignore[no-untyped-def]
    # A long handshake timeout: idle sockets are not simply timed out during the test; only the
    # caps can close them.
    return replace(transport_options(cluster, TOKEN.encode()), handshake_timeout=120.0)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (EOF after its hello); reads without blocking."""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.mark.parametrize("source", ["127.0.0.1", "127.0.0.2"])
async def test_a_member_connects_while_hundreds_of_idle_sockets_are_open(
    serve, options, source
) -> None:  # type: ignore[no-untyped-def]
    host, _ = await serve(Calculator, "tcp://127.0.0.1:0")
    assert host.server is not None
    listener = host.server.listeners[0]
    port = int(host.ctx.address.rsplit(":", 1)[1])
    socks: list[socket.socket] = []
    try:
        loop = asyncio.get_running_loop()
        for i in range(IDLE + GARBAGE):
            s = socket.socket()
            socks.append(s)
            s.setblocking(False)
            s.bind((source, 0))
            await loop.sock_connect(s, ("127.0.0.1", port))  # the server runs in this loop
            if i >= IDLE:
                await loop.sock_sendall(s, os.urandom(64))  # not a frame: closed at once

        cap = options.max_pending_per_peer
        assert cap < IDLE

        async def evicted() -> bool:
            return sum(map(closed_by_server, socks)) >= IDLE + GARBAGE - cap

        # the oldest idle connections are evicted: at most `cap` from one address stay pending
        await until(evicted, 20)
        gate = listener.handshakes
        assert gate is not None and len(gate.pending) <= cap
        # and a pending connection holds a handshake-sized buffer, not a session's 256 KiB
        assert all(conn.reserved_bytes <= 4096 for conn in gate.pending)

        client = RpcClient(host.ctx.address, options, timeout=10.0)
        try:
            assert (await remote(Calculator, client).add.call(Pair(a=20, b=22))).value == 42
        finally:
            await client.close()
    finally:
        for s in socks:
            s.close()


def test_the_staging_buffer_grows_only_after_the_handshake() -> None:
    from laminar.transport.reader import FrameReader

    reader = FrameReader(Limits.handshake())
    assert reader.reserved_bytes <= 4096
    reader.limits = Limits()
    assert reader.reserved_bytes == 256 * 1024
