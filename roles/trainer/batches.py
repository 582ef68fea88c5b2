"""Where a trainer's batches come from: the data role's ``sample`` endpoint, whole groups only.

One piece for both trainers (the torch ``trainer`` and the emulated ``sim_trainer``): they must
gather batches the same way, or a schedule comparison measures the difference between two
copies of this loop instead of the schedules.

Why a loop: one ``sample`` call waits at most ``wait_s`` and may return fewer rows than asked
(or none), so a batch is gathered over several calls, each asking for what is still missing
after the cursor reached so far. A data role that is unreachable or restarting is retried once
a second; without a configured address the role is looked up again through the manager, since
a restarted data role may listen elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laminar.errors import CallTimeout, PeerUnavailable, RemoteError
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.service import ServiceContext
from laminar.trajectory import Trajectory


@dataclass
class Gathered:
    """One batch: its trajectories, the consume cursor after them, and what the data role
    scored while it was gathered (filtered groups included)."""

    items: list[Trajectory] = field(default_factory=list)
    cursor: int = 0
    scored: int = 0
    scored_reward_sum: float = 0.0

    @property
    def reward_generated(self) -> float | None:
        """Mean reward of every trajectory scored meanwhile: the policy's, whatever the buffer
        then trained or filtered (None when nothing was scored)."""
        return self.scored_reward_sum / self.scored if self.scored else None


class BatchSource:
    def __init__(self, ctx: ServiceContext, log: Any, address: str | None, wait_s: float) -> None:
        self.ctx, self.log = ctx, log
        self.configured = address
        self.address = address
        self.wait_s = wait_s

    async def _data(self) -> DataApi:
        if self.address is None:
            self.address = await self.ctx.find("data")
        return self.ctx.connect(DataApi, self.address)

    async def next(self, rows: int, version: int, after: int) -> Gathered:
        """Exactly the next ``rows`` trajectories (whole groups) after consume cursor ``after``,
        for a trainer at ``version`` (their staleness is judged against it)."""
        got = Gathered(cursor=after)
        while len(got.items) < rows:
            try:
                data = await self._data()
                reply = await data.sample.options(timeout=self.wait_s + 30).call(
                    SampleRequest(
                        n=rows - len(got.items),
                        trainer_version=version,
                        wait_s=self.wait_s,
                        after=got.cursor,
                        whole_groups=True,
                    )
                )
            except (PeerUnavailable, CallTimeout, RemoteError) as exc:
                self.log.warning("data role unreachable; retrying", error=str(exc))
                if self.configured is None:
                    self.address = None
                await self.ctx.clock.sleep(1.0)
                continue
            got.items.extend(reply.items)
            got.cursor = max(got.cursor, reply.cursor)
            got.scored += reply.scored
            got.scored_reward_sum += reply.scored_reward_sum
        return got
