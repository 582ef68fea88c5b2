"""Who owns which ``inproc://`` listener and connection, and cutting a killed member off.

Killing a member (:meth:`InprocCluster.kill`) is as close to ``kill -9`` as one process allows,
in the order the kernel does it: its listeners vanish (a connect is refused), every connection it
holds is closed (its peers see the close at once), and from then on it can reach no one (a
connect from its code is refused); then every task it started (tagged through a context variable
by the loop's task factory, its engine's tasks included) is cancelled. Cancellation is not
SIGKILL: the host's shutdown path and ``finally`` blocks still run, but only their local effects
remain (``on_stop``'s flush and ``leave`` find no one), which stand for what the kernel reclaims
from a dead process (files, reward workers, shared memory).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any

from laminar.transport import inproc as inproc_transport
from laminar.transport.inproc import InprocConnection, InprocListener, InprocTransport

from .inproc_loop import MEMBER


class Fence:
    """Who owns which ``inproc://`` listener and connection, and the members cut off by a kill.

    Installed on the in-process transport for the cluster's lifetime (and removed after): a
    listener and a connection belong to the member whose code created it, the server side of a
    connection to the listener's owner (as a socket accepted by a process is that process's).
    """

    def __init__(self) -> None:
        self.listeners: dict[str | None, weakref.WeakSet[InprocListener]] = {}
        self.connections: dict[str | None, weakref.WeakSet[InprocConnection]] = {}
        self.dead: set[str] = set()

    def cut(self, member: str) -> None:
        """Its listeners gone, its connections closed, and no new ones: a killed process."""
        self.dead.add(member)
        for listener in self.listeners.get(member, ()):
            inproc_transport._LISTENERS.pop(listener.name, None)
        for conn in list(self.connections.get(member, ())):
            conn.close("peer killed")

    def lift(self, member: str) -> None:
        self.dead.discard(member)

    @contextlib.contextmanager
    def installed(self) -> Any:
        listener_init, accept = InprocListener.__init__, InprocListener.accept
        conn_init, connect = InprocConnection.__init__, InprocTransport.connect
        fence = self

        def tag_listener(self: InprocListener, *args: Any, **kwargs: Any) -> None:
            listener_init(self, *args, **kwargs)
            setattr(self, "_inproc_member", MEMBER.get())  # noqa: B010  (no such attribute declared)
            fence.listeners.setdefault(MEMBER.get(), weakref.WeakSet()).add(self)

        def accept_as_owner(self: InprocListener, client: Any) -> None:
            context = contextvars.copy_context()
            context.run(MEMBER.set, getattr(self, "_inproc_member", None))
            context.run(accept, self, client)

        def tag_connection(self: InprocConnection, *args: Any, **kwargs: Any) -> None:
            conn_init(self, *args, **kwargs)
            fence.connections.setdefault(MEMBER.get(), weakref.WeakSet()).add(self)

        async def refuse_the_dead(self: InprocTransport, rest: str, options: Any) -> Any:
            if MEMBER.get() in fence.dead:
                raise ConnectionRefusedError(f"{MEMBER.get()} was killed")
            return await connect(self, rest, options)

        patched = [
            (InprocListener, "__init__", tag_listener, listener_init),
            (InprocListener, "accept", accept_as_owner, accept),
            (InprocConnection, "__init__", tag_connection, conn_init),
            (InprocTransport, "connect", refuse_the_dead, connect),
        ]
        for cls, name, ours, _ in patched:
            setattr(cls, name, ours)
        try:
            yield
        finally:
            for cls, name, _, theirs in patched:
                setattr(cls, name, theirs)
