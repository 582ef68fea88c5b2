"""The calling side of RPC: :class:`RpcClient` (one address, reconnects with backoff, fails fast
when the connection drops) and typed proxies (``remote(Manager, client).join.call(req)``).

The frame kinds are in :mod:`laminar.runtime.rpc.wire`, the guarantees in
:mod:`laminar.runtime.rpc.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

import structlog
from pydantic import BaseModel

from laminar.transport import (
    AuthenticationError,
    Connection,
    ConnectionClosed,
    Frame,
    MessageTooLarge,
    TransportOptions,
    connect,
)
from laminar.transport.frames import check_outgoing

from ..endpoint import EndpointSpec, endpoints_of
from ..errors import REMOTE_ERROR_KINDS, CallTimeout, PeerUnavailable
from .wire import (
    K_CALL,
    K_CANCEL,
    K_CREDIT,
    K_END,
    K_ERROR,
    K_NOTIFY,
    K_PING,
    K_STREAM,
    PING_CHECKS,
    STREAM_WINDOW,
    decode_model,
    encode_model,
)

log = structlog.get_logger("laminar.runtime.rpc.server")

S = TypeVar("S")


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays: ``initial * factor**n`` capped at ``maximum``, with ±20% jitter."""

    initial: float = 0.05
    factor: float = 2.0
    maximum: float = 2.0

    def delay(self, attempt: int) -> float:
        base = min(self.maximum, self.initial * self.factor**attempt)
        return base * random.uniform(0.8, 1.2)


#: Per-item timeout for subscriptions that may stay silent indefinitely (a chain that does not
#: change, no new weight version). Liveness comes from the connection itself: a dead peer ends the
#: stream with an error (at once when its kernel resets the connection, within the transport's
#: ``peer_timeout`` when it went silent), so the subscriber never relies on this timeout.
QUIET_STREAM_TIMEOUT_S = 365 * 24 * 3600.0


class RpcClient:
    """Calls to one address. Connects lazily, reconnects with backoff, fails fast on loss."""

    def __init__(
        self,
        address: str,
        options: TransportOptions,
        *,
        timeout: float = 30.0,
        backoff: Backoff | None = None,
        stream_window: int = STREAM_WINDOW,
    ) -> None:
        if stream_window < 2:
            raise ValueError(f"stream_window must be at least 2, got {stream_window}")
        self.address = address
        self.options = options
        self.timeout = timeout
        self.backoff = backoff or Backoff()
        self.stream_window = stream_window
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop self._conn was made on
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Frame] | asyncio.Queue[Frame | Exception]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._failures = 0
        self.last_error = "timed out connecting"

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    # -- connection management --

    async def _connection(self) -> Connection:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        async with self._lock:
            while True:
                if self._closed:
                    raise PeerUnavailable(self.address, "client closed")
                if self._conn is not None and not self._conn.closed:
                    return self._conn
                try:
                    conn = await connect(self.address, self.options)
                except AuthenticationError as exc:
                    raise PeerUnavailable(self.address, str(exc)) from exc
                except ConnectionRefusedError as exc:
                    # Nothing listens there: the peer is gone, or restarted on another port.
                    # Retrying this address until the call's timeout would keep rollouts paused
                    # and the trainer idle after a relay or data role restart; failing now lets
                    # the caller look the peer up again.
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    raise PeerUnavailable(self.address, self.last_error) from exc
                except (OSError, TimeoutError, ConnectionClosed) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    await asyncio.sleep(self.backoff.delay(self._failures))
                    self._failures += 1
                    continue
                self._failures = 0
                self._conn, self._loop = conn, asyncio.get_running_loop()
                conn.deliver_to(self._on_frame, partial(self._lost, conn))
                if conn.can_stall and self.options.peer_timeout is not None:
                    self._spawn(self._watch(conn, self.options.peer_timeout))
                return conn

    async def _watch(self, conn: Connection, peer_timeout: float) -> None:
        """Close ``conn`` once the peer has been silent for ``peer_timeout`` despite pings.

        Progress is any byte received, or our send backlog shrinking (the peer is reading a long
        upload and has nothing to say). Counting quiet *checks* rather than elapsed time keeps a
        stall of this process's own event loop from looking like a silent peer.
        """
        interval = peer_timeout / PING_CHECKS
        received, flushed, backlog = _progress(conn)
        quiet = 0
        ping: asyncio.Task[None] | None = None
        while True:
            await asyncio.sleep(interval)
            if conn.closed:
                return
            was_received, was_flushed, had_backlog = received, flushed, backlog
            received, flushed, backlog = _progress(conn)
            if received != was_received or (had_backlog and flushed > was_flushed):
                quiet = 0
                continue
            quiet += 1
            if quiet >= PING_CHECKS:
                reason = f"peer silent for {peer_timeout:g} s (pings unanswered)"
                log.warning("closing a silent connection", address=self.address, reason=reason)
                conn.close(reason)
                return
            if ping is None or ping.done():  # one at a time: a send may wait on a full buffer
                ping = asyncio.create_task(self._ping(conn))
                self._background.add(ping)
                ping.add_done_callback(self._background.discard)

    @staticmethod
    async def _ping(conn: Connection) -> None:
        with contextlib.suppress(ConnectionClosed):
            await conn.send(Frame({"k": K_PING}))

    def _on_frame(self, frame: Frame) -> None:
        """A reply or stream item, from the event loop as it arrives: straight to its waiter."""
        call_id = frame.meta.get("i")
        waiter = self._pending.get(call_id) if isinstance(call_id, int) else None
        if isinstance(waiter, asyncio.Queue):
            waiter.put_nowait(frame)
        elif waiter is not None and not waiter.done():
            waiter.set_result(frame)

    def _lost(self, conn: Connection, reason: str) -> None:
        """``conn`` closed: every call waiting on it fails now (the next call reconnects)."""
        if self._conn is conn:
            self._conn = None
        error = PeerUnavailable(self.address, reason)
        for waiter in list(self._pending.values()):
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(error)
            elif not waiter.done():
                waiter.set_exception(error)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._background):
            task.cancel()
        conn = self._conn
        if conn is not None:
            conn.close("client closed")
            await conn.wait_closed()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -- verbs --

    async def call(
        self,
        method: str,
        request: BaseModel | None,
        reply_type: type[BaseModel] | None,
        *,
        timeout: float | None = None,
    ) -> Any:
        timeout = self.timeout if timeout is None else timeout
        payload, buffers = encode_model(request)
        call_id = next(self._ids)
        request_frame = Frame({"k": K_CALL, "i": call_id, "m": method}, payload, buffers)
        conn: Connection | None = self._conn
        # The loop the connection was made on: on Python 3.11 asyncio.get_running_loop() makes a
        # getpid() system call each time (docs/benchmarks.md, *Transport*).
        loop = self._loop
        if conn is None or loop is None:
            loop = asyncio.get_running_loop()
        future: asyncio.Future[Frame] = loop.create_future()
        self._pending[call_id] = future
        try:
            if conn is not None and conn.try_send(request_frame):
                # Connected, and the request went out without waiting: only the reply is left to
                # time out, and a timer on its future does that for a fraction of
                # asyncio.timeout's cost (docs/benchmarks.md, *Transport*). The common case, and
                # the round trip benchmarks/transport.py times.
                timer = loop.call_later(timeout, _expire, future)
                try:
                    frame = await future
                finally:
                    timer.cancel()
            else:
                conn = None
                async with asyncio.timeout(timeout):
                    conn = await self._connection()
                    await conn.send(request_frame)
                    frame = await future
        except TimeoutError:
            if conn is None:
                raise PeerUnavailable(self.address, self.last_error) from None
            self._cancel_remote(conn, call_id)
            raise CallTimeout(self.address, method, timeout) from None
        except asyncio.CancelledError:
            if conn is not None:
                self._cancel_remote(conn, call_id)
            raise
        except ConnectionClosed as exc:
            raise PeerUnavailable(self.address, exc.reason) from None
        except MessageTooLarge as exc:
            raise MessageTooLarge(f"{method} request to {self.address}: {exc}") from None
        finally:
            self._pending.pop(call_id, None)
        return self._result(frame, reply_type)

    def notify(self, method: str, request: BaseModel | None) -> None:
        payload, buffers = encode_model(request)
        try:  # here, not in the background send, so the caller gets the error
            check_outgoing(0, len(payload), [b.nbytes for b in buffers], self.options.limits)
        except MessageTooLarge as exc:
            raise MessageTooLarge(f"{method} notification to {self.address}: {exc}") from None

        async def send() -> None:
            try:
                async with asyncio.timeout(self.timeout):
                    conn = await self._connection()
                    await conn.send(Frame({"k": K_NOTIFY, "m": method}, payload, buffers))
            except (PeerUnavailable, ConnectionClosed, TimeoutError) as exc:
                log.debug(
                    "one-way call dropped", address=self.address, method=method, error=str(exc)
                )

        self._spawn(send())

    async def stream(
        self,
        method: str,
        request: BaseModel | None,
        item_type: type[BaseModel] | None,
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[Any]:
        """Items of a server stream; ``timeout`` bounds connecting and each wait for an item."""
        payload, buffers = encode_model(request)
        call_id = next(self._ids)
        queue: asyncio.Queue[Frame | Exception] = asyncio.Queue()
        self._pending[call_id] = queue
        conn: Connection | None = None
        finished = False
        taken, half = 0, self.stream_window // 2
        try:
            try:
                async with asyncio.timeout(timeout if timeout is not None else self.timeout):
                    conn = await self._connection()
                    meta = {"k": K_STREAM, "i": call_id, "m": method, "c": self.stream_window}
                    await conn.send(Frame(meta, payload, buffers))
            except TimeoutError:
                raise PeerUnavailable(self.address, self.last_error) from None
            except ConnectionClosed as exc:
                raise PeerUnavailable(self.address, exc.reason) from None
            except MessageTooLarge as exc:
                raise MessageTooLarge(f"{method} request to {self.address}: {exc}") from None
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        item = await queue.get()
                except TimeoutError:
                    raise CallTimeout(self.address, method, timeout or 0.0) from None
                if isinstance(item, Exception):
                    finished = True
                    raise item
                kind = item.meta.get("k")
                if kind == K_END:
                    finished = True
                    return
                if kind == K_ERROR:
                    finished = True
                    self._result(item, None)
                taken += 1
                if taken == half:  # top the producer's window up (laminar.runtime.rpc.calls.Credit)
                    taken = 0
                    self._grant(conn, call_id, half)
                yield decode_model(item_type, item)
        finally:
            self._pending.pop(call_id, None)
            if conn is not None and not finished:
                self._cancel_remote(conn, call_id)

    # -- helpers --

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run background work owned by this client (cancelled by close())."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _grant(self, conn: Connection | None, call_id: int, n: int) -> None:
        if conn is None or conn.closed:
            return

        async def send() -> None:
            with contextlib.suppress(ConnectionClosed):
                await conn.send(Frame({"k": K_CREDIT, "i": call_id, "n": n}))

        self._spawn(send())

    def _cancel_remote(self, conn: Connection, call_id: int) -> None:
        if conn.closed:
            return

        async def send() -> None:
            with contextlib.suppress(ConnectionClosed):
                await conn.send(Frame({"k": K_CANCEL, "i": call_id}))

        self._spawn(send())

    def _result(self, frame: Frame, reply_type: type[BaseModel] | None) -> Any:
        if frame.meta.get("k") == K_ERROR:
            e = frame.meta.get("e") or {}
            cls = REMOTE_ERROR_KINDS.get(str(e.get("kind")), REMOTE_ERROR_KINDS["remote"])
            raise cls(
                str(e.get("role", "?")),
                str(e.get("instance", "?")),
                str(e.get("method", "?")),
                str(e.get("type", "?")),
                str(e.get("msg", "")),
                e.get("tb"),
            )
        return decode_model(reply_type, frame)


def _expire(future: asyncio.Future[Frame]) -> None:
    """A call's timer: its reply did not come in time (``call`` turns this into CallTimeout)."""
    if not future.done():
        future.set_exception(TimeoutError())


def _progress(conn: Connection) -> tuple[int, int, int]:
    """(bytes received, bytes handed to the OS, bytes still queued to send) of ``conn``."""
    backlog = conn.backlog
    return conn.bytes_received, conn.bytes_sent - backlog, backlog


# ----------------------------------------------------------------------------------------------
# typed proxies


class RemoteRef:
    """The verbs of one endpoint of a remote service."""

    def __init__(self, client: RpcClient, spec: EndpointSpec, timeout: float | None = None):
        self._client = client
        self._spec = spec
        self._timeout = timeout

    def _request(self, args: tuple[Any, ...]) -> BaseModel | None:
        spec = self._spec
        if spec.request is None:
            if args:
                raise TypeError(f"{spec.name} takes no request")
            return None
        if len(args) != 1 or not isinstance(args[0], spec.request):
            got = ", ".join(type(a).__name__ for a in args) or "nothing"
            raise TypeError(f"{spec.name} expects one {spec.request.__name__}, got {got}")
        return args[0]

    async def call(self, *args: Any) -> Any:
        if self._spec.kind != "call":
            raise TypeError(f"{self._spec.name} is a stream endpoint; use .stream()")
        return await self._client.call(
            self._spec.name, self._request(args), self._spec.response, timeout=self._timeout
        )

    def notify(self, *args: Any) -> None:
        if self._spec.kind != "call":
            raise TypeError(f"{self._spec.name} is a stream endpoint; use .stream()")
        self._client.notify(self._spec.name, self._request(args))

    def stream(self, *args: Any) -> AsyncIterator[Any]:
        if self._spec.kind != "stream":
            raise TypeError(f"{self._spec.name} is not a stream endpoint; use .call()")
        return self._client.stream(
            self._spec.name, self._request(args), self._spec.response, timeout=self._timeout
        )

    def options(self, *, timeout: float) -> RemoteRef:
        return RemoteRef(self._client, self._spec, timeout)


class RemoteService:
    """Stands in for a service object in another process: attributes are endpoint refs."""

    def __init__(self, cls: type, client: RpcClient) -> None:
        self._cls = cls
        self._client = client
        self._endpoints = endpoints_of(cls)

    def __getattr__(self, name: str) -> RemoteRef:
        try:
            spec, _ = self._endpoints[name]
        except KeyError:
            raise AttributeError(f"{self._cls.__name__} has no endpoint {name!r}") from None
        return RemoteRef(self._client, spec)

    @property
    def client(self) -> RpcClient:
        return self._client

    def __repr__(self) -> str:
        return f"<remote {self._cls.__name__} at {self._client.address}>"


def remote(cls: type[S], client: RpcClient) -> S:
    """A proxy typed as ``cls``: ``remote(Manager, c).join.call(req)`` type-checks like Monarch."""
    return cast(S, RemoteService(cls, client))
