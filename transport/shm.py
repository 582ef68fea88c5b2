"""``shm://name``: frames over a Unix socket; shared-memory buffers move by reference.

For processes on one host (a relay serving a weight version to its local rollouts). A buffer that
lies inside a :class:`SharedBuffer` the sender owns travels as a descriptor (segment name, offset,
length); the receiver maps the segment read-only and gets a view of it: zero copies, whatever the
size. Every other buffer goes inline over the Unix socket like on ``tcp://``.

Why not copy ordinary buffers into fresh segments: a new tmpfs segment costs page allocation,
which can be slower than the socket itself (docs/benchmarks.md, *Transport*), so that "shared
memory" path would lose. Producers that want zero-copy write into a SharedBuffer
from the start (``SharedBuffer(n).view``), which is what the relay does.

The owner keeps a segment alive and unchanged while readers may map it (the relay keeps the last K
versions for that reason); readers' existing mappings survive ``close()`` (unlink). Receivers map
only names of the form ``laminar-<8 hex pid>-<24 hex>`` under ``/dev/shm`` and check bounds, so
an authenticated but buggy peer cannot make us map arbitrary files. The owner's pid in the name
lets :func:`sweep_dead_segments` remove what a process killed with -9 left behind (tmpfs pages
are RAM: a relay that dies holding two versions of a large model must not keep them forever).

``LAMINAR_SHM_TAG`` (1-8 hex digits, inherited by child processes) replaces the start of the 24
random hex digits, so whoever shares ``/dev/shm`` (a test session beside another, one cluster
beside another) can tell its segments from the others' without a second naming scheme.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import tempfile
import weakref
from typing import Any

import numpy as np

from .base import Connection, Handler, Listener, Transport, TransportOptions, register_transport
from .frames import Frame, FrameError, Limits
from .tcp import StreamConnection, StreamListener, protocol_factory

SHM_DIR = "/dev/shm"
SHM_MIN_BYTES = 64 << 10  # smaller shared slices go inline: a mapping costs more
_NAME = re.compile(r"^laminar-([0-9a-f]{8})-[0-9a-f]{24}$")
#: segments alive in this process that were created as SharedBuffers: id(mmap) -> SharedBuffer
_SHARED: weakref.WeakValueDictionary[int, SharedBuffer] = weakref.WeakValueDictionary()


SHM_TAG_ENV = "LAMINAR_SHM_TAG"
_TAG = re.compile(r"^[0-9a-f]{1,8}$")


def segment_name() -> str:
    """A fresh segment name: this process's pid, then ``LAMINAR_SHM_TAG`` (if set) + random hex."""
    tag = os.environ.get(SHM_TAG_ENV, "")
    if tag and not _TAG.match(tag):
        raise ValueError(f"{SHM_TAG_ENV}={tag!r}: use 1 to 8 lowercase hex digits")
    return f"laminar-{os.getpid():08x}-{tag}{secrets.token_hex(12)[len(tag) :]}"


class SharedBuffer:
    """A named shared-memory segment owned by this process (unlinked on :meth:`close`).

    ``view`` is a writable memoryview of the whole segment; fill it, then send it (or any slice of
    it) in a frame over ``shm://`` and receivers map it without a copy.
    """

    def __init__(self, size: int, name: str | None = None) -> None:
        if size <= 0:
            raise ValueError("a shared buffer needs a positive size")
        self.name = name or segment_name()
        self.size = size
        path = os.path.join(SHM_DIR, self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)
        self._address = np.frombuffer(self._mmap, dtype=np.uint8).ctypes.data
        _SHARED[id(self._mmap)] = self
        self._finalizer = weakref.finalize(self, _unlink, self.name)

    def locate(self, view: memoryview) -> int | None:
        """Offset of ``view`` inside this segment, or None if it does not lie inside it."""
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else -1
        offset = start - self._address
        return offset if 0 <= offset and offset + view.nbytes <= self.size else None

    def close(self) -> None:
        """Unlink the segment. Views already mapped (here or by readers) stay valid."""
        self._finalizer()


def sweep_dead_segments() -> list[str]:
    """Unlink segments whose owning process is gone (killed before it could clean up)."""
    removed = []
    for name in os.listdir(SHM_DIR):
        match = _NAME.match(name)
        if match is None:
            continue
        pid = int(match.group(1), 16)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _unlink(name)
            removed.append(name)
        except PermissionError:
            pass  # alive, someone else's
    return removed


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def _shared_origin(view: memoryview) -> tuple[SharedBuffer, int] | None:
    owner = _SHARED.get(id(view.obj))
    if owner is None:
        return None
    offset = owner.locate(view)
    return None if offset is None else (owner, offset)


class SegmentGone(FrameError):
    """The named segment no longer exists (its owner unlinked it, or died and was swept)."""


def map_segment(name: str, offset: int, size: int) -> memoryview:
    """Map ``size`` bytes at ``offset`` of segment ``name`` read-only."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise FrameError(f"refusing to map shared-memory segment {name!r}")
    if not all(isinstance(v, int) for v in (offset, size)):
        raise FrameError("shared-memory offset and size must be integers")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError as exc:
        raise SegmentGone(f"shared-memory segment {name} is gone") from exc
    try:
        total = os.fstat(fd).st_size
        if offset < 0 or size < 0 or offset + size > total:
            raise FrameError(f"segment {name} has {total} bytes, frame wants {offset}+{size}")
        if size == 0:
            return memoryview(b"")
        mapped = mmap.mmap(fd, total, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return memoryview(mapped)[offset : offset + size]


def drop_pages(view: memoryview, offset: int, nbytes: int) -> None:
    """Unmap this process's resident pages of ``view[offset : offset + nbytes]``, a view of a
    read-only segment mapping; the bytes stay in the segment and fault back in on the next read.

    For a reader that streams a large segment once (an engine loading a weight version): without
    it, every page read stays in the reader's resident set until the whole mapping goes, so the
    reader briefly held a second copy of the version on top of its own. Only pages wholly inside
    the range are dropped; a view that is not of an mmap is left alone."""
    mapped = view.obj
    if not isinstance(mapped, mmap.mmap) or nbytes <= 0:
        return
    base = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    start = np.frombuffer(view, dtype=np.uint8).ctypes.data - base + offset
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + nbytes) // page * page
    if last > first:
        mapped.madvise(mmap.MADV_DONTNEED, first, last - first)


def map_writable(name: str) -> memoryview:
    """Map the whole of segment ``name`` read-write: for cooperating processes of one job that
    each fill their own part of a buffer its owner made (a sharded trainer's ranks staging a
    version). Unlike :func:`map_segment` this is not for frames from a peer."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise FrameError(f"refusing to map shared-memory segment {name!r}")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except FileNotFoundError as exc:
        raise SegmentGone(f"shared-memory segment {name} is gone") from exc
    try:
        return memoryview(mmap.mmap(fd, os.fstat(fd).st_size))
    finally:
        os.close(fd)


class ShmConnection(StreamConnection):
    """A stream connection that sends SharedBuffer slices as descriptors."""

    def _write(self, frame: Frame) -> None:  # under send() and try_send()
        segments: list[list[Any]] = []
        buffers = list(frame.buffers)
        for index, buf in enumerate(buffers):
            origin = _shared_origin(buf) if buf.nbytes >= SHM_MIN_BYTES else None
            if origin is not None:
                owner, offset = origin
                segments.append([index, owner.name, offset, buf.nbytes])
                buffers[index] = memoryview(b"")
        if segments:
            frame = Frame({**frame.meta, "shm": segments}, frame.payload, buffers)
        super()._write(frame)

    def deliver(self, frames: list[Frame]) -> None:
        for frame in frames:
            segments = frame.meta.pop("shm", None)
            if segments is None:
                continue
            if not isinstance(segments, list):
                raise FrameError("meta 'shm' must be a list")
            for entry in segments:
                if not (isinstance(entry, list) and len(entry) == 4):
                    raise FrameError(f"bad shared-memory descriptor {entry!r}")
                index, name, offset, size = entry
                if not isinstance(index, int) or not 0 <= index < len(frame.buffers):
                    raise FrameError(f"shared-memory descriptor names buffer {index!r}")
                if not isinstance(size, int) or size > self.limits.max_frame_bytes:
                    raise FrameError(f"shared buffer of {size!r} bytes over the frame limit")
                frame.buffers[index] = map_segment(name, offset, size)
        super().deliver(frames)


def _socket_path(name: str) -> str:
    directory = os.environ.get("LAMINAR_RUNTIME_DIR") or os.path.join(
        tempfile.gettempdir(), f"laminar-{os.getuid()}"
    )
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return os.path.join(directory, f"{name}.sock")


class ShmTransport(Transport):
    scheme = "shm"

    async def connect(self, rest: str, options: TransportOptions) -> Connection:
        import asyncio

        path = _socket_path(rest)
        _, conn = await asyncio.get_running_loop().create_unix_connection(
            lambda: ShmConnection(f"shm://{rest}", Limits.handshake(), options.allocator), path
        )
        return conn

    async def listen(
        self, rest: str, options: TransportOptions, on_connection: Handler
    ) -> Listener:
        import asyncio

        name = rest if rest not in ("", "*") else f"auto-{os.getpid()}-{secrets.token_hex(4)}"
        path = _socket_path(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket from a dead process
        box: list[StreamListener] = []
        server = await asyncio.get_running_loop().create_unix_server(
            protocol_factory(options, box, on_connection, f"shm://{name}", ShmConnection), path
        )
        os.chmod(path, 0o600)
        box.append(_ShmListener(server, f"shm://{name}", path))
        return box[0]


class _ShmListener(StreamListener):
    def __init__(self, server: Any, address: str, path: str) -> None:
        super().__init__(server, address)
        self._path = path

    async def close(self) -> None:
        await super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)


register_transport("shm", ShmTransport)
