"""The rollout's report loop: it hands the data role (a ``ctx.peer``) tokens and results.

Why its own module: reporting is the rollout's durability story, and it has rules of its own that
the generation loop should not have to know. Every ``flush_interval_s``, one ``report`` call
carries every in-flight trajectory's new tokens, every finished trajectory and every failed one.
Only an acknowledged report advances what counts as sent, so a data role that dies and restarts
just sees the same report again (the data role treats repeats as no-ops). Nothing is lost while it
is down: tokens pile up here and go out with the first report that succeeds. Items the data role
refused (named in the reply, with why) are dropped and logged once, never sent again: one bad
item cannot make every report fail. A refused partial, or one the data role reassigned, stops
generating here; the data role re-delivers it from what it has.
"""

from __future__ import annotations

import contextlib
from typing import Any

from laminar.engines import Engine
from laminar.roles.data.api import DataApi, FailedItem, Report
from laminar.runtime.clock import Clock
from laminar.runtime.errors import RpcError
from laminar.runtime.peers import ONCE, Peer
from laminar.trajectory import Trajectory

from .flights import FlightTable


class Reporter:
    """What the data role has not yet acknowledged, and the loop that sends it."""

    def __init__(
        self, instance: str, flights: FlightTable, engine: Engine, data: Peer[DataApi], log: Any
    ) -> None:
        self.instance = instance
        self.flights = flights
        self.engine = engine
        self.data = data
        self.log = log
        self.finished: dict[str, Trajectory] = {}  # not yet acknowledged by the data role
        self.failed: dict[str, str] = {}  # trajectory id -> why; not yet acknowledged

    def holding(self) -> list[str]:
        """Every trajectory this rollout still answers for (a ``take`` must not hand them out)."""
        return [*self.flights, *self.finished, *self.failed]

    async def loop(self, clock: Clock, interval_s: float) -> None:
        while True:
            await clock.sleep(interval_s)
            with contextlib.suppress(RpcError):  # noted by the peer; sent again next time
                await self.flush()

    async def flush(self) -> None:
        """One report of everything unacknowledged (nothing to say: no call)."""
        partials = [c for tid, f in self.flights.items() if (c := f.unsent(tid)) is not None]
        completed = list(self.finished.values())
        failed = [FailedItem(trajectory_id=tid, reason=why) for tid, why in self.failed.items()]
        if not partials and not completed and not failed:
            return
        report = Report(
            rollout=self.instance, partials=partials, completed=completed, failed=failed
        )
        reply = await self.data.call(lambda data: data.report.call(report), ONCE)
        refused = {r.trajectory_id for r in reply.rejected if r.item == "partial"}
        for chunk in partials:
            flight = self.flights.get(chunk.trajectory_id)
            if flight is not None and chunk.trajectory_id not in refused:
                flight.acked = max(flight.acked, chunk.offset + len(chunk.token_ids))
        for t in completed:  # stored, duplicates or refused: sent for good either way
            self.finished.pop(t.trajectory_id, None)
        for f in failed:
            self.failed.pop(f.trajectory_id, None)
        for r in reply.rejected:
            self.log.warning("the data role refused a report item; dropped",
                             trajectory=r.trajectory_id, item=r.item, reason=r.reason)  # fmt: skip
        # a refused partial: stop generating it; the data role re-delivers it from what it has
        for tid in [*reply.drop, *refused]:
            if self.flights.pop(tid, quiet=True) is not None:
                await self.engine.abort(tid)
                self.flights.changed()
        if reply.drop:
            self.log.warning("dropped trajectories the data role reassigned", ids=reply.drop)
