"""``ucx://host:port``: frames as UCX tag messages, through the ``ucxx`` bindings (``ucx`` extra).

UCX picks the fastest path between two peers (shared memory with cross-memory-attach zero copy on
one host, RDMA between hosts) and receives a message straight into the memory it is given, so a
frame's raw buffers land in the :data:`Allocator`'s memory in one pass, as on ``tcp://``.

Wire mapping: one tag message holds ``encode_head(frame)``, then one message per non-empty buffer,
all under the connection's tag for that direction (each side picks a random 64-bit tag and sends
it to the other when the endpoint opens; UCX keeps one sender's messages of one tag in order). The
receiver probes a message before receiving it, so it knows the length first: the head is checked
against ``limits`` (an oversized frame closes the connection before the allocator is called) and
each buffer message must have exactly the size the meta announced. Messages are posted
synchronously, so a cancelled ``send`` or ``recv`` never leaves half a frame behind.

Endpoint error handling (needed to notice a dead peer) makes UCX drop shared memory unless
``UCX_MM_ERROR_HANDLING=y``: it falls back to TCP, several times slower between two processes
of one host. Receiving into preallocated memory matters too: a fresh ``np.empty`` per frame
page-faults about as much as the copy costs (the figures: docs/benchmarks.md, *Transport*).

:func:`_import_ucxx` sets ``UCX_MM_ERROR_HANDLING=y`` and ``UCX_WARN_UNUSED_ENV_VARS=n`` (ucxx
exports variables this UCX does not know) unless set, before ucxx loads libucx: UCX reads its
global options, that warning's switch among them, when the library loads, so whatever asks
whether ucxx is there goes through :func:`available` (a relay that imported ucxx itself first
printed "UCX WARN unused environment variables" at each start). ``UCXPY_PROGRESS_MODE=blocking``
is set likewise, for ucxx's own asyncio API only (far faster through it than in its default
thread mode); this module does not use that API. Importing ucxx is slow, so it happens on the
first connect/listen.

Event loops: works under asyncio's default loop and uvloop alike (both tested). ucxx's asyncio API
is unusable here: in blocking mode it arms the worker only once, after which the loop calls its fd
callback without pause (one core per process, for good), and awaiting a request polls with
``asyncio.sleep(0)``. :class:`_Progress` drives one worker per process instead: it polls while
requests are in flight and for 0.25 ms after any activity (so a round trip between processes
beats ``tcp://``'s), and otherwise arms the worker and sleeps on its fd: idle costs no CPU.

Caveats: UCX buffers eager messages (under ``UCX_RNDV_THRESH``, 8 KiB) that nobody asked for yet,
so a peer flooding small frames grows the receiver's memory; larger sends wait for the receiver.
ucxx listens on every interface (``host`` only names the advertised address); the handshake in
:mod:`.base` keeps strangers out. Small frames cost more Python than on ``tcp://`` (a fraction
of its frames per second, streamed between two processes). Uses ucxx's low-level ``ucxx._lib``
bindings.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from .base import (
    Connection,
    ConnectionClosed,
    Handler,
    Listener,
    Transport,
    TransportOptions,
    parse_host_port,
    register_transport,
)
from .frames import PREFIX_SIZE, Frame, FrameError, Limits, decode_meta, decode_prefix, encode_head
from .reader import Allocator

log = structlog.get_logger("laminar.transport")

ENV_DEFAULTS = {
    "UCX_MM_ERROR_HANDLING": "y",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
_SPIN_S = 0.00025  # keep polling this long after activity
_ids = itertools.count(1)


def _import_ucxx() -> Any:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import ucxx  # noqa: F401  (sets ucxx's UCX defaults, loads libucx)
        from ucxx._lib import libucxx
    except ImportError as exc:
        raise ImportError(
            "the ucx:// transport needs ucxx: install the ucx extra (pip install -e '.[ucx]')"
        ) from exc
    return libucxx


def available() -> bool:
    """Whether ``ucx://`` works here: ucxx imports and loads libucx (imported as this transport
    imports it, with its environment set first)."""
    try:
        _import_ucxx()
    except Exception:  # ImportError, or libucx failing to load (OSError)
        return False
    return True


class _Progress:
    """Progresses the process's one UCX worker from an event loop, without spinning when idle.

    While a request is in flight (or for ``_SPIN_S`` after the last activity) ``progress()`` runs
    once per loop iteration; otherwise it arms the worker and waits for its epoll fd. Coroutines
    wait on :meth:`until` (a predicate re-checked after each progress), never by polling.
    """

    worker: Any = None  # one UCX context and worker per process, created on first use

    def __init__(self, lib: Any, loop: asyncio.AbstractEventLoop) -> None:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        if _Progress.worker is None:
            _Progress.worker = lib.UCXWorker(lib.UCXContext())
            _Progress.worker.init_blocking_progress_mode()
        self.lib, self.array, self.tag = lib, Array, Tag
        self._loop = loop
        self._busy = 0
        self._scheduled = False
        self._spin_until = 0.0
        self._inflight: list[tuple[Any, Any]] = []  # (request, buffer): UCX does not hold it
        self._waiters: dict[asyncio.Future[None], Callable[[], bool]] = {}
        loop.add_reader(self.worker.epoll_file_descriptor, self._readable)
        self.wake()

    def _readable(self) -> None:
        if not self._scheduled:  # else a progress() is queued already
            self.progress()

    def progress(self) -> None:
        self._scheduled = False
        self.worker.progress()
        if self._inflight:
            self._inflight = [entry for entry in self._inflight if not entry[0].completed]
        for waiter, ready in list(self._waiters.items()):
            if not waiter.done() and _safe(ready):
                waiter.set_result(None)
                self._spin_until = 0.0
        now = self._loop.time()
        if self._busy or self._inflight or not self._spin_until:  # 0.0: a waiter just woke
            self._spin_until = now + _SPIN_S
        if now < self._spin_until or not self.worker.arm():  # arm() fails on pending events
            self.wake()

    def wake(self) -> None:
        if not self._scheduled and not self._loop.is_closed():
            self._scheduled = True
            self._loop.call_soon(self.progress)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self._busy += 1
        self.wake()
        try:
            yield
        finally:
            self._busy -= 1

    def post(self, request: Any, buffer: Any) -> Any:
        self._inflight.append((request, buffer))
        self.wake()
        return request

    async def until(self, ready: Callable[[], bool]) -> None:
        if _safe(ready):
            return
        waiter = self._loop.create_future()
        self._waiters[waiter] = ready
        self.wake()
        try:
            await waiter
        finally:
            del self._waiters[waiter]

    async def establish(self, raw: Any, server: bool, timeout: float) -> tuple[Any, Any]:
        """Swap random tags over a new endpoint: ``(send tag, receive tag)``. The endpoint is
        closed if that fails or takes longer than ``timeout``: nothing stays half-open."""
        mine = os.urandom(8)
        theirs = bytearray(8)
        try:
            async with asyncio.timeout(timeout):
                with self.busy():
                    for send in (server, not server):  # the server speaks first
                        op = raw.stream_send if send else raw.stream_recv
                        buf = mine if send else theirs
                        request = self.post(op(self.array(buf)), buf)
                        await self.until(functools.partial(_completed, request))
                        request.check_error()
        except BaseException as exc:
            error = exc
            if isinstance(exc, self.lib.UCXError):
                try:
                    raw.raise_on_error()  # the endpoint's error says more than the request's
                except self.lib.UCXError as endpoint_error:
                    error = endpoint_error
            _abort(raw)
            if error is not exc:
                raise error from exc
            raise
        return self.tag(int.from_bytes(theirs, "little")), self.tag(int.from_bytes(mine, "little"))


def _completed(request: Any) -> bool:
    return bool(request.completed)


def _safe(ready: Callable[[], bool]) -> bool:
    try:
        return ready()
    except Exception:  # e.g. the worker refused a probe: wake up, the caller will find out
        return True


_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Progress] = (
    weakref.WeakKeyDictionary()
)


def _driver() -> _Progress:
    lib = _import_ucxx()
    loop = asyncio.get_running_loop()
    if loop not in _drivers:
        _drivers[loop] = _Progress(lib, loop)
    return _drivers[loop]


def _abort(raw: Any) -> None:
    with contextlib.suppress(Exception):
        raw.close_blocking(period=10**9, max_attempts=1)  # forced: the peer sees an error
        raw.remove_close_callback()


def _flat(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # read here when the recv() that started it was cancelled


def _endpoint_closed(ref: weakref.ref[UcxConnection], loop: asyncio.AbstractEventLoop) -> None:
    conn = ref()  # runs inside UCX progress
    if conn is not None:
        with contextlib.suppress(RuntimeError):  # the loop is closed already
            loop.call_soon_threadsafe(conn.peer_closed)


class UcxConnection(Connection):
    # No RPC liveness pings: a UCX message arrives whole, so progress inside a large one cannot be
    # seen and a ping would give up on a peer that is busy moving it; UCX's own endpoint
    # keepalive and error handling report a dead peer (the close callback).
    can_stall = False

    def __init__(
        self, raw: Any, tags: tuple[Any, Any], driver: _Progress, peer: str, allocator: Allocator
    ) -> None:
        super().__init__(peer, Limits.handshake(), allocator)  # raised after the handshake
        self._raw = raw
        self._send_tag, self._recv_tag = tags
        self._driver = driver
        loop = asyncio.get_running_loop()
        self._closed: asyncio.Future[None] = loop.create_future()
        self._peer_gone = False  # then messages that arrived before may still be read
        self._reading: asyncio.Task[Frame] | None = None
        raw.set_close_callback(_endpoint_closed, (weakref.ref(self), loop))
        weakref.finalize(self, _abort, raw)

    async def send(self, frame: Frame) -> None:
        if self.close_reason is not None:
            raise ConnectionClosed(self.close_reason)
        head = encode_head(frame, self.limits)
        buffers = [_flat(b) for b in frame.buffers if b.nbytes]
        post, array, tag_send = self._driver.post, self._driver.array, self._raw.tag_send
        try:
            requests = [post(tag_send(array(m), self._send_tag), m) for m in (head, *buffers)]
        except Exception as exc:
            self.close(f"connection lost: {type(exc).__name__}: {exc}")
            raise ConnectionClosed(self.close_reason or "") from exc
        await self._complete(requests, lambda: self._closed.done())
        self.bytes_sent += len(head) + sum(b.nbytes for b in buffers)

    async def recv(self) -> Frame:
        if self._reading is None:
            self._reading = asyncio.get_running_loop().create_task(self._read_frame())
            self._reading.add_done_callback(_retrieve)
        reading = self._reading
        try:
            return await asyncio.shield(reading)  # a cancelled recv() leaves the frame to the next
        finally:
            if reading.done() and self._reading is reading:
                self._reading = None

    def close(self, reason: str = "closed locally") -> None:
        if self.close_reason is None:
            self.close_reason = reason
        if self._closed.done():
            return
        self._closed.set_result(None)
        self._driver.wake()  # waiters re-check, see the connection closed and give up
        _abort(self._raw)  # cancels this endpoint's requests

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def peer_closed(self) -> None:
        self._peer_gone = True
        self.close("peer closed the connection")

    async def _read_frame(self) -> Frame:
        lim = self.limits
        try:
            (head,) = await self._receive(PREFIX_SIZE + lim.max_meta_bytes + lim.max_payload_bytes)
            if len(head) < PREFIX_SIZE:
                raise FrameError(f"a message of {len(head)} bytes is not a frame head")
            prefix = decode_prefix(head[:PREFIX_SIZE], lim)
            meta_end = PREFIX_SIZE + prefix.meta_len
            if len(head) != meta_end + prefix.payload_len:
                raise FrameError(f"head of {len(head)} bytes does not match its prefix")
            meta = decode_meta(head[PREFIX_SIZE:meta_end], prefix, lim)
            frame = Frame(meta, bytes(head[meta_end:]))
            sizes: list[int] = meta.pop("b", [])
            if sizes:
                dests = self.allocator(meta, sizes)
                if [d.nbytes for d in dests] != sizes:
                    raise FrameError("allocator returned buffers of the wrong sizes")
                await self._receive(0, [_flat(d) for d in dests if d.nbytes])
                frame.buffers = dests
        except FrameError as exc:
            self.close(f"protocol error: {exc}")
            raise ConnectionClosed(self.close_reason or "") from exc
        self.bytes_received += len(head) + prefix.buffers_len
        return frame

    async def _receive(self, limit: int, dests: list[memoryview] | None = None) -> list[memoryview]:
        """One message of at most ``limit`` bytes, or one message into each of ``dests``, each of
        exactly that size. Each message is probed, not yet received, until it has arrived."""
        driver, worker, tag = self._driver, self._driver.worker, self._recv_tag
        requests, received = [], []
        for dest in dests if dests is not None else [None]:
            probe: Any = None

            def arrived() -> bool:
                nonlocal probe
                if self._closed.done() and not self._peer_gone:
                    return True  # closed here: stop reading (after the peer left: drain)
                probe = worker.tag_probe(tag)
                return probe.matched or self._closed.done()

            await driver.until(arrived)
            if probe is None or not probe.matched:
                raise ConnectionClosed(self.close_reason or "connection closed")
            if dest is None and probe.length > limit:
                raise FrameError(f"message of {probe.length} bytes over the limit {limit}")
            if dest is not None and probe.length != dest.nbytes:
                raise FrameError(f"message of {probe.length} bytes for a {dest.nbytes}-byte buffer")
            if dest is None:
                dest = memoryview(bytearray(probe.length))
            request = worker.tag_recv_with_handle(
                driver.array(dest), worker.tag_probe(tag, remove=True)
            )
            requests.append(driver.post(request, dest))
            received.append(dest)
        # after the peer left, what it sent before may still complete: wait for it then
        await self._complete(requests, lambda: self._closed.done() and not self._peer_gone)
        return received

    async def _complete(self, requests: list[Any], abandon: Callable[[], bool]) -> None:
        if not all(r.completed for r in requests):
            with self._driver.busy():
                await self._driver.until(lambda: abandon() or all(r.completed for r in requests))
        try:
            for request in requests:
                if not request.completed:
                    raise ConnectionClosed(self.close_reason or "connection closed")
                request.check_error()
        except ConnectionClosed:
            raise
        except Exception as exc:  # ucxx's own error types: canceled, reset, truncated, ...
            self.close(f"connection lost: {type(exc).__name__}: {exc}")
            raise ConnectionClosed(self.close_reason or "") from exc


class UcxListener(Listener):
    def __init__(self) -> None:
        super().__init__("")  # the address is known once ucxx has bound the port
        self.ucx_listener: Any = None  # listening stops when this is dropped

    async def close(self) -> None:
        self.ucx_listener = None
        await self.cancel_handlers()


class UcxTransport(Transport):
    scheme = "ucx"

    async def connect(self, rest: str, options: TransportOptions) -> Connection:
        host, port = parse_host_port("ucx", rest)
        driver = _driver()
        try:
            raw = driver.lib.UCXEndpoint.create(driver.worker, host, port, True)
            tags = await driver.establish(raw, False, options.connect_timeout)
        except driver.lib.UCXError as exc:
            raise ConnectionRefusedError(f"ucx://{host}:{port}: {exc}") from exc
        return UcxConnection(raw, tags, driver, f"ucx://{host}:{port}", options.allocator)

    async def listen(
        self, rest: str, options: TransportOptions, on_connection: Handler
    ) -> Listener:
        host, port = parse_host_port("ucx", rest)
        driver = _driver()
        loop = asyncio.get_running_loop()
        listener = UcxListener()

        async def accept(raw: Any) -> None:
            try:  # connect_timeout bounds the tag swap, the generic listen() the handshake
                tags = await driver.establish(raw, True, options.connect_timeout)
            except (driver.lib.UCXError, TimeoutError) as exc:
                log.info("ucx peer failed to connect", error=f"{type(exc).__name__}: {exc}")
                return
            peer = f"{listener.address}#{next(_ids)}"
            conn = UcxConnection(raw, tags, driver, peer, options.allocator)
            try:
                await on_connection(conn)
            except ConnectionClosed as exc:  # the peer left while the handler was reading
                log.debug("ucx connection ended", peer=conn.peer, reason=exc.reason)
            finally:
                conn.close("server side finished")

        def on_request(conn_request: Any) -> None:  # inside UCX progress: defer to the loop
            ucx_listener = listener.ucx_listener
            if ucx_listener is not None:
                raw = ucx_listener.create_endpoint_from_conn_request(conn_request, True)
                listener.track(loop.create_task(accept(raw)))

        listener.ucx_listener = driver.lib.UCXListener.create(driver.worker, port, on_request)
        shown = f"[{host}]" if ":" in host else host
        listener.address = f"ucx://{shown}:{listener.ucx_listener.port}"
        return listener


register_transport("ucx", UcxTransport)
