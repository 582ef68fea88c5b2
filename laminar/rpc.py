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
from collections.abc import AsyncIterator, Callable
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
                if kind == K_PING:
                    # answered from a task: a full send buffer must not stop this loop reading
                    task = asyncio.create_task(self._pong(conn))
                    oneway.add(task)
                    task.add_done_callback(oneway.discard)
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
