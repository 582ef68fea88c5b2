"""Request/reply, one-way and streaming calls over any transport connection: the protocol and the
serving side. The calling side is :mod:`laminar.rpc_client`.

Frame kinds (meta ``k``), all other meta keys short: ``i`` call id, ``m`` method::

    CALL    i m  payload=request      ->  REPLY i payload=response | ERROR i e
    NOTIFY    m  payload=request      ->  (nothing; failures are logged on the server)
    STREAM  i m  payload=request      ->  ITEM i payload=item ... END i | ERROR i e
    CANCEL  i                         ->  the server cancels the handler task of call i
    PING                              ->  PONG (liveness of an otherwise quiet connection)

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
* A connection runs at most ``max_in_flight`` requests at once (an open stream counts). Beyond
  that the server reads as many again ahead (handling their CANCELs and any PING) and then stops
  reading that connection until one finishes, so the transport's flow control (TCP's window)
  stops a sender that outpaces the handlers, instead of this process growing a task per frame.
  While it does not read, it sends a PONG every ping interval unasked, so the peer's liveness
  check does not take a busy server for a dead one.
* A connection that goes silent (peer host crashed, link cut, process stopped) is closed by the
  client once its pings go unanswered for the transport's ``peer_timeout``; pending calls then
  fail with :class:`PeerUnavailable` and the next call reconnects. Without that, a dead peer that
  sent no reset would keep calls, heartbeats and idle streams waiting for many minutes.
* A message over the cluster's size limits fails at its sender with ``MessageTooLarge`` (a reply
  or stream item: as a :class:`RemoteError` of that type), never by a dropped connection.
* Token ids and logprobs (fields annotated with ``wire_array``) travel as raw typed arrays beside
  the msgpack payload (:mod:`laminar.transport.arrays`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import BaseModel, ValidationError

from laminar.transport import (
    WIRE_CONTEXT,
    Connection,
    ConnectionClosed,
    Frame,
    FrameError,
    Listener,
    MessageTooLarge,
    TransportOptions,
    decode_payload,
    encode_payload,
    listen,
)

from .endpoint import EndpointSpec, endpoints_of

log = structlog.get_logger("laminar.rpc")

K_CALL, K_REPLY, K_ERROR, K_NOTIFY, K_STREAM, K_ITEM, K_END, K_CANCEL = range(16, 24)
K_PING, K_PONG = 24, 25

#: Requests (calls, streams, notifies) one connection may have running at once; see
#: :class:`_Calls`. A stream counts for as long as it is open.
MAX_IN_FLIGHT = 64

#: Quiet checks per ``peer_timeout`` on the calling side (:mod:`laminar.rpc_client`): a ping goes
#: out at each of the first ones, the connection is closed at the last, so a healthy peer has two
#: pings' worth of round trips to answer.
PING_CHECKS = 3


@dataclass(frozen=True)
class CallContext:
    """Who is calling; available to handlers through :data:`current_call`."""

    connection_id: int
    peer: str
    method: str


current_call: ContextVar[CallContext] = ContextVar("laminar_current_call")
_connection_ids = itertools.count(1)


def encode_model(model: BaseModel | None) -> tuple[bytes, list[memoryview]]:
    # WIRE_CONTEXT: ``wire_array`` fields come out as typed arrays, sent as one raw buffer
    return encode_payload(model.model_dump(context=WIRE_CONTEXT) if model is not None else None)


def decode_model(cls: type[BaseModel] | None, frame: Frame) -> Any:
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
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.target = target
        self.max_in_flight = max_in_flight
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

        def handler(frame: Frame) -> Coroutine[Any, Any, None]:
            ctx = CallContext(conn_id, conn.peer, frame.meta["m"])
            return self._run(conn, ctx, frame.meta["k"], frame.meta.get("i"), frame)

        calls = _Calls(self.max_in_flight, handler)
        self.connections.add(conn)
        try:
            while True:
                if calls.read_ahead_full():
                    await self._wait_for_room(conn, calls)
                frame = await conn.recv()
                kind, call_id = frame.meta.get("k"), frame.meta.get("i")
                if kind == K_CANCEL:
                    calls.cancel(call_id)
                    continue
                if kind == K_PING:
                    calls.spawn_control(self._pong(conn))
                    continue
                method = frame.meta.get("m")
                if kind not in (K_CALL, K_NOTIFY, K_STREAM) or not isinstance(method, str):
                    raise FrameError(f"unexpected frame kind {kind!r}")
                if kind != K_NOTIFY and (not isinstance(call_id, int) or calls.known(call_id)):
                    raise FrameError(f"bad or duplicate call id {call_id!r}")
                calls.submit(frame)
        except ConnectionClosed:
            pass
        except FrameError as exc:
            log.warning("closing connection: protocol error", peer=conn.peer, error=str(exc))
            conn.close(f"protocol error: {exc}")
        finally:
            self.connections.discard(conn)
            await calls.cancel_all()
            if self.on_disconnect is not None:
                self.on_disconnect(conn_id)

    async def _wait_for_room(self, conn: Connection, calls: _Calls) -> None:
        """Read nothing from ``conn`` until one of its requests finishes and a held one starts.

        Frames then queue in the transport and the kernel, and TCP flow control stops the
        sender. The pings it sends meanwhile cannot be read, so the connection answers them
        in advance: a pong every ping interval tells the peer this side is busy, not dead.
        """
        interval = None
        if conn.can_stall and self.options.peer_timeout is not None:
            interval = self.options.peer_timeout / PING_CHECKS
        while calls.read_ahead_full():
            try:
                calls.room.clear()  # just checked: no finish can be missed
                async with asyncio.timeout(interval):
                    await calls.room.wait()
            except TimeoutError:
                calls.spawn_control(self._pong(conn))

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
                request = decode_model(spec.request, frame)
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
                    payload, buffers = encode_model(self._checked(spec, result))
                    await conn.send(Frame({"k": K_REPLY, "i": call_id}, payload, buffers))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except ConnectionClosed:
            outcome = "disconnected"
        except MessageTooLarge as exc:
            outcome = "too_large"
            log.warning(
                "reply not sent: too large", method=ctx.method, peer=ctx.peer, error=str(exc)
            )
            await self._error(
                conn, kind, call_id, ctx.method, "remote", "MessageTooLarge", str(exc)
            )
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
                payload, buffers = encode_model(self._checked(spec, item))
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
    async def _pong(conn: Connection) -> None:
        with contextlib.suppress(ConnectionClosed):
            await conn.send(Frame({"k": K_PONG}))

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


class _Calls:
    """The requests of one connection: running (at most ``limit``) and held (read ahead).

    Without a bound, a peer that sends faster than handlers finish grows this process's tasks
    and memory without limit, and the transport's flow control never engages (every frame is
    read at once). At the bound, up to ``limit`` more requests are read ahead and held, in
    arrival order, so CANCELs and pings behind them are still seen; beyond that the connection
    stops reading. A finishing request starts the oldest held one.
    """

    def __init__(self, limit: int, handler: Callable[[Frame], Coroutine[Any, Any, None]]) -> None:
        self.limit = limit
        self.handler = handler
        self.running: dict[int, asyncio.Task[None]] = {}  # calls and streams, by call id
        self.oneway: set[asyncio.Task[None]] = set()  # notifies
        self.control: set[asyncio.Task[None]] = set()  # pongs: not requests, never bounded
        self.held: collections.deque[Frame] = collections.deque()
        self.room = asyncio.Event()  # set whenever a request finishes

    def has_room(self) -> bool:
        return len(self.running) + len(self.oneway) < self.limit

    def read_ahead_full(self) -> bool:
        return len(self.held) >= self.limit

    def known(self, call_id: int) -> bool:
        return call_id in self.running or any(f.meta.get("i") == call_id for f in self.held)

    def submit(self, frame: Frame) -> None:
        if self.held or not self.has_room():
            self.held.append(frame)  # nothing overtakes a held request
        else:
            self._start(frame)

    def spawn_control(self, coro: Coroutine[Any, Any, None]) -> None:
        # answered from a task: a full send buffer must not stop the connection reading
        task = asyncio.create_task(coro)
        self.control.add(task)
        task.add_done_callback(self.control.discard)

    def cancel(self, call_id: Any) -> None:
        task = self.running.get(call_id)
        if task is not None:
            task.cancel()
        else:  # not started yet: drop it, as its caller gave up
            kept = [
                f for f in self.held if f.meta.get("k") == K_NOTIFY or f.meta.get("i") != call_id
            ]
            self.held = collections.deque(kept)

    async def cancel_all(self) -> None:
        self.held.clear()
        pending = [*self.running.values(), *self.oneway, *self.control]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def _start(self, frame: Frame) -> None:
        task = asyncio.create_task(self.handler(frame))
        if frame.meta.get("k") == K_NOTIFY:
            self.oneway.add(task)
            task.add_done_callback(self._oneway_done)
        else:
            call_id = frame.meta["i"]
            self.running[call_id] = task
            task.add_done_callback(lambda _t, i=call_id: self._done(i))

    def _done(self, call_id: int) -> None:
        self.running.pop(call_id, None)
        self._next()

    def _oneway_done(self, task: asyncio.Task[None]) -> None:
        self.oneway.discard(task)
        self._next()

    def _next(self) -> None:
        while self.held and self.has_room():
            self._start(self.held.popleft())
        self.room.set()
