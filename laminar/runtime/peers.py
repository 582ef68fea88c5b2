"""Reaching other roles: a peer found through the manager, and a stream followed across failures.

Why a module: every role talks to others the same two ways, and each had its own copy of the
loop. A copy that forgets one step (forget a dead peer's address, so a restarted one is found
where it listens now; back off on the service clock, not the real one; resubscribe from what was
applied, so nothing is lost or applied twice) fails only when a peer dies, which is when it
matters. Here each step is written once:

- :class:`Peer`: the address of one member of a role (the configured one, else an alive member
  the manager names), resolved lazily, forgotten when a call fails, and :meth:`Peer.call` to call
  it with retries (as many as the caller chooses) and a back-off on the clock.
- :func:`follow_stream`: subscribe to a server stream, apply each item, and on failure back off and
  subscribe again. What to subscribe *from* is the caller's: ``open_stream`` is called anew for
  every subscription, so it asks from the last item applied (a cursor, a version, an epoch) or
  opens with a snapshot; the loop cannot know the stream's notion of position.
- :class:`Outage`: one log line when a peer becomes unreachable and one when it is back, rather
  than one per retry (a dead peer retried every 0.5 s would otherwise fill the log).

A service uses them through its context: ``ctx.peer(...)`` and ``ctx.follow(...)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .clock import Clock
from .errors import RETRYABLE, STREAM_ERRORS, RpcError

S = TypeVar("S")
T = TypeVar("T")
Item = TypeVar("Item")


@dataclass(frozen=True)
class RetryPolicy:
    """How :meth:`Peer.call` retries: the whole policy in one value, so a caller states it once
    (usually as a module constant) instead of writing a loop around its call.

    ``attempts`` in all (None: until it succeeds), ``backoff_s`` on the service clock between
    them, on the errors ``retry_on`` names. ``unless(exc)`` true: that error is the caller's to
    handle, raised at once without forgetting the peer (e.g. a reply too large to send, which
    asking again will not fix).
    """

    attempts: int | None = None
    backoff_s: float = 1.0
    retry_on: tuple[type[Exception], ...] = RETRYABLE
    unless: Callable[[Exception], bool] | None = None

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be at least 1 (or None), not {self.attempts}")


#: Until it succeeds, once a second, on the errors another address or a later try may cure.
PERSIST = RetryPolicy()

#: One attempt; any failure is noted (the peer's address forgotten) and raised. For a call whose
#: caller asks afresh anyway (a periodic report, a pull loop), with whatever is new by then.
ONCE = RetryPolicy(attempts=1, retry_on=(RpcError,))


class PeerHost(Protocol):
    """What a :class:`Peer` needs of its owner: a log, a clock, a way to find a role's member and
    to connect to it. ``ServiceContext`` is one; this module does not import it, so the context
    owns its peers and not the other way round."""

    log: Any
    clock: Clock

    async def find(self, role: str, *, poll_s: float = ...) -> str: ...

    def connect(self, cls: type[S], address: str) -> S: ...


class Outage:
    """Reports a peer's failures once per outage: the first failure, then the recovery.

    ``lost(exc)`` is called for the first failure after a success (or ever); ``back(failures)``
    when a success ends an outage, with the number of failures it lasted.
    """

    def __init__(
        self,
        lost: Callable[[Exception], None],
        back: Callable[[int], None] | None = None,
    ) -> None:
        self._lost = lost
        self._back = back
        self.failures = 0  # in the current outage (0: none)

    @classmethod
    def logged(
        cls, log: Any, lost: str, back: str, expected: Callable[[], bool] | None = None
    ) -> Outage:
        """An outage logged on ``log``: a warning ``lost`` (with the error), then ``back``. An
        info instead of the warning where ``expected()`` says the loss was announced (the peer
        left the cluster before its stream ended): nothing went wrong."""

        def said(exc: Exception) -> None:
            announced = expected is not None and expected()
            (log.info if announced else log.warning)(lost, error=str(exc))

        return cls(said, lambda failures: log.info(back, failures=failures))

    @property
    def down(self) -> bool:
        return self.failures > 0

    def failed(self, exc: Exception) -> None:
        if self.failures == 0:
            self._lost(exc)
        self.failures += 1

    def ok(self) -> None:
        if self.failures and self._back is not None:
            self._back(self.failures)
        self.failures = 0


class Peer(Generic[S]):
    """One member of ``role``, typed as ``api_cls``: at ``address`` if configured, else found.

    A found address is forgotten when a call through :meth:`call` (or the caller, through
    :meth:`lost`) fails, and looked up again on next use: the role may have restarted elsewhere,
    or another member may have taken over. A configured address is kept whatever happens.
    """

    def __init__(
        self, ctx: PeerHost, role: str, api_cls: type[S], *, address: str | None = None
    ) -> None:
        self.ctx = ctx
        self.role = role
        self.api_cls = api_cls
        self.configured = address
        self._address = address
        self.outage = Outage.logged(
            ctx.log, f"{role} role unreachable; retrying", f"{role} role reachable again"
        )

    @property
    def address(self) -> str | None:
        """The address in use now (None: not resolved yet, or forgotten)."""
        return self._address

    async def resolve(self) -> str:
        """The address to call: the configured or remembered one, else an alive member's,
        waiting until one has joined (``ctx.find``)."""
        if self._address is None:
            self._address = await self.ctx.find(self.role)
            self.ctx.log.info(f"found the {self.role} role", address=self._address)
        return self._address

    async def api(self) -> S:
        """A typed proxy of the peer (resolving its address first)."""
        return self.ctx.connect(self.api_cls, await self.resolve())

    def forget(self) -> None:
        """Look the peer up again on next use (a configured address is kept)."""
        if self.configured is None:
            self._address = None

    def lost(self, exc: Exception) -> None:
        """A call to the peer failed: note the outage (logged once) and forget its address."""
        self.outage.failed(exc)
        self.forget()

    async def call(
        self,
        fn: Callable[[S], Awaitable[T]],
        policy: RetryPolicy = PERSIST,
        *,
        give_up: Callable[[], bool] | None = None,
    ) -> T:
        """``await fn(api)``, retried as ``policy`` says. ``give_up()``, asked before each retry,
        true: the call is no longer wanted (what it was for has moved on). After the last attempt,
        or on giving up, the last error is raised.

        ``fn`` runs anew at each attempt, so a request it builds there is as fresh as the retry.
        """
        attempt = 0
        while True:
            attempt += 1
            try:
                result = await fn(await self.api())
            except policy.retry_on as exc:
                if policy.unless is not None and policy.unless(exc):
                    raise
                self.lost(exc)
                if policy.attempts is not None and attempt >= policy.attempts:
                    raise
                await self.ctx.clock.sleep(policy.backoff_s)
                if give_up is not None and give_up():
                    raise
                continue
            self.outage.ok()
            return result


def _closing(stream: AsyncIterator[Any]) -> contextlib.AbstractAsyncContextManager[Any]:
    """Close an async generator on the way out: a cancelled follow then tells the server at
    once (and runs the generator's ``finally``), rather than whenever the GC gets to it."""
    if hasattr(stream, "aclose"):
        return contextlib.aclosing(stream)
    return contextlib.nullcontext()


async def follow_stream(
    open_stream: Callable[[], AsyncIterator[Item] | Awaitable[AsyncIterator[Item]]],
    apply: Callable[[Item], Awaitable[None] | None],
    *,
    backoff: float,
    sleep: Callable[[float], Awaitable[None]],
    outage: Outage,
    errors: tuple[type[Exception], ...] = STREAM_ERRORS,
) -> None:
    """Apply every item of the stream ``open_stream()`` opens, until cancelled.

    A stream that fails with one of ``errors`` is reported to ``outage`` and opened again after
    ``backoff`` seconds (``sleep``, the service clock's); one the server ends is opened again
    after ``backoff`` too, quietly. ``open_stream`` may be a coroutine function (to find the peer
    first) and ``apply`` may be async (it runs before the next item is read, so a slow apply
    holds the stream back rather than queueing items). An error out of ``apply`` that is one of
    ``errors`` counts as the stream's (e.g. a call apply makes to the same peer); any other error
    ends the follow (and, spawned by a service, the service: a bug is not retried).
    """
    while True:
        try:
            opened = open_stream()
            stream = await opened if isinstance(opened, Awaitable) else opened
            async with _closing(stream):
                async for item in stream:
                    outage.ok()
                    result = apply(item)
                    if isinstance(result, Awaitable):
                        await result
        except errors as exc:
            outage.failed(exc)
        await sleep(backoff)
