"""No endpoint runs for a peer that does not hold the cluster token."""

from __future__ import annotations

import asyncio

import pytest

from laminar.runtime.context import transport_options
from laminar.runtime.errors import PeerUnavailable
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.rpc.server import K_CALL
from laminar.transport import Frame, TransportOptions, encode_payload
from laminar.transport.frames import encode_head
from tests.conftest import TRANSPORTS
from tests.support.roles import Calculator, Pair, Sleep


@pytest.mark.parametrize("bind", TRANSPORTS)
async def test_wrong_token_is_refused_before_any_endpoint(serve, cluster, options, bind) -> None:
    host, service = await serve(Calculator, bind)
    wrong = transport_options(cluster, b"this-is-not-the-cluster-token")
    client = RpcClient(host.ctx.address, wrong, timeout=2.0)
    with pytest.raises(PeerUnavailable, match="bad cluster token"):
        await remote(Calculator, client).sleep.call(Sleep(seconds=0, tag="intruder"))
    await client.close()
    assert service.started == []
    good = RpcClient(host.ctx.address, options)
    assert (await remote(Calculator, good).add.call(Pair(a=1, b=1))).value == 2
    await good.close()


async def test_missing_handshake_closes_connection_without_running_anything(serve) -> None:
    host, service = await serve(Calculator, "tcp://127.0.0.1:0")
    hostname, port = host.ctx.address.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(hostname, int(port))
    payload, _ = encode_payload({"seconds": 0, "tag": "no-handshake"})
    writer.write(encode_head(Frame({"k": K_CALL, "i": 1, "m": "sleep"}, payload)))
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)  # the server's hello, then it closes
    writer.close()
    assert data.startswith(b"LMNR")
    assert service.started == []


def test_short_tokens_are_rejected() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        TransportOptions(token=b"short")


async def test_a_handshake_that_times_out_is_retried_not_refused(serve, options) -> None:
    """A peer too busy to answer the handshake in time (a host under load) is slow, not an
    impostor: the client retries until the call's own timeout. (A handshake timeout read as a
    refusal failed a call at once: test_multihost under load, 2026-11-23.)"""
    from dataclasses import replace

    held: list[asyncio.StreamWriter] = []
    answered = asyncio.Event()

    async def mute_then_proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The first connection hears nothing (its handshake times out); later ones are piped
        # through to a real server.
        if not held:
            held.append(writer)
            return
        up_reader, up_writer = await asyncio.open_connection(real_host, int(real_port))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
            dst.close()

        answered.set()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    host, _ = await serve(Calculator, "tcp://127.0.0.1:0")
    real_host, real_port = host.ctx.address.removeprefix("tcp://").rsplit(":", 1)
    mute = await asyncio.start_server(mute_then_proxy, "127.0.0.1", 0)
    port = mute.sockets[0].getsockname()[1]
    quick = replace(options, handshake_timeout=0.2)
    client = RpcClient(f"tcp://127.0.0.1:{port}", quick, timeout=10.0)
    try:
        assert (await remote(Calculator, client).add.call(Pair(a=2, b=3))).value == 5
        assert answered.is_set()
    finally:
        await client.close()
        for writer in held:
            writer.close()
        mute.close()
