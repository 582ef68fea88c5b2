"""A task retrying ``connect`` in a loop ends when it is cancelled, whatever the moment.

Why: a relay's forwarder retries refused connects to a dead downstream until its role stops,
which cancels it once. ``connect`` used to time out with ``asyncio.wait_for``, which on Python
3.11 returns (or raises) the inner result instead of ``CancelledError`` when the cancellation
arrives as the inner connect finishes (cpython gh-86296). A refused connect finishes at once, so
about half the cancels were lost and the relay outlived its stop. The cancel is sent after a
seeded number of loop turns so that it lands at every point of the connect and handshake.
"""

from __future__ import annotations

import asyncio
import random
import socket

import pytest

from laminar.transport import TransportOptions, connect
from tests.support.cancel import cancel_after

CANCELS = 100


def _refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed: the kernel refuses it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _cancel_retry_loops(address: str, seed: int) -> None:
    """Start and cancel ``CANCELS`` retry loops; fails at the first that does not end."""
    rng = random.Random(seed)
    options = TransportOptions(token=b"x" * 32)
    for i in range(CANCELS):

        async def retry() -> None:
            while True:
                try:
                    conn = await connect(address, options)
                except Exception:  # refused, reset, handshake failed: retry, as a forwarder does
                    continue
                conn.close("unexpected success")

        task = asyncio.create_task(retry())
        await cancel_after(task, rng.randrange(1, 40), f"cancel {i} of a retry loop (seed {seed})")


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_loop_retrying_a_refused_connect_ends_when_cancelled(seed: int) -> None:
    await _cancel_retry_loops(f"tcp://127.0.0.1:{_refused_port()}", seed)


@pytest.mark.parametrize("seed", [0, 1])
async def test_a_loop_retrying_a_failing_handshake_ends_when_cancelled(seed: int) -> None:
    """The server accepts and hangs up at once: the cancel lands in the handshake too."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await _cancel_retry_loops(f"tcp://127.0.0.1:{port}", seed)
    finally:
        server.close()
        await server.wait_closed()


async def test_the_check_catches_a_swallowed_cancellation() -> None:
    """The helper these tests stand on fails on a task that swallows its first cancellation, and
    ends that task before failing."""

    async def swallows_once() -> None:
        swallowed = False
        while True:
            try:
                await asyncio.sleep(0.001)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed = True

    task = asyncio.create_task(swallows_once())
    with pytest.raises(AssertionError, match="the task went on after its cancellation"):
        await cancel_after(task, 3, "a swallowed cancel")
    assert task.cancelled()
