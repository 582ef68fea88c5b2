"""Request/reply, one-way and streaming calls over any transport connection: the serving side.
The calling side is :mod:`laminar.runtime.rpc.client`; the frames both exchange are in
:mod:`laminar.runtime.rpc.wire`.

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
* A stream sends at most the consumer's window of items ahead of what the consumer has taken
  (CREDIT frames top it up), so a slow consumer holds its producer
  (:mod:`laminar.runtime.rpc.calls`).
* Frames are handed to the server and the client as they arrive (``Connection.deliver_to``), not
  through a reader task: a call's round trip is then one task wake-up on each side, as with a
  bare asyncio echo, and ``benchmarks/transport.py`` measures it against one.
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
import contextlib
import itertools
import time
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine
from contextvars import ContextVar
from typing import Any, NamedTuple

import structlog
from pydantic import BaseModel, ValidationError

from laminar.transport import (
    Connection,
    ConnectionClosed,
    Frame,
    FrameError,
    Listener,
    MessageTooLarge,
    TransportOptions,
    listen,
)

from ..endpoint import EndpointSpec, endpoints_of
from .calls import Calls, Credit
from .wire import (
    K_CALL,
    K_CANCEL,
    K_CREDIT,
    K_END,
    K_ERROR,
    K_ITEM,
    K_NOTIFY,
    K_PING,
    K_PONG,
    K_REPLY,
    K_STREAM,
    MAX_IN_FLIGHT,
    PING_CHECKS,
    decode_model,
    encode_model,
)

__all__ = [
    "K_CALL",
    "K_CANCEL",
    "K_PING",
    "K_PONG",
    "K_REPLY",
    "CallContext",
    "RpcServer",
    "current_call",
    "decode_model",
    "encode_model",
]

log = structlog.get_logger("laminar.runtime.rpc.server")


class CallContext(NamedTuple):
    """Who is calling; available to handlers through :data:`current_call`. (A tuple: one is made
    per request, and a frozen dataclass costs twice as much to make.)"""

    connection_id: int
    peer: str
    method: str


current_call: ContextVar[CallContext] = ContextVar("laminar_current_call")
_connection_ids = itertools.count(1)


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
        """Serve ``conn`` until it closes; its requests' tasks end with it."""
        conn_id = next(_connection_ids)
        loop = asyncio.get_running_loop()
        lost: asyncio.Future[str] = loop.create_future()
        pong_interval = None
        if conn.can_stall and self.options.peer_timeout is not None:
            pong_interval = self.options.peer_timeout / PING_CHECKS
        paused: list[asyncio.TimerHandle] = []  # the unasked-pong timer while not reading

        def handler(frame: Frame) -> Coroutine[Any, Any, None]:
            ctx = CallContext(conn_id, conn.peer, frame.meta["m"])
            return self._run(conn, ctx, frame.meta["k"], frame.meta.get("i"), frame, calls)

        def unasked_pong() -> None:
            # Not reading, so the peer's pings go unread: tell it this side is busy, not dead.
            calls.spawn_control(self._pong(conn))
            if pong_interval is not None:
                paused[:] = [loop.call_later(pong_interval, unasked_pong)]

        def on_room() -> None:
            if paused and not calls.read_ahead_full():
                for timer in paused:
                    timer.cancel()
                paused.clear()
                conn.resume_reading()

        calls = Calls(self.max_in_flight, handler, on_room)

        def on_frame(frame: Frame) -> None:
            meta = frame.meta
            kind, call_id = meta.get("k"), meta.get("i")
            if kind == K_CANCEL:
                calls.cancel(call_id)
                return
            if kind == K_CREDIT:
                n = meta.get("n")
                if not isinstance(n, int) or n < 1:
                    raise FrameError(f"bad stream credit {n!r}")
                calls.grant(call_id, n)
                return
            if kind == K_PING:
                calls.spawn_control(self._pong(conn))
                return
            method = meta.get("m")
            if kind not in (K_CALL, K_NOTIFY, K_STREAM) or not isinstance(method, str):
                raise FrameError(f"unexpected frame kind {kind!r}")
            if kind != K_NOTIFY and (not isinstance(call_id, int) or calls.known(call_id)):
                raise FrameError(f"bad or duplicate call id {call_id!r}")
            if kind == K_STREAM:
                window = meta.get("c")
                if window is not None and (not isinstance(window, int) or window < 1):
                    raise FrameError(f"bad stream window {window!r}")
                assert isinstance(call_id, int)  # checked above: every kind but NOTIFY has one
                calls.open_stream(call_id, window)
            calls.submit(frame)
            if calls.read_ahead_full() and not paused:
                conn.pause_reading()
                paused.append(loop.call_later(pong_interval or 3600.0, unasked_pong))

        def on_closed(reason: str) -> None:
            if not lost.done():
                lost.set_result(reason)

        self.connections.add(conn)
        try:
            conn.deliver_to(on_frame, on_closed)
            await lost
        finally:
            for timer in paused:
                timer.cancel()
            self.connections.discard(conn)
            conn.close("server side finished")
            await calls.cancel_all()
            if self.on_disconnect is not None:
                self.on_disconnect(conn_id)

    async def _run(
        self,
        conn: Connection,
        ctx: CallContext,
        kind: int,
        call_id: Any,
        frame: Frame,
        calls: Calls,
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
                credit = calls.credits.get(call_id) or Credit(None)
                await self._stream(conn, spec, call_id, fn(self.target, *args), credit)
            else:
                result = await fn(self.target, *args)
                if kind == K_CALL:
                    payload, buffers = encode_model(self._checked(spec, result))
                    reply = Frame({"k": K_REPLY, "i": call_id}, payload, buffers)
                    if not conn.try_send(reply):
                        await conn.send(reply)
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
        self,
        conn: Connection,
        spec: EndpointSpec,
        call_id: int,
        items: AsyncIterator[Any],
        credit: Credit,
    ) -> None:
        try:
            sent = 0
            async for item in items:
                await credit.take()  # the consumer's window (laminar.runtime.rpc.calls)
                payload, buffers = encode_model(self._checked(spec, item))
                await conn.send(Frame({"k": K_ITEM, "i": call_id}, payload, buffers))
                sent += 1
                if sent % 16 == 0:
                    # A generator that never awaits would otherwise hold the loop until it ends:
                    # no CANCEL could be read, no heartbeat answered.
                    await asyncio.sleep(0)
        finally:
            # ignored below: each stream handler is an async generator; AsyncIterator has no aclose
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
