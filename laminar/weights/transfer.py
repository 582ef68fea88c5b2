"""Moving a weight version between two processes: chunk by chunk, straight into its final place.

One protocol serves every hop (trainer -> master relay, relay -> next relay), on any transport::

    sender                                   receiver
    offer {manifest, chunks} ------------->  create (or find) the version's buffer
                             <-------------  have {n, newest}: chunks it already holds (resume),
                                             and its newest verified version
    chunk i (raw buffer)     ------------->  lands directly in the buffer (the allocator)
    ...                                      a forwarder may already send chunk i onwards
                             <-------------  done {ok, bad}: every tensor's CRC checked

Why chunks and not one frame: a relay forwards chunk i to the next relay while chunk i+1 is still
arriving (pipelining), so a chain of p relays takes about one transfer time instead of p. Why
``have``: a relay whose upstream died mid-transfer keeps what it got; the new upstream resumes at
the first missing chunk instead of starting over. Why ``newest``: a trainer that restarted from an
older checkpoint must not publish a version number the relays already hold for other weights
(they would keep theirs, as newer); the publisher asks to be refused (``refuse_older``) and
continues after the number it is told (:class:`VersionConflict`).

Received bytes are never copied: the receiving connection's allocator hands the reader the
version's (shared-memory) buffer slice for each chunk, so the kernel writes into the memory local
rollouts will map.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from laminar.runtime.executor import LOOP_DEFAULT, Executor
from laminar.transport import Connection, Frame, FrameError, decode_payload, encode_payload
from laminar.transport.reader import default_allocator
from laminar.transport.shm import SharedBuffer

from .manifest import WeightManifest, verify


class TransferError(RuntimeError):
    """The peer broke the weight-transfer protocol or the bytes did not verify."""


class VersionConflict(TransferError):
    """The peer already holds a newer verified version than the one offered: the offered number
    was reused (a restarted trainer), so sending it is pointless and its number is wrong."""

    def __init__(self, offered: int, newest: int) -> None:
        super().__init__(f"peer holds v{newest}, newer than the offered v{offered}")
        self.offered, self.newest = offered, newest


class VersionBuffer:
    """One version's bytes, filling chunk by chunk (in order) until complete and verified."""

    def __init__(
        self,
        manifest: WeightManifest,
        chunks: list[tuple[int, int]],
        shared: bool,
        storage: memoryview | None = None,
    ) -> None:
        self.manifest = manifest
        self.version = manifest.version
        self.chunks = chunks
        size = max(manifest.total_bytes, 1)
        self.shared: SharedBuffer | None = SharedBuffer(size) if shared else None
        if self.shared is not None:
            self.view = self.shared.view
        else:
            self.view = storage if storage is not None else np.empty(size, np.uint8).data
        self.received = 0  # chunks 0..received-1 are in place
        self.verified = False
        self._progress = asyncio.Event()

    @property
    def complete(self) -> bool:
        return self.received == len(self.chunks)

    @property
    def segment(self) -> str | None:
        return self.shared.name if self.shared else None

    def chunk_view(self, index: int) -> memoryview:
        offset, size = self.chunks[index]
        return self.view[offset : offset + size]

    def mark_all(self) -> None:
        """The producer filled the whole buffer at once (the trainer's staging copy)."""
        self.received = len(self.chunks)
        self._pulse()

    def mark(self, index: int) -> None:
        if index != self.received:
            raise TransferError(f"chunk {index} of v{self.version} out of order ({self.received})")
        self.received += 1
        self._pulse()

    def _pulse(self) -> None:
        event, self._progress = self._progress, asyncio.Event()
        event.set()

    async def wait_chunk(self, index: int) -> None:
        while self.received <= index:
            await self._progress.wait()

    def close(self) -> None:
        """Unlink the shared segment; rollouts that already mapped it keep a valid mapping."""
        if self.shared is not None:
            self.shared.close()


class VersionStore:
    """The newest versions this process holds: at most ``keep``, counting one being received.

    Why the arriving version counts: a version is allocated whole when its transfer starts, so a
    store that kept ``keep`` complete versions beside it held ``keep + 1`` versions' memory at
    every transfer. Room is made when a transfer starts, oldest first, but the newest complete
    version always stays (rollouts load it meanwhile): with ``keep`` 1, that one and the arriving
    one are held until the transfer completes.

    ``changed`` pulses whenever a version is added or completes, for forwarders and watchers.
    """

    def __init__(self, keep: int, *, shared: bool = True) -> None:
        if keep < 1:
            raise ValueError("a version store keeps at least one version")
        self.keep = keep
        self.shared = shared
        self.versions: dict[int, VersionBuffer] = {}
        self._changed = asyncio.Event()

    def begin(self, manifest: WeightManifest, chunks: list[tuple[int, int]]) -> VersionBuffer:
        """The buffer for ``manifest``: the existing one (resume) or a new one."""
        existing = self.versions.get(manifest.version)
        if existing is not None:
            if existing.manifest == manifest and existing.chunks == chunks:
                return existing
            self.versions.pop(manifest.version).close()  # re-published differently: start over
        check_chunks(manifest, chunks)
        self._make_room()
        vb = VersionBuffer(manifest, chunks, self.shared)
        self.versions[manifest.version] = vb
        self.notify()
        return vb

    def completed(self, vb: VersionBuffer) -> None:
        vb.verified = True
        self._evict()
        self.notify()

    def latest(self) -> VersionBuffer | None:
        """The newest verified version."""
        done = [v for v in self.versions.values() if v.verified]
        return max(done, key=lambda v: v.version, default=None)

    def newest(self) -> VersionBuffer | None:
        """The newest version in any state (what a forwarder should send next)."""
        return self.versions[max(self.versions)] if self.versions else None

    def notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    @property
    def changed(self) -> asyncio.Event:
        """The event the next change sets. Take it before looking at the store and wait on it
        after, so a change that lands in between (while the caller awaited) is not missed."""
        return self._changed

    def _make_room(self) -> None:
        """Drop versions, oldest first, until one more fits in ``keep``; never the newest
        complete one."""
        latest = self.latest()
        for version in sorted(self.versions):
            if len(self.versions) < self.keep:
                return
            if self.versions[version] is not latest:
                self.versions.pop(version).close()

    def _evict(self) -> None:
        done = sorted(v for v, vb in self.versions.items() if vb.verified)
        newest_done = done[-1] if done else -1
        keep = set(done[-self.keep :])
        for version in list(self.versions):
            vb = self.versions[version]
            stale_partial = not vb.verified and version < newest_done
            if (vb.verified and version not in keep) or stale_partial:
                self.versions.pop(version).close()

    def close(self) -> None:
        for vb in self.versions.values():
            vb.close()
        self.versions.clear()

    def allocator(self, meta: dict[str, Any], sizes: list[int]) -> list[memoryview]:
        """Where a received frame's buffers go: a chunk lands in its version buffer in place."""
        if meta.get("k") != "chunk":
            return default_allocator(meta, sizes)
        version, index = meta.get("v"), meta.get("i")
        vb = self.versions.get(version) if isinstance(version, int) else None
        if vb is None or not isinstance(index, int) or not 0 <= index < len(vb.chunks):
            raise FrameError(f"chunk {index!r} of unknown version {version!r}")
        if sizes != [vb.chunks[index][1]]:
            raise FrameError(f"chunk {index} of v{version} has sizes {sizes}")
        return [vb.chunk_view(index)]


def check_chunks(manifest: WeightManifest, chunks: list[tuple[int, int]]) -> None:
    """Chunks must tile the buffer exactly, in order."""
    offset = 0
    for start, size in chunks:
        if start != offset or size <= 0:
            raise TransferError(f"chunk plan does not tile the buffer at offset {offset}")
        offset += size
    if offset != manifest.total_bytes:
        raise TransferError(f"chunks cover {offset} of {manifest.total_bytes} bytes")


# -- the two ends of one hop ---------------------------------------------------------------------


def _control(kind: str, **body: Any) -> Frame:
    payload, _ = encode_payload(body)
    return Frame({"k": kind}, payload)


async def _expect(conn: Connection, kind: str, timeout: float) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        frame = await conn.recv()
    if frame.meta.get("k") != kind:
        raise TransferError(f"expected {kind!r} from {conn.peer}, got {frame.meta.get('k')!r}")
    body = decode_payload(frame.payload, frame.buffers)
    return body if isinstance(body, dict) else {}


async def push_version(
    conn: Connection,
    vb: VersionBuffer,
    *,
    timeout: float = 60.0,
    on_chunk: Callable[[int], None] | None = None,
    refuse_older: bool = False,
) -> None:
    """Send ``vb`` over ``conn``, each chunk as soon as it is here; return once the peer verified.

    Raises :class:`TransferError` if the peer reports corrupt tensors, and (``refuse_older``)
    :class:`VersionConflict` before any chunk when the peer holds a newer verified version;
    transport errors propagate (the caller reconnects, and the peer's ``have`` resumes).
    """
    await conn.send(
        _control("offer", manifest=vb.manifest.model_dump(), chunks=[list(c) for c in vb.chunks])
    )
    reply = await _expect(conn, "have", timeout)
    have, newest = reply.get("n", 0), reply.get("newest", -1)
    if not isinstance(have, int) or not 0 <= have <= len(vb.chunks):
        raise TransferError(f"peer {conn.peer} claims {have!r} chunks")
    if refuse_older and isinstance(newest, int) and newest > vb.version:
        raise VersionConflict(vb.version, newest)
    for index in range(have, len(vb.chunks)):
        await vb.wait_chunk(index)
        await conn.send(
            Frame({"k": "chunk", "v": vb.version, "i": index}, b"", [vb.chunk_view(index)])
        )
        if on_chunk is not None:
            on_chunk(index)
    done = await _expect(conn, "done", timeout)
    if not done.get("ok"):
        raise TransferError(f"{conn.peer} rejected v{vb.version}: bad tensors {done.get('bad')}")


async def receive_versions(
    conn: Connection,
    store: VersionStore,
    on_complete: Callable[[VersionBuffer], None] | None = None,
    *,
    executor: Executor = LOOP_DEFAULT,
) -> None:
    """Serve one upstream connection: receive offered versions until the peer goes away.

    The connection must have been accepted with ``store.allocator`` so chunks land in place.
    A complete version's CRCs are checked in ``executor`` (the relay role's), off the loop.
    """
    while True:
        frame = await conn.recv()
        if frame.meta.get("k") != "offer":
            raise TransferError(f"expected an offer from {conn.peer}, got {frame.meta.get('k')!r}")
        body = decode_payload(frame.payload, frame.buffers)
        try:
            manifest = WeightManifest.model_validate(body["manifest"])
            chunks = [(int(o), int(s)) for o, s in body["chunks"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed offer from {conn.peer}: {exc}") from exc
        vb = store.begin(manifest, chunks)
        latest = store.latest()
        await conn.send(
            _control(
                "have",
                n=len(chunks) if vb.verified else vb.received,
                newest=latest.version if latest is not None else -1,
            )
        )
        while not vb.complete:
            chunk = await conn.recv()
            if chunk.meta.get("k") != "chunk" or chunk.meta.get("v") != vb.version:
                raise TransferError(f"expected a chunk of v{vb.version} from {conn.peer}")
            vb.mark(chunk.meta["i"])
        if not vb.verified:
            bad = await executor.run(verify, manifest, vb.view)
            if bad:
                store.versions.pop(vb.version, None)
                vb.close()
                await conn.send(_control("done", ok=False, bad=bad[:8]))
                continue
            if store.versions.get(vb.version) is not vb:
                await conn.send(_control("done", ok=True))  # superseded while it arrived
                continue
            store.completed(vb)
            if on_complete is not None:
                on_complete(vb)
        await conn.send(_control("done", ok=True))
