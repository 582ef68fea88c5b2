"""One interface over every transport: a :class:`Connection` moves :class:`Frame` objects.

``connect(address)`` and ``listen(address, handler)`` pick the transport from the address scheme
(``tcp://``, ``inproc://``, ``shm://``, ``ucx://``) and run the same authentication handshake on
all of them, so nothing above this module cares how bytes move and no endpoint is ever reached by a
peer that has not proven it holds the cluster token.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from .frames import Frame, FrameError, Limits
from .gate import HandshakeGate
from .reader import Allocator, default_allocator


class TransportError(ConnectionError):
    """Base class of transport failures."""


class ConnectionClosed(TransportError):
    """The connection is closed; ``reason`` says why (peer went away, protocol error, ...)."""

    def __init__(self, reason: str = "connection closed") -> None:
        super().__init__(reason)
        self.reason = reason


class AuthenticationError(TransportError):
    """The handshake failed: wrong or missing cluster token, or not a Laminar peer."""


#: the shortest cluster token a connection's handshake accepts
MIN_TOKEN_BYTES = 16


@dataclass(frozen=True)
class TransportOptions:
    """What every connection needs to know; shared by client and server sides.

    ``peer_timeout``: how long a connection may hear nothing from a peer that owes it an answer
    before it is given up (kernel: ``TCP_USER_TIMEOUT`` and keepalive; RPC clients: unanswered
    pings). A crashed host or a cut link otherwise goes unnoticed for the kernel's ~15 minutes of
    retransmissions, or for hours on an idle connection. None: kernel defaults, no pings.

    ``max_pending_handshakes`` / ``max_pending_per_peer``: see :mod:`.gate`.
    """

    token: bytes
    limits: Limits = field(default_factory=Limits)
    handshake_timeout: float = 5.0
    connect_timeout: float = 5.0
    allocator: Allocator = default_allocator
    peer_timeout: float | None = 10.0
    max_pending_handshakes: int = 256
    max_pending_per_peer: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.token, bytes) or len(self.token) < MIN_TOKEN_BYTES:
            raise ValueError(f"the cluster token must be at least {MIN_TOKEN_BYTES} bytes")
        if self.peer_timeout is not None and self.peer_timeout <= 0:
            raise ValueError(f"peer_timeout must be positive or None, got {self.peer_timeout}")

    def with_allocator(self, allocator: Allocator) -> TransportOptions:
        return replace(self, allocator=allocator)


class Connection(abc.ABC):
    """A bidirectional, ordered, reliable stream of frames.

    ``send`` waits for flow control (so a fast sender cannot grow memory without bound), ``recv``
    raises :class:`ConnectionClosed` once the peer is gone or the stream is broken. ``close`` is
    idempotent and never raises. ``send`` raises :class:`~.frames.MessageTooLarge` (and sends
    nothing) for a frame over ``limits``.
    """

    #: False where a peer cannot go silent without the connection closing (in-process peers), so
    #: liveness pings would be pure overhead.
    can_stall = True

    def __init__(self, peer: str, limits: Limits, allocator: Allocator) -> None:
        self.peer = peer
        self.peer_host: str | None = None  # the peer's network address, where there is one
        self.limits = limits
        self.allocator = allocator
        self.close_reason: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    @property
    def backlog(self) -> int:
        """Bytes accepted by ``send`` that the peer has not taken yet (still in user space).

        A backlog that shrinks proves the peer is reading even while it sends nothing back.
        """
        return 0

    @property
    def reserved_bytes(self) -> int:
        """Receive memory the connection holds between frames."""
        return 0

    @abc.abstractmethod
    async def send(self, frame: Frame) -> None: ...

    @abc.abstractmethod
    async def recv(self) -> Frame: ...

    def try_send(self, frame: Frame) -> bool:
        """Send ``frame`` now if that needs no waiting, and say whether it did; ``False`` sends
        nothing, and the caller falls back on ``await send()``.

        Why: a caller that knows its frame went out can time out only what is left (a call's
        reply, with a timer on its future) instead of wrapping the send in ``asyncio.timeout``,
        which costs several times as much on every small RPC (docs/benchmarks.md, *Transport*).
        The default never sends. Raises what ``send`` raises for a frame over ``limits``.
        """
        return False

    # -- push delivery ----------------------------------------------------------------------------
    #
    # Why a second way to receive: ``await recv()`` in a reader task costs one task wake-up per
    # frame before the frame reaches whoever it is for (a call's future, a handler task), and the
    # RPC round trip is a handful of such wake-ups. A sink is called from the event loop as frames
    # arrive, in order, so a reply sets its caller's future directly. Transports whose frames
    # arrive in a callback (tcp, shm, inproc) override this to call the sink there; the default
    # below pumps ``recv()`` in a task owned by the connection, so every transport supports it.

    def deliver_to(self, sink: FrameSink, closed: Callable[[str], None]) -> None:
        """From now on hand every frame to ``sink(frame)`` instead of queueing it for ``recv()``
        (frames already queued go first), and call ``closed(reason)`` once after the last one.

        ``sink`` must not block. It may call :meth:`pause_reading` to stop delivery (the transport
        then stops reading, so the peer's sends wait on flow control) and
        :meth:`resume_reading` later. A :class:`~.frames.FrameError` raised by ``sink`` closes
        the connection as a protocol error. Call once, after the handshake; ``recv()`` must not
        be used afterwards.
        """
        if getattr(self, "_pump", None) is not None:
            raise RuntimeError("deliver_to() was already called on this connection")
        self._sink_open = asyncio.Event()
        self._sink_open.set()
        self._pump: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._pump_frames(sink, closed)
        )

    def pause_reading(self) -> None:
        """Stop handing frames to the sink (see :meth:`deliver_to`)."""
        self._sink_open.clear()

    def resume_reading(self) -> None:
        self._sink_open.set()

    async def _pump_frames(self, sink: FrameSink, closed: Callable[[str], None]) -> None:
        reason = "connection closed"
        try:
            while True:
                if not self._sink_open.is_set():
                    await self._paused_until_resumed_or_closed()
                    if not self._sink_open.is_set():
                        return  # closed while paused: what is still queued is dropped
                frame = await self.recv()
                try:
                    sink(frame)
                except FrameError as exc:
                    self.close(f"protocol error: {exc}")
        except ConnectionClosed as exc:
            reason = exc.reason
        finally:
            closed(self.close_reason or reason)

    async def _paused_until_resumed_or_closed(self) -> None:
        waits = [
            asyncio.ensure_future(self._sink_open.wait()),
            asyncio.ensure_future(self.wait_closed()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    @abc.abstractmethod
    def close(self, reason: str = "closed locally") -> None: ...

    @abc.abstractmethod
    async def wait_closed(self) -> None: ...


class Listener(abc.ABC):
    """A bound server endpoint. ``address`` is the address peers dial (ports resolved).

    A listener owns the handler task of every connection it accepted: ``track`` registers one,
    and ``close`` must cancel and await them all (``cancel_handlers``), so no task outlives it.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._handlers: set[asyncio.Task[None]] = set()
        self.handshakes: HandshakeGate | None = None  # set by listen()

    def track(self, task: asyncio.Task[None]) -> None:
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def cancel_handlers(self) -> None:
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)

    @abc.abstractmethod
    async def close(self) -> None: ...


def parse_host_port(scheme: str, rest: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts in brackets) of a ``tcp://`` or ``ucx://`` address."""
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{scheme} address needs host:port, got {rest!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


Handler = Callable[[Connection], Awaitable[None]]
FrameSink = Callable[[Frame], None]


class Transport(abc.ABC):
    """A way of moving frames, registered under an address scheme."""

    scheme: str

    @abc.abstractmethod
    async def connect(self, rest: str, options: TransportOptions) -> Connection: ...

    @abc.abstractmethod
    async def listen(
        self, rest: str, options: TransportOptions, on_connection: Handler
    ) -> Listener:
        """Serve ``rest``; ``on_connection`` runs once per accepted connection, as its own task."""


_TRANSPORTS: dict[str, Callable[[], Transport]] = {}


def register_transport(scheme: str, factory: Callable[[], Transport]) -> None:
    _TRANSPORTS[scheme] = factory


def split_address(address: str) -> tuple[str, str]:
    scheme, sep, rest = address.partition("://")
    if not sep or not rest:
        raise ValueError(f"address {address!r} is not of the form scheme://location")
    if scheme not in _TRANSPORTS:
        known = ", ".join(sorted(_TRANSPORTS))
        raise ValueError(f"unknown transport scheme {scheme!r} in {address!r} (known: {known})")
    return scheme, rest


def get_transport(address: str) -> tuple[Transport, str]:
    scheme, rest = split_address(address)
    return _TRANSPORTS[scheme](), rest


# ----------------------------------------------------------------------------------------------
# handshake: mutual HMAC challenge-response keyed by the cluster token

K_HELLO, K_AUTH, K_WELCOME, K_REJECT = 1, 2, 3, 4
_NONCE = 32


def _mac(token: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, label + b"".join(parts), hashlib.sha256).digest()


async def server_handshake(conn: Connection, options: TransportOptions) -> None:
    """Prove the client holds the token before any frame reaches an endpoint.

    Runs under :meth:`Limits.handshake` (a few KiB), so an unauthenticated peer cannot make the
    server allocate anything large. Raises :class:`AuthenticationError` or ConnectionClosed.
    """
    nonce = os.urandom(_NONCE)
    await conn.send(Frame({"k": K_HELLO, "nonce": nonce}))
    reply = await conn.recv()
    if reply.meta.get("k") != K_AUTH:
        raise AuthenticationError(f"expected an auth frame, got kind {reply.meta.get('k')!r}")
    cnonce, mac = reply.meta.get("cnonce"), reply.meta.get("mac")
    if not isinstance(cnonce, bytes) or len(cnonce) != _NONCE or not isinstance(mac, bytes):
        raise AuthenticationError("malformed auth frame")
    if not hmac.compare_digest(mac, _mac(options.token, b"client", nonce, cnonce)):
        await conn.send(Frame({"k": K_REJECT, "why": "bad cluster token"}))
        raise AuthenticationError("client presented a wrong cluster token")
    conn.limits = options.limits  # before WELCOME: the client may send session frames right after
    await conn.send(Frame({"k": K_WELCOME, "mac": _mac(options.token, b"server", cnonce, nonce)}))


async def client_handshake(conn: Connection, options: TransportOptions) -> None:
    hello = await conn.recv()
    nonce = hello.meta.get("nonce")
    if hello.meta.get("k") != K_HELLO or not isinstance(nonce, bytes) or len(nonce) != _NONCE:
        raise AuthenticationError("peer did not open with a Laminar hello")
    cnonce = os.urandom(_NONCE)
    await conn.send(
        Frame({"k": K_AUTH, "cnonce": cnonce, "mac": _mac(options.token, b"client", nonce, cnonce)})
    )
    answer = await conn.recv()
    if answer.meta.get("k") == K_REJECT:
        raise AuthenticationError(f"server refused us: {answer.meta.get('why', 'no reason')}")
    mac = answer.meta.get("mac")
    if answer.meta.get("k") != K_WELCOME or not isinstance(mac, bytes):
        raise AuthenticationError("malformed handshake answer")
    if not hmac.compare_digest(mac, _mac(options.token, b"server", cnonce, nonce)):
        raise AuthenticationError("server does not hold the cluster token")


async def connect(address: str, options: TransportOptions) -> Connection:
    """Dial ``address`` and authenticate; returns a connection ready for session frames."""
    transport, rest = get_transport(address)
    # ``asyncio.timeout``, never ``asyncio.wait_for``: on Python 3.11 ``wait_for`` loses a
    # cancellation that arrives as its inner awaitable finishes (fixed in 3.12), and a refused
    # connect finishes at once, so a loop retrying connects could not be cancelled.
    async with asyncio.timeout(options.connect_timeout):
        conn = await transport.connect(rest, options)
    try:
        async with asyncio.timeout(options.handshake_timeout):
            await client_handshake(conn, options)
    except BaseException as exc:
        conn.close(f"handshake failed: {exc!r}")
        if isinstance(exc, TimeoutError):
            # A slow peer (starting up, or its host overloaded), not a refusal: callers retry.
            raise TimeoutError(
                f"handshake with {address} took over {options.handshake_timeout:g} s"
            ) from exc
        if isinstance(exc, FrameError):
            raise AuthenticationError(f"handshake with {address} failed: {exc}") from exc
        raise
    conn.limits = options.limits
    return conn


async def listen(address: str, options: TransportOptions, handler: Handler) -> Listener:
    """Serve ``address``; ``handler`` gets each connection after it passed the handshake.

    The handler owns the connection; when it returns the connection is closed. Connections that
    fail the handshake are closed here and never reach the handler. Connections still in their
    handshake are capped per listener and per peer address (:class:`~.gate.HandshakeGate`).
    """
    transport, rest = get_transport(address)
    gate = HandshakeGate(options.max_pending_handshakes, options.max_pending_per_peer)

    async def on_connection(conn: Connection) -> None:
        gate.admit(conn)
        try:
            async with asyncio.timeout(options.handshake_timeout):
                await server_handshake(conn, options)
        except (TransportError, FrameError, TimeoutError) as exc:
            conn.close(f"handshake failed: {exc}")
            return
        finally:
            gate.release(conn)
        try:
            await handler(conn)
        finally:
            conn.close("handler finished")

    listener = await transport.listen(rest, options, on_connection)
    listener.handshakes = gate
    return listener


__all__ = [
    "Allocator",
    "AuthenticationError",
    "Connection",
    "ConnectionClosed",
    "Handler",
    "Listener",
    "Transport",
    "TransportError",
    "TransportOptions",
    "connect",
    "default_allocator",
    "get_transport",
    "listen",
    "parse_host_port",
    "register_transport",
    "split_address",
]
