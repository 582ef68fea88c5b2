"""Shared-memory specifics: SharedBuffer slices are mapped without a copy, ordinary buffers go
inline, and descriptors naming foreign files are refused."""

from __future__ import annotations

import os

import numpy as np
import pytest

from laminar.transport import Frame, FrameError, TransportOptions, connect, listen
from laminar.transport.shm import (
    SHM_TAG_ENV,
    SharedBuffer,
    drop_pages,
    map_segment,
    segment_name,
)

from ..conftest import session_segments

OPTIONS = TransportOptions(token=b"s" * 32)


async def test_shared_buffer_is_mapped_not_copied_and_plain_buffers_go_inline() -> None:
    received: list[Frame] = []
    before = session_segments()  # this worker's: the others create theirs meanwhile

    async def handler(conn):  # type: ignore[no-untyped-def]
        received.append(await conn.recv())
        received.append(await conn.recv())
        await conn.send(Frame({"k": "ok"}))
        await conn.recv()

    listener = await listen("shm://*", OPTIONS, handler)
    conn = await connect(listener.address, OPTIONS)
    shared = SharedBuffer(4 << 20)
    np.frombuffer(shared.view, dtype=np.uint8)[:] = 7
    plain = np.full(2 << 20, 9, dtype=np.uint8)
    await conn.send(Frame({"k": 1}, b"", [shared.view[1 << 20 :]]))
    await conn.send(Frame({"k": 2}, b"", [memoryview(plain)]))
    assert (await conn.recv()).meta == {"k": "ok"}
    shared_view, handed_view = received[0].buffers[0], received[1].buffers[0]
    assert shared_view.nbytes == 3 << 20 and set(bytes(shared_view[:100])) == {7}
    assert handed_view.nbytes == 2 << 20 and set(bytes(handed_view[-100:])) == {9}
    # the sender writes into its shared segment: the receiver's mapping sees it (no copy was made)
    shared.view[1 << 20] = 42
    assert shared_view[0] == 42
    # the plain buffer arrived as a private copy; the only segment is the sender's own
    plain[:] = 1
    assert handed_view[0] == 9
    assert session_segments() - before == {shared.name}
    shared.close()
    assert shared_view[0] == 42  # existing mappings stay valid after unlink
    conn.close()
    await listener.close()


@pytest.mark.parametrize("name", ["../etc/passwd", "laminar-xyz", "other-" + "0" * 32, 5])
def test_map_segment_refuses_foreign_names(name) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FrameError, match="refusing"):
        map_segment(name, 0, 1)


def test_map_segment_checks_bounds() -> None:
    seg = SharedBuffer(4096)
    try:
        with pytest.raises(FrameError, match="4096 bytes"):
            map_segment(seg.name, 4000, 200)
    finally:
        seg.close()


def test_the_session_tag_starts_the_random_part_and_receivers_still_map_it(monkeypatch) -> None:
    monkeypatch.setenv(SHM_TAG_ENV, "beef")
    buf = SharedBuffer(4096)
    try:
        assert buf.name.startswith(f"laminar-{os.getpid():08x}-beef") and len(buf.name) == 41
        view = map_segment(buf.name, 0, 4096)
        assert len(view) == 4096
    finally:
        buf.close()
    monkeypatch.setenv(SHM_TAG_ENV, "not-hex")
    with pytest.raises(ValueError, match=SHM_TAG_ENV):
        segment_name()


def _shmem_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    return 0


def test_drop_pages_leaves_the_resident_set_and_the_bytes_intact() -> None:
    size = 64 << 20
    segment = SharedBuffer(size)
    try:
        source = np.frombuffer(segment.view, dtype=np.uint8)
        source[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
        view = map_segment(segment.name, 0, size)
        mapped = np.frombuffer(view, dtype=np.uint8)
        before = _shmem_kib()
        total = int(mapped.sum(dtype=np.uint64))  # every page of the reader's mapping faulted in
        read = _shmem_kib() - before
        assert read >= (size >> 10) * 0.9, read
        drop_pages(view, 0, size)
        assert _shmem_kib() - before <= read * 0.1
        assert int(mapped.sum(dtype=np.uint64)) == total  # and they come back, unchanged
        drop_pages(memoryview(bytearray(16)), 0, 16)  # not a mapping: nothing to drop
    finally:
        segment.close()
