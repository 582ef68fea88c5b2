"""The trainer's end of the weight path: stage a version in a host buffer, then push it.

``stage`` (called by the training loop, off the event loop) lays the tensors out and copies them
into a reusable host buffer. The copy is the trainer's stall per version, at most: a ``fill``
may start it in the background and return a future (the torch trainer copies while its next step
trains, ``roles/trainer/staging.py``), and the stall is then only the start. Either way it does
not depend on how many relays or rollouts exist, because the trainer only ever talks to the
master. ``hand_off`` makes the staged version the one to send once its bytes are in (checksums
are computed then, off the stall); the push task sends the newest such version to the current
master relay and follows the manager's chain, so a master that dies is replaced and the new
master gets (the rest of) the newest version.

Time (the stall, when a version was acked, the pause before a retry) comes from the owner's
clock and the checksums run in the owner's executor, so the trainer role runs its publisher on
virtual time like on real time (``clock``, ``executor``; outside a role: the running loop's clock
and default executor).

Versions are never queued: if the trainer stages v+1 while v is still on its way, v+1 replaces any
version not yet started, and rollouts only ever want the newest anyway. Staging buffers are
reused (the newest acked version's, one being filled, one spare at most), so the steady state
allocates nothing and holds no buffer it will not use again.

Version numbers are never reused: a push offers its version with ``refuse_older``, and a master
relay that already holds a newer one (published before the trainer restarted from an older
checkpoint) refuses it before any chunk moves. The version is dropped, not retried, and
``master_newest`` tells the trainer where to continue (it numbers its next version after it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from laminar import transport
from laminar.roles.manager.api import ChainView, follow_chain
from laminar.runtime.clock import Clock, get_clock
from laminar.runtime.executor import LOOP_DEFAULT, Executor
from laminar.runtime.rpc.client import RpcClient
from laminar.transport.shm import SharedBuffer
from laminar.weights.config import PublishConfig
from laminar.weights.manifest import (
    WeightManifest,
    chunk_bounds,
    optimal_chunks,
    plan_specs,
    with_checksums,
)
from laminar.weights.transfer import TransferError, VersionBuffer, VersionConflict, push_version

if TYPE_CHECKING:
    import torch


class WeightPublisher:
    """Stages versions and pushes the newest one to the master relay (see module docstring)."""

    def __init__(
        self,
        config: PublishConfig,
        options: transport.TransportOptions,
        *,
        manager: RpcClient | None = None,
        log: Any = None,
        clock: Clock | None = None,
        executor: Executor = LOOP_DEFAULT,
    ) -> None:
        if config.master is None and manager is None:
            raise ValueError("a publisher needs a manager to find the master, or a fixed master")
        self.config = config
        self.options = options
        self.manager = manager
        self.log = log
        self.clock = clock or get_clock()
        self.executor = executor
        self.view = ChainView()
        self.relay_count = 1
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._in_use: dict[int, np.ndarray] = {}  # version -> its staging array
        self._segments: dict[int, SharedBuffer] = {}  # id(array) -> its segment, if shared
        self._pending: VersionBuffer | None = None
        self._wake = asyncio.Event()
        self._copies: dict[int, Future[Any]] = {}  # version -> its background copy (a fill's)
        self._unfinished: set[int] = set()  # staged, not yet pending or dropped: keep them
        self._finishing: list[VersionBuffer] = []  # handed off, their copies under way, in order
        self._finish_wake = asyncio.Event()
        self.acked = -1  # newest version the master verified
        self.master_newest = -1  # newest version a master refused ours for (VersionConflict)
        self.conflicts = 0  # versions dropped because the master held a newer one
        self._sending = -1
        self.acked_at: dict[int, float] = {}
        self.stalls: list[float] = []
        self.digests: dict[int, str] = {}  # version -> manifest digest (what rollouts must load)

    # -- the trainer's side (any thread) -----------------------------------------------------

    def stage(
        self,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]] = (),
        specs: Sequence[tuple[str, torch.dtype | str, Sequence[int]]] | None = None,
        fill: Callable[[WeightManifest, str | None, memoryview], Future[Any] | None] | None = None,
        *,
        shared: bool | None = None,
    ) -> VersionBuffer:
        """Copy the tensors into a host buffer; returns the staged version. This is the stall,
        timed on the clock: from any thread with the real clock, on the loop with a virtual one
        (where, run in the loop, it takes no virtual time).

        ``specs`` (name, dtype, shape of each tensor, in order): the layout is planned from them
        and ``named`` is read once, one tensor at a time, so a generator that gathers each tensor
        only when asked (a sharded trainer) never has the whole model out at once.

        ``fill(manifest, segment, view)`` (with ``specs``; ``named`` is then not read) writes the
        tensors into the buffer, by ``view`` or, if ``shared`` (the default with a ``fill``), from
        other processes on this host by the shared-memory segment's name (each rank of a sharded
        trainer writes its own rows). It may return a future: the copy is under way, and the
        version goes out once that is done (:meth:`hand_off`)."""
        start = self.clock.time()
        if specs is None:
            # torch: only for a caller that hands over tensors
            from laminar.weights.tensors import plan_tensors

            named = list(named)
            manifest = plan_tensors(named, version)
        else:
            manifest = plan_specs(specs, version)
        shared = fill is not None if shared is None else shared
        array = self._buffer(manifest.total_bytes, shared=shared)
        view = array.data[: max(manifest.total_bytes, 1)]
        with self._lock:  # before any byte moves: no release may recycle this buffer now
            self._in_use[version] = array
            self._unfinished.add(version)
        copying = None
        if fill is not None:
            segment = self._segments[id(array)].name if shared else None
            copying = fill(manifest, segment, view)
        else:
            from laminar.weights.tensors import copy_into

            copy_into(named, manifest, view)
        bounds = chunk_bounds(
            manifest.total_bytes,
            self._chunk_count(manifest.total_bytes),
            max_chunk_bytes=self.config.max_chunk_mib << 20,
        )
        vb = VersionBuffer(manifest, bounds, shared=False, storage=view)
        if copying is not None:
            self._copies[version] = copying
        self.stalls.append(self.clock.time() - start)
        return vb

    def fenced(self, seconds: float) -> None:
        """Training waited ``seconds`` for the newest version's background copy: part of its
        stall."""
        if self.stalls:
            self.stalls[-1] += seconds

    def _chunk_count(self, total: int) -> int:
        if self.config.chunks is not None:
            return self.config.chunks
        return optimal_chunks(  # p nodes: the trainer (its push is pipelined too) + the relays
            self.relay_count + 1,
            total,
            8 / (self.config.link_gbps * 1e9),
            self.config.chunk_start_us * 1e-6,
        )

    def _buffer(self, size: int, shared: bool = False) -> np.ndarray:
        with self._lock:
            for i, array in enumerate(self._free):
                if array.nbytes >= size and (id(array) in self._segments) == shared:
                    return self._free.pop(i)
        if not shared:
            return np.empty(max(size, 1), dtype=np.uint8)
        segment = SharedBuffer(max(size, 1))
        array = np.frombuffer(segment.view, dtype=np.uint8)
        with self._lock:
            self._segments[id(array)] = segment
        return array

    def _release_unused(self) -> None:
        """Recycle staging buffers that are not the newest acked, pending, or being sent.

        The newest acked version is kept because a master that dies right after acking may not
        have passed it on: the new master gets it again from here.
        """
        keep = {self.acked, self._sending}
        if self._pending is not None:
            keep.add(self._pending.version)
        with self._lock:
            keep |= self._unfinished
            for version in [v for v in self._in_use if v not in keep]:
                array = self._in_use.pop(version)
                if not self._free:  # one spare: the next version's, never a pile of them
                    self._free.append(array)
                elif (segment := self._segments.pop(id(array), None)) is not None:
                    segment.close()  # its name; the array's mapping lives while referenced

    # -- the event loop's side -------------------------------------------------------------------

    async def hand_off(self, vb: VersionBuffer) -> None:
        """Make ``vb`` the version to send next, with its checksums (computed here, off the
        stall). If its background copy is still under way this returns at once, and :meth:`run`
        finishes it when the copy is done: the caller goes on training meanwhile."""
        copying = self._copies.get(vb.version)
        if copying is not None and not copying.done():
            self._finishing.append(vb)
            self._finish_wake.set()
            return
        await self._finish(vb)

    async def _finish(self, vb: VersionBuffer, superseded: bool = False) -> None:
        """Checksum ``vb`` once its copy is done and make it pending; drop it instead if its
        copy failed or a newer version was handed off meanwhile (its buffer is recycled only
        now, when nothing writes it any more)."""
        copying = self._copies.pop(vb.version, None)
        failed = None
        try:
            if copying is not None:
                await asyncio.wrap_future(copying)
            if not superseded:
                vb.manifest = await self.executor.run(with_checksums, vb.manifest, vb.view)
        except Exception as exc:  # the version is lost, not the publisher: a newer one follows
            failed = exc
        with self._lock:
            self._unfinished.discard(vb.version)
        if failed is not None or superseded:
            if failed is not None and self.log is not None:
                self.log.error("staging a version failed", version=vb.version, error=str(failed))
            self._release_unused()
            return
        vb.mark_all()
        self.digests[vb.version] = vb.manifest.digest()
        if self._pending is None or vb.version > self._pending.version:
            self._pending = vb
        self._release_unused()  # a version superseded before it was sent
        self._wake.set()

    async def _finish_loop(self) -> None:
        while True:
            await self._finish_wake.wait()
            self._finish_wake.clear()
            while self._finishing:
                vb = self._finishing.pop(0)
                await self._finish(vb, superseded=bool(self._finishing))

    async def run(self) -> None:
        """Follow the chain, finish versions whose copies were under way, and push; runs until
        cancelled (the owner's task)."""
        async with asyncio.TaskGroup() as group:
            if self.config.master is None:
                group.create_task(self._follow_chain())
            group.create_task(self._finish_loop())
            group.create_task(self._push_loop())

    def _master(self) -> str | None:
        if self.config.master is not None:
            return self.config.master
        master = self.view.master
        return master.weights if master else None

    async def _follow_chain(self) -> None:
        assert self.manager is not None
        await follow_chain(
            self.manager,
            self._apply,
            retry_s=self.config.retry_s,
            on_error=lambda exc: self._note("chain watch interrupted", error=str(exc)),
            sleep=self.clock.sleep,
        )

    def _apply(self, view: ChainView) -> None:
        old = self._master()
        self.view = view
        self.relay_count = max(len(view.relays), 1)
        if self._master() != old:
            self._note("master relay", master=self._master(), epoch=view.epoch)
            self._wake.set()

    async def _push_loop(self) -> None:
        while True:
            self._wake.clear()
            master = self._master()
            vb = self._pending
            if master is None or vb is None or vb.version <= self.acked:
                await self._wake.wait()
                continue
            push = asyncio.ensure_future(self._push(master, vb))
            changed = asyncio.ensure_future(self._master_changed(master))
            try:
                await asyncio.wait({push, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (push, changed):
                    task.cancel()
                # wait, not await: awaiting a task we cancelled raises its CancelledError, and
                # suppressing that would swallow a cancellation of this loop arriving meanwhile
                # (the loop would retry on after its owner stopped)
                await asyncio.wait({push, changed})
                if not push.cancelled() and (error := push.exception()) is not None:
                    self._note("push to the master failed", master=master, error=repr(error))
            if vb.version > self.acked:
                await self.clock.sleep(self.config.retry_s)

    async def _master_changed(self, master: str) -> None:
        while self._master() == master:
            self._wake.clear()
            await self._wake.wait()

    async def _push(self, master: str, vb: VersionBuffer) -> None:
        conn = None
        self._sending = vb.version
        try:
            conn = await transport.connect(master, self.options)
            await push_version(conn, vb, timeout=self.config.transfer_timeout_s, refuse_older=True)
            self.acked = vb.version
            self.acked_at[vb.version] = self.clock.wall()
            self._note("version delivered to the master", version=vb.version, master=master)
        except VersionConflict as exc:
            self.master_newest = max(self.master_newest, exc.newest)
            self.conflicts += 1
            if self._pending is vb:  # retrying could never succeed: wait for a newer version
                self._pending = None
            if self.log is not None:
                self.log.error(
                    "version number already published: dropped, the trainer continues after",
                    version=vb.version,
                    master_newest=exc.newest,
                    master=master,
                )
        except (transport.TransportError, TransferError, TimeoutError, OSError) as exc:
            self._note("push to the master failed", master=master, error=str(exc))
        finally:
            self._sending = -1
            self._release_unused()
            if conn is not None:
                conn.close("push finished")

    def _note(self, event: str, **kw: Any) -> None:
        if self.log is not None:
            self.log.info(event, **kw)
