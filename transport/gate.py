"""How many connections may sit in the handshake at once, per listener and per peer address.

Why: until a peer proves it holds the cluster token it has earned nothing, yet every accepted
socket holds a file descriptor, a handler task and a small buffer for up to the handshake timeout.
Without a bound, anyone who can reach the port can open thousands of idle sockets (or trickle bytes
into them) and exhaust the server while members cannot get in.

Policy: when a cap is reached, the *oldest* pending handshake of that scope is closed to make room.
A member's handshake finishes within a round trip or two, so it is always among the newest and is
never the one evicted unless the attacker opens more than a cap's worth of connections during
that round trip; refusing the newest instead would let a few idle sockets lock everyone out for
good. The per-peer cap keeps one address from taking the whole listener's quota.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import structlog

log = structlog.get_logger("laminar.transport")


class PendingConnection(Protocol):
    """What the gate needs of a connection (a :class:`~.base.Connection` is one): the gate sits
    below ``base``, which builds a gate per listener."""

    peer_host: str | None

    def close(self, reason: str = ...) -> None: ...


class HandshakeGate:
    """Pending (unauthenticated) connections of one listener, oldest first."""

    def __init__(self, max_pending: int, max_per_peer: int) -> None:
        if max_pending < 1 or max_per_peer < 1:
            raise ValueError("handshake caps must be at least 1")
        self.max_pending = max_pending
        self.max_per_peer = max_per_peer
        self._pending: OrderedDict[PendingConnection, str | None] = OrderedDict()
        self._per_peer: dict[str, int] = {}
        self.evicted = 0

    @property
    def pending(self) -> list[PendingConnection]:
        return list(self._pending)

    def admit(self, conn: PendingConnection) -> None:
        """Count ``conn`` as pending, closing the oldest pending ones over either cap."""
        host = conn.peer_host
        if host is not None and self._per_peer.get(host, 0) >= self.max_per_peer:
            oldest = next(c for c, h in self._pending.items() if h == host)
            self._evict(oldest, f"more than {self.max_per_peer} pending handshakes from {host}")
        if len(self._pending) >= self.max_pending:
            oldest = next(iter(self._pending))
            self._evict(oldest, f"more than {self.max_pending} pending handshakes")
        self._pending[conn] = host
        if host is not None:
            self._per_peer[host] = self._per_peer.get(host, 0) + 1

    def release(self, conn: PendingConnection) -> None:
        """``conn`` finished its handshake (or failed it); idempotent."""
        if conn not in self._pending:
            return
        host = self._pending.pop(conn)
        if host is not None:
            left = self._per_peer[host] - 1
            if left:
                self._per_peer[host] = left
            else:
                del self._per_peer[host]

    def _evict(self, conn: PendingConnection, why: str) -> None:
        self.release(conn)
        self.evicted += 1
        if self.evicted == 1 or self.evicted % 1000 == 0:  # an attack must not flood the log
            log.warning("evicting unauthenticated connections", reason=why, evicted=self.evicted)
        conn.close(f"evicted before authenticating: {why}")
