"""Throw garbage at a live server: random bytes, truncated frames, oversized lengths, bad msgpack,
bad handshakes, and valid handshakes followed by malformed session frames. Afterwards the server
still answers a good client, no connection is left open and no task leaked."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laminar.runtime.config import ClusterConfig, ServiceConfig
from laminar.runtime.context import ServiceContext, transport_options
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.service import ServiceHost
from laminar.transport import Frame
from laminar.transport.base import K_AUTH
from laminar.transport.frames import PREFIX, encode_head
from tests.support.procs import TOKEN
from tests.support.roles import Calculator, Pair

CASES = 2000


def raw_frame(
    meta: object, payload: bytes = b"", buffers: bytes = b"", *, lie: tuple = ()
) -> bytes:
    meta_bytes = msgpack.packb(meta)
    fields = [len(meta_bytes), len(payload), len(buffers)]
    for index, value in lie:
        fields[index] = value if index == 2 else min(value, 2**32 - 1)  # u32, u32, u64
    return PREFIX.pack(b"LMNR", 1, *fields) + meta_bytes + payload + buffers


small_values = st.one_of(
    st.none(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.lists(st.integers(0, 1 << 40), max_size=3),
)
metas = st.dictionaries(
    st.sampled_from(["k", "i", "m", "b", "e", "shm", "nonce", "mac", "cnonce"]),
    small_values,
    max_size=5,
)
session_kinds = st.fixed_dictionaries(
    {
        "k": st.sampled_from([16, 17, 18, 19, 20, 21, 22, 23, 99]),
        "i": st.one_of(st.integers(-3, 5), st.text(max_size=3)),
        "m": st.sampled_from(["add", "sleep", "count", "digest", "nope", ""]),
    }
)
payloads = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda v: msgpack.packb(v), small_values),
    st.just(msgpack.packb({"a": 1, "b": 2})),
    st.just(msgpack.packb({"seconds": 1e9, "tag": "t"})),
    st.just(msgpack.packb({"n": 10**6})),
)

frame_bytes = st.one_of(
    st.binary(max_size=300),  # noise
    st.builds(lambda m, p: raw_frame(m, p), metas, payloads),
    st.builds(lambda m, p, n: raw_frame(m, p)[:n], session_kinds, payloads, st.integers(0, 60)),
    st.builds(lambda m, p: raw_frame(m, p), session_kinds, payloads),
    st.builds(
        lambda m, i, v: raw_frame(m, lie=((i, v),)),
        metas,
        st.integers(0, 2),
        st.sampled_from([0, 2**31, 2**32 - 1, 2**40, 2**64 - 1]),
    ),  # lying lengths
    st.builds(lambda n: PREFIX.pack(b"LMNR", 1, 10, 0, 0) + b"\xc1" * n, st.integers(1, 10)),
    st.builds(lambda v: PREFIX.pack(b"LMNR", v, 1, 0, 0) + b"\x80", st.integers(0, 255)),
    st.builds(
        lambda sizes: raw_frame(
            {"k": 16, "i": 1, "m": "digest", "b": sizes}, buffers=b"z" * min(sum(sizes), 64)
        ),
        st.lists(st.integers(0, 1 << 20), max_size=3),
    ),
)
attacks = st.tuples(
    st.sampled_from(["before_auth", "bad_auth", "after_auth"]),
    st.lists(frame_bytes, min_size=1, max_size=4),
)


async def attack(address: str, mode: str, chunks: list[bytes]) -> None:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if mode != "before_auth":
            hello = await reader.readexactly(24)
            _, _, meta_len, payload_len, _ = PREFIX.unpack(hello)
            meta = msgpack.unpackb(await reader.readexactly(meta_len + payload_len))
            cnonce = os.urandom(32)
            key = TOKEN.encode() if mode == "after_auth" else b"wrong-token-000000000"
            mac = hmac.new(key, b"client" + meta["nonce"] + cnonce, hashlib.sha256).digest()
            writer.write(encode_head(Frame({"k": K_AUTH, "cnonce": cnonce, "mac": mac})))
        for chunk in chunks:
            writer.write(chunk)
        writer.write_eof()
        async with asyncio.timeout(5):
            while await reader.read(65536):  # the server must close its side
                pass
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def test_fuzz_live_server_survives_and_leaks_nothing() -> None:
    loop = asyncio.new_event_loop()
    cluster = ClusterConfig()
    options = transport_options(cluster, TOKEN.encode())
    ctx = ServiceContext(
        role="calculator",
        instance="fuzzed",
        cluster=cluster,
        config=ServiceConfig(metrics=None),
        options=options,
    )
    host = ServiceHost(Calculator, ctx)
    runner = loop.create_task(host.run())
    service = loop.run_until_complete(host.started())
    baseline = len(asyncio.all_tasks(loop))
    seen = {"before_auth": 0, "bad_auth": 0, "after_auth": 0}

    @settings(
        max_examples=CASES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(attacks)
    def run(case: tuple[str, list[bytes]]) -> None:
        seen[case[0]] += 1
        loop.run_until_complete(attack(ctx.address, *case))

    try:
        run()
        assert sum(seen.values()) >= CASES and min(seen.values()) > 100, seen

        async def good_client() -> int:
            client = RpcClient(ctx.address, options)
            try:
                return (await remote(Calculator, client).add.call(Pair(a=20, b=22))).value
            finally:
                await client.close()

        assert loop.run_until_complete(good_client()) == 42

        async def settle() -> None:
            for _ in range(200):
                if not host.server.connections and len(asyncio.all_tasks()) - 1 <= baseline:
                    return
                await asyncio.sleep(0.01)

        loop.run_until_complete(settle())
        assert host.server.connections == set()
        leaked = [t for t in asyncio.all_tasks(loop)]
        assert len(leaked) <= baseline, [t.get_coro() for t in leaked]
        # no "sleep" the fuzzer managed to start is still running
        assert len(service.started) == len(service.cancelled) + len(service.finished)
    finally:
        host.stop()
        loop.run_until_complete(runner)
        loop.close()
