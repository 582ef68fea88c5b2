"""``ucx://`` through the generic connect()/listen(): framing, limits, auth, peer loss, processes.

Skipped as a whole without the ``ucx`` extra. Runs on CPU only (shared memory and TCP through
UCX), under asyncio's default loop except where uvloop is named.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ucxx")

import laminar.transport.ucx as ucx  # registers ucx://
from laminar.transport import (
    AuthenticationError,
    Connection,
    ConnectionClosed,
    Frame,
    Limits,
    TransportOptions,
    connect,
    listen,
)
from laminar.transport.base import Handler
from laminar.transport.reader import default_allocator

pytestmark = pytest.mark.ucx

TOKEN = b"x" * 32
OPTIONS = TransportOptions(token=TOKEN)
REPO = Path(__file__).resolve().parents[2]


async def echo(conn: Connection) -> None:
    while True:
        frame = await conn.recv()
        await conn.send(Frame(frame.meta, frame.payload, frame.buffers))


@contextlib.asynccontextmanager
async def serving(
    handler: Handler = echo, options: TransportOptions = OPTIONS
) -> AsyncIterator[str]:
    listener = await listen("ucx://127.0.0.1:0", options, handler)
    try:
        yield listener.address
    finally:
        await listener.close()


async def eventually(condition: Any, timeout: float) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout``."""
    start = time.monotonic()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {timeout} s")


class Recording:
    """An allocator that remembers what it handed out."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.views: list[memoryview] = []

    def __call__(self, meta: dict[str, Any], sizes: list[int]) -> list[memoryview]:
        self.calls.append(sizes)
        self.views = default_allocator(meta, sizes)
        return self.views


async def test_listener_address_is_resolved_and_dialable() -> None:
    async with serving() as address:
        match = re.fullmatch(r"ucx://127\.0\.0\.1:(\d+)", address)
        assert match and int(match.group(1)) > 0
        conn = await connect(address, OPTIONS)
        await conn.send(Frame({"k": "ping"}))
        assert (await conn.recv()).meta == {"k": "ping"}
        conn.close()


async def test_small_frames_round_trip_with_meta_payload_and_buffers() -> None:
    grid = np.arange(12, dtype=np.float32).reshape(3, 4)  # 2-D, non-byte format: sent flat
    frames = [
        Frame({"k": 1, "s": "hi", "n": None}, b"payload"),
        Frame({"k": 2}, b"", [memoryview(b"abc"), memoryview(b""), memoryview(bytes(range(256)))]),
        Frame({"k": 3}, b"p" * 100_000, [memoryview(grid)]),  # a head above the eager size
        Frame({"k": 4}),
    ]
    async with serving() as address:
        conn = await connect(address, OPTIONS)
        sent, received = conn.bytes_sent, conn.bytes_received  # after the handshake
        for frame in frames:
            await conn.send(frame)
            back = await conn.recv()
            assert back.meta == frame.meta
            assert bytes(back.payload) == bytes(frame.payload)
            assert [bytes(b) for b in back.buffers] == [b.tobytes() for b in frame.buffers]
        echoed = conn.bytes_sent - sent
        assert echoed == conn.bytes_received - received > sum(f.nbytes for f in frames)
        conn.close()
        await conn.wait_closed()
        with pytest.raises(ConnectionClosed):
            await conn.send(Frame({"k": 5}))


async def test_64_mib_buffer_lands_intact_in_allocator_memory() -> None:
    allocator = Recording()
    seen: list[tuple[int, bool]] = []

    async def check(conn: Connection) -> None:
        frame = await conn.recv()
        (buf,) = frame.buffers
        seen.append((zlib.crc32(buf), buf is allocator.views[0]))
        await conn.send(Frame({"k": "ok"}))

    data = np.frombuffer(np.random.default_rng(0).bytes(64 << 20), dtype=np.uint8)
    async with serving(check, OPTIONS.with_allocator(allocator)) as address:
        conn = await connect(address, OPTIONS)
        await conn.send(Frame({"k": "big"}, b"", [memoryview(data)]))
        assert (await conn.recv()).meta == {"k": "ok"}
        conn.close()
    assert allocator.calls == [[64 << 20]]
    assert seen == [(zlib.crc32(data), True)]  # received straight into the allocator's view


async def test_bf16_tensor_received_into_a_torch_tensor() -> None:
    torch = pytest.importorskip("torch")
    sent = torch.randn(256, 384, dtype=torch.bfloat16)
    landed: list[Any] = []

    def into_tensor(meta: dict[str, Any], sizes: list[int]) -> list[memoryview]:
        landed[:] = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        return [memoryview(t.numpy()) for t in landed]

    async def ack(conn: Connection) -> None:
        await conn.recv()
        await conn.send(Frame({"k": "ok"}))

    async with serving(ack, OPTIONS.with_allocator(into_tensor)) as address:
        conn = await connect(address, OPTIONS)
        await conn.send(Frame({"k": "w"}, b"", [memoryview(sent.view(torch.uint8).numpy())]))
        await conn.recv()
        conn.close()
    assert torch.equal(landed[0].view(torch.bfloat16).reshape(256, 384), sent)


async def test_concurrent_senders_keep_frames_whole_and_ordered_per_sender() -> None:
    got: list[tuple[int, bool]] = []
    done = asyncio.Event()

    async def collect(conn: Connection) -> None:
        for _ in range(20):
            frame = await conn.recv()
            k = frame.meta["k"]
            got.append((k, bytes(frame.buffers[0]) == bytes([k]) * (k * 10_000 + 1)))
        done.set()
        await conn.recv()

    async with serving(collect) as address:
        conn = await connect(address, OPTIONS)
        sends = [
            Frame({"k": k}, b"", [memoryview(bytes([k]) * (k * 10_000 + 1))]) for k in range(20)
        ]
        await asyncio.gather(*(conn.send(frame) for frame in sends))
        await asyncio.wait_for(done.wait(), 5)
        conn.close()
    assert sorted(got) == [(k, True) for k in range(20)]


async def test_cancelled_recv_loses_no_frame() -> None:
    async def later(conn: Connection) -> None:
        await conn.recv()
        await asyncio.sleep(0.1)
        await conn.send(Frame({"k": "late"}, b"", [memoryview(bytes(1 << 20))]))
        await conn.recv()

    async with serving(later) as address:
        conn = await connect(address, OPTIONS)
        await conn.send(Frame({"k": "go"}))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(conn.recv(), 0.02)
        frame = await asyncio.wait_for(conn.recv(), 5)
        assert frame.meta == {"k": "late"} and frame.buffers[0].nbytes == 1 << 20
        conn.close()


async def test_wrong_token_is_refused_and_the_server_keeps_serving() -> None:
    async with serving() as address:
        with pytest.raises(AuthenticationError):
            await connect(address, TransportOptions(token=b"y" * 32))
        conn = await connect(address, OPTIONS)
        await conn.send(Frame({"k": "after"}))
        assert (await conn.recv()).meta == {"k": "after"}
        conn.close()


async def test_frame_over_max_frame_bytes_closes_without_allocating() -> None:
    allocator = Recording()
    reasons: list[str] = []

    async def guarded(conn: Connection) -> None:
        try:
            await conn.recv()
        except ConnectionClosed as exc:
            reasons.append(exc.reason)

    options = TransportOptions(token=TOKEN, limits=Limits(max_frame_bytes=1 << 20))
    async with serving(guarded, options.with_allocator(allocator)) as address:
        conn = await connect(address, OPTIONS)
        with pytest.raises(ConnectionClosed):
            async with asyncio.timeout(2):
                await conn.send(Frame({"k": "huge"}, b"", [memoryview(bytes(8 << 20))]))
                await conn.recv()
        await eventually(lambda: reasons, 2)
    assert len(reasons) == 1 and "over the limit" in reasons[0], reasons
    assert allocator.calls == []


@pytest.mark.parametrize("closer", ["client", "server"])
async def test_peer_close_fails_pending_recv_within_a_second(closer: str) -> None:
    server_side: list[Connection] = []
    outcome: list[float] = []

    async def handler(conn: Connection) -> None:
        server_side.append(conn)
        start = time.monotonic()
        with contextlib.suppress(ConnectionClosed):
            await conn.recv()
            return
        outcome.append(time.monotonic() - start)

    async with serving(handler) as address:
        conn = await connect(address, OPTIONS)
        await eventually(lambda: server_side, 2)
        if closer == "client":
            await asyncio.sleep(0.05)
            conn.close("test done")
            await eventually(lambda: outcome, 1)
            assert outcome[0] < 1
            assert server_side[0].close_reason == "peer closed the connection"
        else:
            pending = asyncio.ensure_future(conn.recv())
            await asyncio.sleep(0.05)
            server_side[0].close("test done")
            with pytest.raises(ConnectionClosed, match="peer closed"):
                await asyncio.wait_for(pending, 10)


async def test_silent_client_is_dropped_after_the_handshake_timeout() -> None:
    options = TransportOptions(token=TOKEN, handshake_timeout=0.3, connect_timeout=0.3)
    async with serving(options=options) as address:
        silent = await ucx.UcxTransport().connect(address.removeprefix("ucx://"), options)
        assert (await silent.recv()).meta["k"] == 1  # the server's hello; we never answer
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(silent.recv(), 2)
        # below the tag swap: a raw UCX endpoint that never speaks is closed by the server
        driver = ucx._driver()
        port = int(address.rsplit(":", 1)[1])
        raw = driver.lib.UCXEndpoint.create(driver.worker, "127.0.0.1", port, True)
        await eventually(lambda: not raw.alive, 2)
        conn = await connect(address, options)
        await conn.send(Frame({"k": "still here"}))
        assert (await conn.recv()).meta == {"k": "still here"}
        conn.close()


async def test_connect_to_a_closed_port_is_refused() -> None:
    listener = await listen("ucx://127.0.0.1:0", OPTIONS, echo)
    address = listener.address
    await listener.close()
    with pytest.raises((ConnectionRefusedError, TimeoutError)):
        await connect(address, TransportOptions(token=TOKEN, connect_timeout=2))


def test_round_trip_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> bytes:
        async with serving() as address:
            conn = await connect(address, OPTIONS)
            await conn.send(Frame({"k": 1}, b"", [memoryview(b"u" * (1 << 20))]))
            frame = await conn.recv()
            conn.close()
            return bytes(frame.buffers[0])

    assert uvloop.run(main()) == b"u" * (1 << 20)


CHILD = """
import asyncio, zlib
import laminar.transport as lt
import laminar.transport.ucx

async def handler(conn):
    while True:
        frame = await conn.recv()
        await conn.send(lt.Frame({"crc": [zlib.crc32(b) for b in frame.buffers]}))

async def main():
    listener = await lt.listen("ucx://127.0.0.1:0", lt.TransportOptions(token=b"x" * 32), handler)
    print(listener.address, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


async def test_256_mib_between_two_processes_and_peer_death() -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        address = (await asyncio.wait_for(child.stdout.readline(), 30)).decode().strip()
        conn = await connect(address, OPTIONS)
        data = np.frombuffer(np.random.default_rng(1).bytes(256 << 20), dtype=np.uint8)
        await conn.send(Frame({"k": "big"}, b"", [memoryview(data)]))
        reply = await asyncio.wait_for(conn.recv(), 30)
        assert reply.meta == {"crc": [zlib.crc32(data)]}
        pending = asyncio.ensure_future(conn.recv())
        await asyncio.sleep(0.05)
        child.kill()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(pending, 10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


def test_import_is_lazy_and_a_missing_extra_says_how_to_install(monkeypatch: Any) -> None:
    probe = "import sys, laminar.transport.ucx; assert 'ucxx' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], cwd=REPO, check=True)
    monkeypatch.setitem(sys.modules, "ucxx", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ucx\]'"):
        ucx._import_ucxx()


def test_asking_whether_ucx_is_there_sets_its_environment_first() -> None:
    """What a relay with ``weights_bind: auto`` does (``laminar.roles.relay``): ask, then listen.
    UCX reads its global options when libucx loads; with ucxx imported first, UCX warned of
    "unused environment variables" (its own and ours) at each relay start."""
    probe = (
        "import asyncio\n"
        "from laminar.roles.relay import default_weights_scheme\n"
        "from laminar.transport import TransportOptions, listen\n"
        "assert default_weights_scheme() == 'ucx'\n"
        "async def main():\n"
        "    listener = await listen('ucx://127.0.0.1:0', TransportOptions(token=b'x' * 32), None)\n"
        "    await listener.close()\n"
        "asyncio.run(main())\n"
        "print('listened')\n"
    )
    # none of UCX's variables inherited: this process set some (importing ucxx sets one)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=clean, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "listened" in done.stdout, done.stderr
    assert "UCX  WARN" not in done.stdout + done.stderr, done.stdout  # UCX logs to stdout
