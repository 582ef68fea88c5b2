"""The wire format and the sans-I/O reader: any chunking of valid frames parses back exactly;
limits are enforced before allocation."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.transport import (
    Blob,
    Frame,
    FrameError,
    Limits,
    TransportOptions,
    connect,
    decode_payload,
    encode_payload,
    listen,
)
from laminar.transport.frames import PREFIX, encode_head
from laminar.transport.reader import FrameReader
from tests.conftest import TRANSPORTS

metas = st.dictionaries(
    st.sampled_from(["k", "i", "m", "x"]),
    st.one_of(st.integers(-5, 1 << 40), st.text(max_size=20), st.binary(max_size=20)),
    max_size=4,
)
buffers = st.lists(st.binary(max_size=3000), max_size=4)
payload_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 60), 1 << 60),
        st.floats(allow_nan=False),
        st.text(max_size=30),
        st.binary(max_size=30),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def wire(frame: Frame) -> bytes:
    return encode_head(frame) + b"".join(bytes(b) for b in frame.buffers)


def feed(reader: FrameReader, data: bytes, cuts: list[int]) -> list[Frame]:
    frames: list[Frame] = []
    pos = 0
    for cut in sorted({min(c, len(data)) for c in cuts} | {len(data)}):
        while pos < cut:
            buf = reader.get_buffer(-1)
            n = min(len(buf), cut - pos)
            buf[:n] = data[pos : pos + n]
            frames += reader.buffer_updated(n)
            pos += n
    return frames


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(metas, payload_values, buffers), min_size=1, max_size=6),
    st.lists(st.integers(0, 40_000), max_size=30),
)
def test_any_chunking_round_trips(items, cuts) -> None:
    frames = []
    for meta, value, bufs in items:
        payload, _ = encode_payload(value)
        frames.append(Frame(dict(meta), payload, [memoryview(b) for b in bufs]))
    data = b"".join(wire(f) for f in frames)
    reader = FrameReader(Limits())
    got = feed(reader, data, cuts)
    assert reader.idle
    assert len(got) == len(frames)
    for sent, received in zip(frames, got, strict=True):
        assert received.meta == {k: v for k, v in sent.meta.items() if k != "b"}
        assert bytes(received.payload) == bytes(sent.payload)
        assert [bytes(b) for b in received.buffers] == [bytes(b) for b in sent.buffers]


@settings(max_examples=200, deadline=None)
@given(payload_values, st.lists(st.binary(max_size=100), max_size=3))
def test_payload_with_blobs_round_trips(value, blobs) -> None:
    obj = {"v": value, "blobs": [Blob(b) for b in blobs]}
    payload, bufs = encode_payload(obj)
    assert len(bufs) == len(blobs)
    back = decode_payload(payload, bufs)
    assert back["v"] == value
    assert [bytes(b) for b in back["blobs"]] == blobs


def test_threads_encoding_at_once_keep_their_own_buffers() -> None:
    """encode_payload reuses one packer per thread (transport.frames._Encoder): messages with
    blobs and typed arrays encoded on several threads at once, and one whose encoding fails
    half-way, never lend each other a buffer or leave one behind."""
    import numpy as np

    from laminar.transport.arrays import PackedArray

    def one(tag: int) -> None:
        for n in range(300):
            blobs = [Blob(bytes([tag]) * (n % 7 + 1)) for _ in range(n % 3)]
            ids = PackedArray(list(range(tag, tag + n % 50)), np.dtype("int32"))
            payload, bufs = encode_payload({"t": tag, "blobs": blobs, "ids": ids})
            back = decode_payload(payload, bufs)
            assert back["t"] == tag and back["ids"] == list(range(tag, tag + n % 50))
            assert [bytes(b) for b in back["blobs"]] == [bytes(b) for b in blobs]
            with pytest.raises(TypeError, match="cannot send"):
                encode_payload({"blob": Blob(b"x"), "bad": object()})

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: inside the packing too
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(1, 9)))
    finally:
        sys.setswitchinterval(interval)
    payload, bufs = encode_payload({"after": 1})
    assert bufs == [] and decode_payload(payload, bufs) == {"after": 1}


def test_large_buffer_lands_in_allocator_memory_without_staging() -> None:
    target = bytearray(5 << 20)
    reader = FrameReader(Limits(), allocator=lambda meta, sizes: [memoryview(target)])
    data = wire(Frame({"k": 1}, b"", [memoryview(bytes(range(256)) * (5 << 12))]))
    frames = feed(reader, data, list(range(0, len(data), 1 << 20)))
    assert frames[0].buffers[0].obj is target
    assert bytes(target[:256]) == bytes(range(256))


@pytest.mark.parametrize(
    ("limits", "frame", "match"),
    [
        (Limits(max_frame_bytes=1000), Frame({"k": 1}, b"", [memoryview(b"x" * 2000)]), "frame of"),
        (Limits(max_payload_bytes=10), Frame({"k": 1}, b"y" * 20), "payload of"),
        (
            Limits(max_buffers=1),
            Frame({"k": 1}, b"", [memoryview(b"a"), memoryview(b"b")]),
            "buffers over",
        ),
    ],
)
def test_limits_refuse_before_allocating(limits, frame, match) -> None:
    allocated = []
    reader = FrameReader(limits, allocator=lambda meta, sizes: allocated.append(sizes) or [])
    with pytest.raises(FrameError, match=match):
        feed(reader, wire(frame), [])
    assert allocated == []


def test_bad_prefix_and_meta_are_frame_errors() -> None:
    with pytest.raises(FrameError, match="magic"):
        feed(FrameReader(Limits()), b"GET / HTTP/1.1\r\n\r\n" + b"x" * 10, [])
    bad_version = PREFIX.pack(b"LMNR", 99, 1, 0, 0) + b"\x80"
    with pytest.raises(FrameError, match="version"):
        feed(FrameReader(Limits()), bad_version, [])
    not_a_map = PREFIX.pack(b"LMNR", 1, 1, 0, 0) + b"\x01"
    with pytest.raises(FrameError, match="map"):
        feed(FrameReader(Limits()), not_a_map, [])
    lying_sizes = PREFIX.pack(b"LMNR", 1, 7, 0, 5) + b"\x81\xa1b\x91\x03\xc0\xc0"[:7]
    with pytest.raises(FrameError):
        feed(FrameReader(Limits()), lying_sizes + b"12345", [])


def test_blob_refs_out_of_range_are_refused() -> None:
    payload, _ = encode_payload({"x": Blob(b"abc")})
    with pytest.raises(FrameError, match="buffer 0"):
        decode_payload(payload, [])


@pytest.mark.parametrize("bind", TRANSPORTS)
async def test_every_transport_lands_buffers_where_the_receivers_allocator_says(bind) -> None:  # type: ignore[no-untyped-def]
    """A relay receives a weight version straight into its shared-memory buffer: the in-process
    transport must honour the allocator as a socket reader does, not hand over the sender's view."""
    target = bytearray(4096)
    got: list[Frame] = []

    def allocator(meta, sizes):  # type: ignore[no-untyped-def]
        return (
            [memoryview(target)[: sizes[0]]]
            if meta.get("k") == "chunk"
            else [memoryview(bytearray(n)) for n in sizes]
        )

    async def handler(conn):  # type: ignore[no-untyped-def]
        got.append(await conn.recv())
        await conn.send(Frame({"k": "ok"}))
        await conn.recv()

    options = TransportOptions(token=b"a" * 32).with_allocator(allocator)
    listener = await listen(bind, options, handler)
    conn = await connect(listener.address, TransportOptions(token=b"a" * 32))
    try:
        payload = bytes(range(256)) * 8
        await conn.send(Frame({"k": "chunk"}, b"", [memoryview(payload)]))
        await conn.recv()
        assert bytes(target[: len(payload)]) == payload
        assert bytes(got[0].buffers[0]) == payload
    finally:
        conn.close()
        await listener.close()
