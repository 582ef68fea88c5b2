"""A sans-I/O frame parser built for ``asyncio.BufferedProtocol``.

The event loop asks :meth:`FrameReader.get_buffer` where to put the next bytes and tells
:meth:`FrameReader.buffer_updated` how many arrived. Small frames are parsed out of one reusable
staging buffer (many frames per ``recv``); the raw buffers of a frame are received *directly* into
their destination memory, chosen by an :data:`Allocator` once the frame's meta is known. A 256 MiB
tensor therefore goes from the kernel into its final place in one pass, never through a Python
``bytes`` object.

The parser has no I/O and no event loop, so it is unit-tested by feeding it bytes in arbitrary
chunkings.

The staging buffer is sized from the limits: a connection still in its handshake (a few KiB
allowed) holds :data:`_HANDSHAKE_STAGING`, and gets the full :data:`_STAGING` only once the
handshake raised its limits, so hundreds of unauthenticated connections cost little memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .frames import PREFIX_SIZE, Frame, FrameError, Limits, Prefix, decode_meta, decode_prefix

#: Where a frame's raw buffers are received: ``(meta, sizes) -> one writable view per size``.
Allocator = Callable[[dict[str, Any], list[int]], list[memoryview]]

_STAGING = 256 * 1024
_HANDSHAKE_STAGING = 4 * 1024
_NO_ZERO_FILL = 1 << 20  # above this, allocate with np.empty: zero-filling would cost a memcpy


def default_allocator(meta: dict[str, Any], sizes: list[int]) -> list[memoryview]:
    return [
        np.empty(n, dtype=np.uint8).data if n >= _NO_ZERO_FILL else memoryview(bytearray(n))
        for n in sizes
    ]


def _staging_size(limits: Limits) -> int:
    return max(_HANDSHAKE_STAGING, min(_STAGING, limits.max_frame_bytes))


class FrameReader:
    def __init__(self, limits: Limits, allocator: Allocator = default_allocator) -> None:
        self._limits = limits
        self.allocator = allocator
        self._staging = _staging_size(limits)
        self._buf = bytearray(self._staging)
        self._view = memoryview(self._buf)
        self._start = 0  # first unconsumed byte in the staging buffer
        self._end = 0  # one past the last received byte
        self._head: Prefix | None = None
        # body state: the frame whose raw buffers are being received
        self._frame: Frame | None = None
        self._dests: list[memoryview] = []
        self._index = 0
        self._offset = 0
        self._direct = False  # last get_buffer() handed out destination memory

    @property
    def limits(self) -> Limits:
        return self._limits

    @limits.setter
    def limits(self, value: Limits) -> None:
        """New limits (raised after the handshake): the staging buffer grows with them."""
        self._limits = value
        self._staging = _staging_size(value)
        if self._staging > len(self._buf):
            self._move_pending(bytearray(self._staging))

    @property
    def reserved_bytes(self) -> int:
        """Memory this reader holds between frames (the staging buffer)."""
        return len(self._buf)

    @property
    def idle(self) -> bool:
        """No partial frame is pending (used to tell a clean EOF from a truncated frame)."""
        return self._frame is None and self._head is None and self._end == self._start

    # -- BufferedProtocol side ------------------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._frame is not None and self._start == self._end:
            dest = self._dests[self._index]
            self._direct = True
            return dest[self._offset :]
        self._direct = False
        pending = self._end - self._start
        need = max(self._bytes_needed(), pending + 1)  # measured from _start
        if need > len(self._buf):
            self._move_pending(bytearray(need))
        elif self._start and (
            self._start + need > len(self._buf) or len(self._buf) - self._end < 4096
        ):
            self._move_pending(self._buf)
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        frames: list[Frame] = []
        if self._direct:
            self._offset += nbytes
            self._advance_body(frames)
        else:
            self._end += nbytes
        self._parse(frames)
        return frames

    # -- parsing ----------------------------------------------------------------------------------

    def _bytes_needed(self) -> int:
        if self._head is None:
            return PREFIX_SIZE
        return PREFIX_SIZE + self._head.meta_len + self._head.payload_len

    def _move_pending(self, target: bytearray) -> None:
        """Move unconsumed bytes to the front of ``target`` (the staging buffer or a larger one)."""
        pending = self._end - self._start
        if target is self._buf:
            self._view[:pending] = self._view[self._start : self._end]
        else:
            target[:pending] = self._view[self._start : self._end]
            self._buf, self._view = target, memoryview(target)
        self._start, self._end = 0, pending

    def _shrink(self) -> None:
        """Give back a staging buffer that grew to hold one large payload."""
        pending = self._end - self._start
        if len(self._buf) > self._staging and pending < self._staging:
            small = bytearray(self._staging)
            small[:pending] = self._view[self._start : self._end]
            self._buf, self._view = small, memoryview(small)
            self._start, self._end = 0, pending

    def _parse(self, frames: list[Frame]) -> None:
        while True:
            if self._frame is not None:
                self._fill_from_staging()
                self._advance_body(frames)
                if self._frame is not None:
                    return
                continue
            available = self._end - self._start
            if self._head is None:
                if available < PREFIX_SIZE:
                    return
                self._head = decode_prefix(
                    self._view[self._start : self._start + PREFIX_SIZE], self.limits
                )
            head = self._head
            total = PREFIX_SIZE + head.meta_len + head.payload_len
            if available < total:
                return
            at = self._start + PREFIX_SIZE
            meta = decode_meta(self._view[at : at + head.meta_len], head, self.limits)
            at += head.meta_len
            payload = bytes(self._view[at : at + head.payload_len])
            self._start += total
            self._head = None
            sizes: list[int] = meta.pop("b", [])
            frame = Frame(meta, payload)
            if not sizes:
                frames.append(frame)
                self._shrink()
                continue
            dests = self.allocator(meta, sizes)
            if [d.nbytes for d in dests] != sizes:
                raise FrameError("allocator returned buffers of the wrong sizes")
            self._frame, self._dests, self._index, self._offset = frame, dests, 0, 0

    def _fill_from_staging(self) -> None:
        while self._frame is not None and self._start < self._end:
            dest = self._dests[self._index]
            n = min(dest.nbytes - self._offset, self._end - self._start)
            dest[self._offset : self._offset + n] = self._view[self._start : self._start + n]
            self._offset += n
            self._start += n
            if self._offset == dest.nbytes and self._index + 1 < len(self._dests):
                self._index += 1
                self._offset = 0
            elif self._offset == dest.nbytes:
                return

    def _advance_body(self, frames: list[Frame]) -> None:
        assert self._frame is not None
        while self._offset == self._dests[self._index].nbytes:
            if self._index + 1 == len(self._dests):
                self._frame.buffers = self._dests
                frames.append(self._frame)
                self._frame, self._dests, self._index, self._offset = None, [], 0, 0
                return
            self._index += 1
            self._offset = 0
