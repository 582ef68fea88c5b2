"""The wire format: one frame = a fixed prefix, a msgpack meta map, a msgpack payload, raw buffers.

    offset  size  field
    0       4     magic  b"LMNR"
    4       1     protocol version (PROTOCOL_VERSION)
    5       3     reserved, zero
    8       4     meta length      (u32, big endian)
    12      4     payload length   (u32)
    16      8     buffers length   (u64) = sum of meta["b"]
    24      ...   meta | payload | buffer 0 | buffer 1 | ...

Why three sections rather than one msgpack document:

* ``meta`` is small and routing-only (kind, call id, method, buffer lengths). The receiver reads it
  before any large byte arrives, so it can decide *where* the buffers go (a preallocated tensor, a
  shared-memory segment) and receive them straight into that memory with ``recv_into``.
* ``payload`` stays encoded until the buffers have landed: it refers to them by index through a
  msgpack extension type, so decoding it yields zero-copy views of the received memory.
* Buffers never pass through msgpack (or pickle, which never appears on the wire at all); neither
  do long number lists such as token ids and logprobs (:mod:`.arrays`): they travel as typed arrays
  in one extra buffer, so ``max_payload_bytes`` bounds only the small structured part.

Every length is checked against :class:`Limits` before anything is allocated, so a peer cannot make
us reserve memory it did not earn (the handshake runs under much tighter limits than a session).
The sender checks the same limits before writing (:func:`encode_head`): a message too large for the
cluster's limits fails where it was made, with :class:`MessageTooLarge` naming sizes and limits,
instead of reaching the receiver only to have the connection dropped.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from .arrays import EXT_ARRAY, ArrayPool, PackedArray, decode_array

MAGIC = b"LMNR"
PROTOCOL_VERSION = 1
PREFIX = struct.Struct("!4sB3xIIQ")
PREFIX_SIZE = PREFIX.size  # 24

#: msgpack extension code for "raw buffer number N of this frame".
EXT_BUFFER = 1


class FrameError(ValueError):
    """The bytes on a connection are not a valid frame; the connection must be closed."""


class MessageTooLarge(ValueError):
    """A frame about to be sent exceeds the limits its receiver enforces; nothing was sent.

    Raised by the sender, so the message names the problem where it can be fixed (send less per
    message, or raise ``cluster.max_payload_mib`` / ``cluster.max_frame_mib``) and the connection
    stays usable.
    """


@dataclass(frozen=True, slots=True)
class Limits:
    """Upper bounds a receiver enforces before allocating anything."""

    max_meta_bytes: int = 64 * 1024
    max_payload_bytes: int = 64 * 1024 * 1024
    max_frame_bytes: int = 2 * 1024**3
    max_buffers: int = 4096

    @classmethod
    def handshake(cls) -> Limits:
        """Limits before a peer has proven it holds the cluster token: a few KiB, no buffers."""
        return cls(max_meta_bytes=1024, max_payload_bytes=1024, max_frame_bytes=4096, max_buffers=0)


class Blob:
    """A raw byte buffer carried beside the msgpack payload rather than inside it.

    Wrap anything that exports the buffer protocol (bytes, bytearray, memoryview, numpy arrays,
    mmap). On the receiving side a Blob wraps a view of the memory the frame was received into;
    nothing is copied on the way out of the transport.
    """

    __slots__ = ("_view",)

    def __init__(self, data: Any) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if not view.contiguous:
            raise ValueError("Blob needs a contiguous buffer")
        self._view = view.cast("B") if (view.format != "B" or view.ndim != 1) else view

    @property
    def view(self) -> memoryview:
        return self._view

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    def __len__(self) -> int:
        return self._view.nbytes

    def __bytes__(self) -> bytes:
        return self._view.tobytes()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Blob):
            return self._view == other._view
        return NotImplemented

    def __hash__(self) -> int:  # pragma: no cover - Blobs are not dict keys
        raise TypeError("Blob is unhashable")

    def __repr__(self) -> str:
        return f"Blob({self.nbytes} bytes)"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # Lets pydantic models declare `data: Blob` fields. model_dump() keeps the Blob object
        # (the encoder below sends it out of band); bytes-like input is wrapped.
        from pydantic_core import core_schema

        def wrap(value: Any) -> Blob:
            if isinstance(value, Blob):
                return value
            if isinstance(value, (bytes, bytearray, memoryview)):
                return Blob(value)
            raise ValueError(f"expected a Blob or bytes-like object, got {type(value).__name__}")

        def serialize(value: Blob, info: Any) -> Any:
            # python mode keeps the Blob (the encoder sends it out of band); JSON gets a summary
            return value if info.mode == "python" else f"<{value.nbytes} bytes>"

        return core_schema.no_info_plain_validator_function(
            wrap,
            serialization=core_schema.plain_serializer_function_ser_schema(
                serialize, info_arg=True
            ),
        )


@dataclass(slots=True)
class Frame:
    """One message: routing meta, an encoded payload and raw buffers."""

    meta: dict[str, Any]
    payload: bytes | memoryview = b""
    buffers: list[memoryview] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return len(self.payload) + sum(b.nbytes for b in self.buffers)


# ----------------------------------------------------------------------------------------------
# payload encoding


class _Encoder(threading.local):
    """One msgpack packer per thread, reused by every :func:`encode_payload` on that thread.

    Why: a packer and its ``default`` hook made afresh for each message cost more than packing a
    small message (docs/benchmarks.md, *Transport*), and small calls are the RPC round trip that
    ``benchmarks/transport.py`` holds against a bare echo. ``default`` reads this message's
    buffers and array pool from the encoder, which :func:`encode_payload` resets before each pack
    (packing never re-enters: ``default`` only converts one value). Per thread because executors
    encode too.
    """

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.pool: ArrayPool | None = None
        self.packer = msgpack.Packer(default=self.default, use_bin_type=True)

    def default(self, value: Any) -> Any:
        if isinstance(value, Blob):
            self.buffers.append(value.view)
            return msgpack.ExtType(EXT_BUFFER, struct.pack("!I", len(self.buffers) - 1))
        if isinstance(value, PackedArray):
            if self.pool is None:
                self.pool = ArrayPool()
            return self.pool.reference(value)
        if isinstance(value, (tuple, set, frozenset)):
            return list(value)
        raise TypeError(f"cannot send a {type(value).__name__} on the wire")


_encoder = _Encoder()


def encode_payload(obj: Any) -> tuple[bytes, list[memoryview]]:
    """msgpack-encode ``obj``; every :class:`Blob` inside becomes an out-of-band buffer, and every
    :class:`~.arrays.PackedArray` goes into one pool buffer appended last."""
    enc = _encoder
    buffers: list[memoryview] = []
    enc.buffers, enc.pool = buffers, None
    try:
        payload = enc.packer.pack(obj)  # the packer resets itself when this raises
        pool = enc.pool
    finally:
        enc.buffers, enc.pool = [], None
    if pool:
        buffers.append(pool.build())
    return payload, buffers


def decode_payload(payload: bytes | memoryview, buffers: list[memoryview]) -> Any:
    """Inverse of :func:`encode_payload`; extension references resolve to Blobs over ``buffers``
    and to lists read from the array pool (the last buffer)."""
    if not payload:
        return None

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_ARRAY:
            try:
                return decode_array(data, buffers[-1] if buffers else None)
            except ValueError as exc:
                raise FrameError(f"bad array reference: {exc}") from exc
        if code != EXT_BUFFER or len(data) != 4:
            raise FrameError(f"unknown msgpack extension type {code}")
        (index,) = struct.unpack("!I", data)
        if index >= len(buffers):
            raise FrameError(f"payload refers to buffer {index}, frame has {len(buffers)}")
        return Blob(buffers[index])

    try:
        return msgpack.unpackb(payload, ext_hook=ext_hook, raw=False, strict_map_key=False)
    except FrameError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise FrameError(f"bad msgpack payload: {exc}") from exc


# ----------------------------------------------------------------------------------------------
# frame header encoding


def encode_head(frame: Frame, limits: Limits | None = None) -> bytes:
    """Prefix + meta + payload as one bytes object; the buffers follow it on the wire.

    With ``limits`` (every transport passes its connection's), a frame the receiver would refuse
    raises :class:`MessageTooLarge` here instead.
    """
    meta = frame.meta
    if frame.buffers:
        sizes = [b.nbytes for b in frame.buffers]
        meta = {**meta, "b": sizes}
    else:
        sizes = []
        if "b" in meta:
            meta = {k: v for k, v in meta.items() if k != "b"}
    meta_bytes = _META_PACKER.pack(meta)
    if limits is not None:
        check_outgoing(len(meta_bytes), len(frame.payload), sizes, limits)
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, len(meta_bytes), len(frame.payload), sum(sizes))
    return b"".join((prefix, meta_bytes, frame.payload))


#: Meta maps hold only ints, strings and lists of them: a packer without a ``default`` hook, made
#: once (msgpack.packb makes one per call). Thread-safe: pack() runs without releasing the GIL.
_META_PACKER = msgpack.Packer(use_bin_type=True)


def check_outgoing(meta_len: int, payload_len: int, sizes: list[int], limits: Limits) -> None:
    """Raise :class:`MessageTooLarge` for a frame that ``limits`` would make its receiver refuse."""
    total = PREFIX_SIZE + meta_len + payload_len + sum(sizes)
    if payload_len > limits.max_payload_bytes:
        raise MessageTooLarge(
            f"message fields of {payload_len} bytes are over the payload limit of "
            f"{limits.max_payload_bytes} bytes (cluster.max_payload_mib): send fewer items per "
            "message, or raise the limit on every member"
        )
    if total > limits.max_frame_bytes:
        raise MessageTooLarge(
            f"message of {total} bytes is over the frame limit of {limits.max_frame_bytes} bytes "
            "(cluster.max_frame_mib): send fewer items per message, or raise the limit on every "
            "member"
        )
    if len(sizes) > limits.max_buffers:
        raise MessageTooLarge(
            f"message has {len(sizes)} raw buffers, over the limit of {limits.max_buffers}"
        )
    if meta_len > limits.max_meta_bytes:
        raise MessageTooLarge(
            f"frame meta of {meta_len} bytes is over the limit of {limits.max_meta_bytes}"
        )


class Prefix(NamedTuple):
    """A frame's fixed prefix, decoded (a tuple: one is made per frame received)."""

    meta_len: int
    payload_len: int
    buffers_len: int


def decode_prefix(data: bytes | memoryview, limits: Limits) -> Prefix:
    magic, version, meta_len, payload_len, buffers_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}: not a Laminar peer")
    if version != PROTOCOL_VERSION:
        raise FrameError(
            f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})"
        )
    if meta_len == 0 or meta_len > limits.max_meta_bytes:
        raise FrameError(f"meta of {meta_len} bytes outside 1..{limits.max_meta_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise FrameError(
            f"payload of {payload_len} bytes over the limit {limits.max_payload_bytes}"
        )
    total = PREFIX_SIZE + meta_len + payload_len + buffers_len
    if total > limits.max_frame_bytes:
        raise FrameError(f"frame of {total} bytes over the limit {limits.max_frame_bytes}")
    return Prefix(meta_len, payload_len, buffers_len)


def decode_meta(data: bytes | memoryview, prefix: Prefix, limits: Limits) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise FrameError(f"bad msgpack meta: {exc}") from exc
    if not isinstance(meta, dict):
        raise FrameError(f"meta must be a map, got {type(meta).__name__}")
    sizes = meta.get("b")
    if sizes is None:  # no buffers: the common case, checked without building anything
        if prefix.buffers_len:
            raise FrameError(f"buffer sizes add up to 0, prefix says {prefix.buffers_len}")
        return meta
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise FrameError("meta 'b' must be a list of buffer sizes")
    if len(sizes) > limits.max_buffers:
        raise FrameError(f"{len(sizes)} buffers over the limit {limits.max_buffers}")
    if sum(sizes) != prefix.buffers_len:
        raise FrameError(f"buffer sizes add up to {sum(sizes)}, prefix says {prefix.buffers_len}")
    return meta
