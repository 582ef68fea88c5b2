"""Request/reply, one-way and streaming calls over any transport connection.

Frame kinds (meta ``k``), all other meta keys short: ``i`` call id, ``m`` method::

    CALL    i m  payload=request      ->  REPLY i payload=response | ERROR i e
    NOTIFY    m  payload=request      ->  (nothing; failures are logged on the server)
    STREAM  i m  payload=request      ->  ITEM i payload=item ... END i | ERROR i e
    CANCEL  i                         ->  the server cancels the handler task of call i

Guarantees, and why:

* Every call has a timeout (default from the client). On timeout or when the caller is cancelled,
  a CANCEL goes to the server, so abandoned work does not keep running there.
* A dropped connection fails every pending call of that connection at once with
  :class:`PeerUnavailable` (a peer killed with -9 closes its sockets in the kernel, so this is
  immediate); calls are not retried automatically because they need not be idempotent. The next
  call reconnects, with exponential backoff while the peer stays down.
* A handler's exception comes back as :class:`RemoteError` naming role, instance, method and
  cause; a request that fails validation is a :class:`BadRequest` and the handler never runs.
* Handler tasks belong to their connection: when it closes they are cancelled and awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import traceback
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import structlog
from pydantic import BaseModel, ValidationError

from laminar.transport import (
    AuthenticationError,
    Connection,
    ConnectionClosed,
    Frame,
    FrameError,
    Listener,
    TransportOptions,
    connect,
    decode_payload,
    encode_payload,
    listen,
)

from .endpoint import EndpointSpec, endpoints_of
from .errors import REMOTE_ERROR_KINDS, CallTimeout, PeerUnavailable

log = structlog.get_logger("laminar.rpc")

K_CALL, K_REPLY, K_ERROR, K_NOTIFY, K_STREAM, K_ITEM, K_END, K_CANCEL = range(16, 24)

S = TypeVar("S")


@dataclass(frozen=True)
class CallContext:
    """Who is calling; available to handlers through :data:`current_call`."""

    connection_id: int
    peer: str
    method: str


current_call: ContextVar[CallContext] = ContextVar("laminar_current_call")
_connection_ids = itertools.count(1)


def _encode(model: BaseModel | None) -> tuple[bytes, list[memoryview]]:
    return encode_payload(model.model_dump() if model is not None else None)


def _decode(cls: type[BaseModel] | None, frame: Frame) -> Any:
    data = decode_payload(frame.payload, frame.buffers)
    return cls.model_validate(data) if cls is not None else None


# ----------------------------------------------------------------------------------------------
# server


class RpcServer:
    """Serves the endpoints of one service object on any number of listeners."""

    def __init__(
        self,
        target: object,
        options: TransportOptions,
        *,
        role: str,
        instance: str,
        on_disconnect: Callable[[int], None] | None = None,
        observe: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self.target = target
        self.options = options
        self.role = role
        self.instance = instance
        self.on_disconnect = on_disconnect
        self.observe = observe  # (method, outcome, seconds) for metrics
        self.endpoints = endpoints_of(type(target))
        self.listeners: list[Listener] = []
        self.connections: set[Connection] = set()

    async def listen(self, address: str) -> Listener:
        listener = await listen(address, self.options, self.serve_connection)
        self.listeners.append(listener)
        return listener

    async def close(self) -> None:
        for listener in self.listeners:
            await listener.close()
        self.listeners.clear()

    async def serve_connection(self, conn: Connection) -> None:
        conn_id = next(_connection_ids)
        tasks: dict[int, asyncio.Task[None]] = {}
        oneway: set[asyncio.Task[None]] = set()
        self.connections.add(conn)
        try:
            while True:
                frame = await conn.recv()
                kind, call_id = frame.meta.get("k"), frame.meta.get("i")
                if kind == K_CANCEL:
                    task = tasks.get(call_id)  # type: ignore[arg-type]
                    if task is not None:
                        task.cancel()
                    continue
                method = frame.meta.get("m")
                if kind not in (K_CALL, K_NOTIFY, K_STREAM) or not isinstance(method, str):
                    raise FrameError(f"unexpected frame kind {kind!r}")
                ctx = CallContext(conn_id, conn.peer, method)
                coro = self._run(conn, ctx, kind, call_id, frame)
                if kind == K_NOTIFY:
                    task = asyncio.create_task(coro)
                    oneway.add(task)
                    task.add_done_callback(oneway.discard)
                    continue
                if not isinstance(call_id, int) or call_id in tasks:
                    coro.close()
                    raise FrameError(f"bad or duplicate call id {call_id!r}")
                task = asyncio.create_task(coro)
                tasks[call_id] = task
                task.add_done_callback(lambda _t, i=call_id: tasks.pop(i, None))
        except ConnectionClosed:
            pass
        except FrameError as exc:
            log.warning("closing connection: protocol error", peer=conn.peer, error=str(exc))
            conn.close(f"protocol error: {exc}")
        finally:
            self.connections.discard(conn)
            pending = [*tasks.values(), *oneway]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            if self.on_disconnect is not None:
                self.on_disconnect(conn_id)

    async def _run(
        self, conn: Connection, ctx: CallContext, kind: int, call_id: Any, frame: Frame
    ) -> None:
        current_call.set(ctx)
        started = time.perf_counter()
        outcome = "ok"
        try:
            found = self.endpoints.get(ctx.method)
            if found is None:
                outcome = "unknown_method"
                await self._error(
                    conn,
                    kind,
                    call_id,
                    ctx.method,
                    "unknown_method",
                    "LookupError",
                    f"no endpoint {ctx.method!r} (has: {', '.join(self.endpoints)})",
                )
                return
            spec, fn = found
            if (kind == K_STREAM) != (spec.kind == "stream"):
                outcome = "bad_request"
                verb = "stream()" if spec.kind == "stream" else "call() or notify()"
                await self._error(
                    conn,
                    kind,
                    call_id,
                    ctx.method,
                    "bad_request",
                    "TypeError",
                    f"{ctx.method} is a {spec.kind} endpoint; use {verb}",
                )
                return
            try:
                request = _decode(spec.request, frame)
            except (ValidationError, FrameError) as exc:
                outcome = "bad_request"
                await self._error(
                    conn, kind, call_id, ctx.method, "bad_request", type(exc).__name__, str(exc)
                )
                return
            args = (request,) if spec.request is not None else ()
            if spec.kind == "stream":
                await self._stream(conn, spec, call_id, fn(self.target, *args))
            else:
                result = await fn(self.target, *args)
                if kind == K_CALL:
                    payload, buffers = _encode(self._checked(spec, result))
                    await conn.send(Frame({"k": K_REPLY, "i": call_id}, payload, buffers))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except ConnectionClosed:
            outcome = "disconnected"
        except Exception as exc:
            outcome = "error"
            if kind == K_NOTIFY:
                log.exception("one-way call failed", method=ctx.method, peer=ctx.peer)
            else:
                log.debug("endpoint raised", method=ctx.method, error=repr(exc))
            await self._error(
                conn,
                kind,
                call_id,
                ctx.method,
                "remote",
                type(exc).__name__,
                str(exc),
                traceback.format_exc(),
            )
        finally:
            if self.observe is not None:
                self.observe(ctx.method, outcome, time.perf_counter() - started)

    async def _stream(
        self, conn: Connection, spec: EndpointSpec, call_id: int, items: AsyncIterator[Any]
    ) -> None:
        try:
            sent = 0
            async for item in items:
                payload, buffers = _encode(self._checked(spec, item))
                await conn.send(Frame({"k": K_ITEM, "i": call_id}, payload, buffers))
                sent += 1
                if sent % 16 == 0:
                    # A generator that never awaits would otherwise hold the loop until it ends:
                    # no CANCEL could be read, no heartbeat answered.
                    await asyncio.sleep(0)
        finally:
            await items.aclose()  # type: ignore[attr-defined]
        await conn.send(Frame({"k": K_END, "i": call_id}))

    @staticmethod
    def _checked(spec: EndpointSpec, value: Any) -> BaseModel | None:
        expected = spec.response
        if expected is None and value is None:
            return None
        if expected is not None and isinstance(value, expected):
            return value
        raise TypeError(
            f"{spec.name} returned {type(value).__name__}, declared "
            f"{expected.__name__ if expected else 'None'}"
        )

    async def _error(
        self,
        conn: Connection,
        kind: int,
        call_id: Any,
        method: str,
        err: str,
        cause_type: str,
        cause: str,
        tb: str | None = None,
    ) -> None:
        if kind == K_NOTIFY:
            if err != "remote":
                log.warning("one-way call rejected", method=method, error=cause)
            return
        info = {
            "kind": err,
            "type": cause_type,
            "msg": cause,
            "role": self.role,
            "instance": self.instance,
            "method": method,
            "tb": tb,
        }
        with contextlib.suppress(ConnectionClosed):
            await conn.send(Frame({"k": K_ERROR, "i": call_id, "e": info}))


# ----------------------------------------------------------------------------------------------
# client


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays: ``initial * factor**n`` capped at ``maximum``, with ±20% jitter."""

    initial: float = 0.05
    factor: float = 2.0
    maximum: float = 2.0

    def delay(self, attempt: int) -> float:
        base = min(self.maximum, self.initial * self.factor**attempt)
        return base * random.uniform(0.8, 1.2)


class RpcClient:
    """Calls to one address. Connects lazily, reconnects with backoff, fails fast on loss."""

    def __init__(
        self,
        address: str,
        options: TransportOptions,
        *,
        timeout: float = 30.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.address = address
        self.options = options
        self.timeout = timeout
        self.backoff = backoff or Backoff()
        self._conn: Connection | None = None
        self._reader: asyncio.Task[None] | None = None
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
                except (OSError, TimeoutError, ConnectionClosed) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    await asyncio.sleep(self.backoff.delay(self._failures))
                    self._failures += 1
                    continue
                self._failures = 0
                self._conn = conn
                self._reader = asyncio.create_task(self._read(conn))
                return conn

    async def _read(self, conn: Connection) -> None:
        reason = "connection closed"
        try:
            while True:
                frame = await conn.recv()
                waiter = self._pending.get(frame.meta.get("i"))  # type: ignore[arg-type]
                if isinstance(waiter, asyncio.Queue):
                    waiter.put_nowait(frame)
                elif waiter is not None and not waiter.done():
                    waiter.set_result(frame)
        except ConnectionClosed as exc:
            reason = exc.reason
        finally:
            conn.close(reason)
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
        if self._conn is not None:
            self._conn.close("client closed")
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
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
        payload, buffers = _encode(request)
        call_id = next(self._ids)
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        conn: Connection | None = None
        self._pending[call_id] = future
        try:
            async with asyncio.timeout(timeout):
                conn = await self._connection()
                await conn.send(Frame({"k": K_CALL, "i": call_id, "m": method}, payload, buffers))
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
        finally:
            self._pending.pop(call_id, None)
        return self._result(frame, reply_type)

    def notify(self, method: str, request: BaseModel | None) -> None:
        payload, buffers = _encode(request)

        async def send() -> None:
            try:
                async with asyncio.timeout(self.timeout):
                    conn = await self._connection()
                    await conn.send(Frame({"k": K_NOTIFY, "m": method}, payload, buffers))
            except (PeerUnavailable, ConnectionClosed, TimeoutError) as exc:
                log.debug(
                    "one-way call dropped", address=self.address, method=method, error=str(exc)
                )

        task = asyncio.create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stream(
        self,
        method: str,
        request: BaseModel | None,
        item_type: type[BaseModel] | None,
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[Any]:
        """Items of a server stream; ``timeout`` bounds connecting and each wait for an item."""
        payload, buffers = _encode(request)
        call_id = next(self._ids)
        queue: asyncio.Queue[Frame | Exception] = asyncio.Queue()
        self._pending[call_id] = queue
        conn: Connection | None = None
        finished = False
        try:
            try:
                async with asyncio.timeout(timeout if timeout is not None else self.timeout):
                    conn = await self._connection()
                    await conn.send(
                        Frame({"k": K_STREAM, "i": call_id, "m": method}, payload, buffers)
                    )
            except TimeoutError:
                raise PeerUnavailable(self.address, self.last_error) from None
            except ConnectionClosed as exc:
                raise PeerUnavailable(self.address, exc.reason) from None
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
                yield _decode(item_type, item)
        finally:
            self._pending.pop(call_id, None)
            if conn is not None and not finished:
                self._cancel_remote(conn, call_id)

    # -- helpers --

    def _cancel_remote(self, conn: Connection, call_id: int) -> None:
        if conn.closed:
            return

        async def send() -> None:
            with contextlib.suppress(ConnectionClosed):
                await conn.send(Frame({"k": K_CANCEL, "i": call_id}))

        task = asyncio.create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _result(self, frame: Frame, reply_type: type[BaseModel] | None) -> Any:
        if frame.meta.get("k") == K_ERROR:
            e = frame.meta.get("e") or {}
            cls = REMOTE_ERROR_KINDS.get(e.get("kind"), REMOTE_ERROR_KINDS["remote"])
            raise cls(
                str(e.get("role", "?")),
                str(e.get("instance", "?")),
                str(e.get("method", "?")),
                str(e.get("type", "?")),
                str(e.get("msg", "")),
                e.get("tb"),
            )
        return _decode(reply_type, frame)


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
        return cast(BaseModel, args[0])

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
