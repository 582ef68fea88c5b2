"""Following the manager's membership: a dead rollout's leases go back to the queue.

When a rollout dies its leases return to the front of the queue with their partial tokens, for
another rollout of the same version to resume; each lease it held without progress gets a strike
(``store.failures``: a lease that keeps killing its rollouts is quarantined). After a restart of
this role, leases of rollouts that are not alive are released the same way; rollouts that are
alive keep theirs (they will report them). After a restart of the manager, a rollout missing from
its member list is released only once it has had a heartbeat timeout to rejoin.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from laminar.runtime.errors import RpcError
from laminar.runtime.membership import MemberEvent, MembershipApi, WatchRequest

from .context import DataContext

WATCH_RETRY_S = 1.0  # between membership watches, after one breaks


class RolloutWatch:
    """Releases leases of rollouts that die; ``forget`` and ``wake`` tell the leasing side."""

    def __init__(
        self, ctx: DataContext, forget: Callable[[str], None], wake: Callable[[], None]
    ) -> None:
        self.ctx = ctx
        self._forget = forget
        self._wake = wake

    async def events(self, mgr: MembershipApi) -> AsyncIterator[MemberEvent]:
        """One subscription to the manager's membership events, with its sweep of the member
        list (followed by the service: ``ctx.follow``, with :meth:`on_event`, every
        ``WATCH_RETRY_S`` after the watch breaks), so that the leases of rollouts that die are
        released, and those of rollouts that died while we, or the manager, were down.

        Subscribe, then read the member list: the watch's first item (a snapshot event) says the
        manager has registered it, so every change after that arrives as an event and none falls
        between the list and the stream. The list is acted on only once it is settled
        (``ClusterStatus.unsettled_s``): a restarted manager lists live rollouts only as they
        rejoin, and releasing the leases of one not back yet would take work from a live rollout.
        The sweep belongs to its subscription: it ends with it.
        """
        sweep: asyncio.Task[None] | None = None
        try:
            async for event in mgr.watch.options(timeout=3600).stream(WatchRequest(snapshot=True)):
                if sweep is None:  # registered with the manager: the list may be read now
                    sweep = asyncio.create_task(self._release_absent(mgr))
                yield event
        finally:
            if sweep is not None:
                sweep.cancel()
                (failed,) = await asyncio.gather(sweep, return_exceptions=True)
                if isinstance(failed, Exception):
                    self.ctx.log.error("lease sweep failed", error=repr(failed))

    async def on_event(self, event: MemberEvent) -> None:
        if event.event in ("dead", "left"):
            await self.release(event.member.instance, event.event)

    async def _release_absent(self, mgr: MembershipApi) -> None:
        """Release the leases of rollouts the manager's settled member list has not alive."""
        store = self.ctx.need_store()
        try:
            while (wait := (status := await mgr.status.call()).unsettled_s()) > 0:
                self.ctx.log.info("manager (re)started: waiting for members to rejoin before "
                                  "releasing leases", manager_incarnation=status.incarnation,
                                  wait_s=round(wait, 2))  # fmt: skip
                await self.ctx.clock.sleep(wait)
            # Holders first, then the list: a rollout that takes after the list was read is
            # not among the holders looked at, so a newcomer is never mistaken for a dead one.
            holders = await self.ctx.db(lambda: list(store.leases()))
            status = await mgr.status.call()
        except RpcError as exc:
            self.ctx.log.info("member list unavailable; the next watch sweeps", error=str(exc))
            return
        alive = {m.instance for m in status.members if m.state == "alive"}
        for rollout in holders:
            if rollout not in alive:
                await self.release(rollout, "not alive in the manager's member list")

    async def release(self, rollout: str, why: str) -> None:
        self._forget(rollout)
        if why != "left":  # it died holding them (or vanished): a strike each (see failures)
            released = await self.ctx.db(self._release_dead, rollout)
        else:
            released = await self.ctx.db(self.ctx.need_store().release, rollout)
        if released:
            self.ctx.log.info("released leases", rollout=rollout, count=len(released), why=why)
            self._wake()

    def _release_dead(self, rollout: str) -> list[str]:
        """Release a dead rollout's leases with a strike each; returns the ids it held."""
        store = self.ctx.need_store()
        released, quarantined = store.release_dead(rollout, self.ctx.config.quarantine_after)
        for tid, reason in quarantined:
            self.ctx.log.error(
                "trajectory quarantined", trajectory=tid, rollout=rollout, reason=reason
            )
        if quarantined and self.ctx.rounds is not None:
            self.ctx.rounds.note_failed(store, [tid for tid, _ in quarantined])
        return released + [tid for tid, _ in quarantined]
