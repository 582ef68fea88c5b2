"""Where a trainer's batches come from: the data role's ``sample`` endpoint, whole groups only.

One piece for both trainers (the torch ``trainer`` and the emulated ``sim_trainer``): they must
gather batches the same way, or a schedule comparison measures the difference between two
copies of this loop instead of the schedules.

Why a loop: one ``sample`` call waits at most ``wait_s`` and may return fewer rows than asked
(or none), so a batch is gathered over several calls, each asking for what is still missing
after the cursor reached so far. A data role that is unreachable or restarting is retried once
a second; without a configured address the role is looked up again through the manager, since
a restarted data role may listen elsewhere.

Why pieces: a reply holding the whole batch may be larger than the cluster's frame limit (long
responses, big batches). The data role then refuses to send it (``MessageTooLarge``, at the
sender), and the batch is asked for in pieces of half as many whole groups, as often as needed.
Nothing is lost or trained twice: the refused trajectories were consumed after ``cursor``, and
asking again after the same cursor re-delivers them first. The piece size is kept for later
batches, so the refusal is not paid again every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from laminar.roles.data.api import DataApi, SampleRequest, Trajectories
from laminar.runtime.context import ServiceContext
from laminar.runtime.errors import RemoteError, RpcError
from laminar.runtime.peers import RetryPolicy
from laminar.trajectory import Trajectory
from laminar.transport import MessageTooLarge


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


def _too_large(exc: Exception) -> bool:
    """The data role refused to send a reply over the frame limit: ask for less, not again."""
    return isinstance(exc, RemoteError) and exc.cause_type == MessageTooLarge.__name__


#: every failure is retried (the data role may be restarting, or refusing until its store is
#: ready) except a reply too large to send, which :meth:`BatchSource.next` answers by asking for
#: less
SAMPLE_RETRY = RetryPolicy(retry_on=(RpcError,), unless=_too_large)


class BatchTooLarge(RuntimeError):
    """A single group of trajectories is over the cluster's frame limit: no piece can carry it."""


class BatchSource:
    def __init__(
        self,
        ctx: ServiceContext,
        log: Any,
        address: str | None,
        wait_s: float,
        *,
        group: int | None = None,
    ) -> None:
        self.ctx, self.log = ctx, log
        self.data = ctx.peer("data", DataApi, address=address)
        self.wait_s = wait_s
        # samples per prompt: pieces hold whole groups (default: the trainer's batch.samples)
        batch = getattr(ctx.config, "batch", None)
        self.group: int = group or int(getattr(batch, "samples", 1))
        self.piece: int | None = None  # rows per sample call, once a whole batch was too large

    async def next(self, rows: int, version: int, after: int) -> Gathered:
        """Exactly the next ``rows`` trajectories (whole groups) after consume cursor ``after``,
        for a trainer at ``version`` (their staleness is judged against it)."""
        got = Gathered(cursor=after)
        while len(got.items) < rows:
            want = rows - len(got.items)
            if self.piece is not None:
                want = min(want, self.piece)
            request = SampleRequest(
                n=want, trainer_version=version, wait_s=self.wait_s, after=got.cursor,
                whole_groups=True,
            )  # fmt: skip
            try:
                reply = await self.data.call(partial(self._sample, request), SAMPLE_RETRY)
            except RemoteError as exc:  # only a reply too large to send gets here
                self._shrink(want, exc)
                continue
            got.items.extend(reply.items)
            got.cursor = max(got.cursor, reply.cursor)
            got.scored += reply.scored
            got.scored_reward_sum += reply.scored_reward_sum
        return got

    async def _sample(self, request: SampleRequest, data: DataApi) -> Trajectories:
        return await data.sample.options(timeout=self.wait_s + 30).call(request)

    def _shrink(self, asked: int, exc: RemoteError) -> None:
        """The reply for ``asked`` rows was too large to send: ask for half as many groups."""
        groups = asked // self.group
        if groups <= 1:
            raise BatchTooLarge(
                f"one group of {self.group} trajectories is larger than the cluster's frame limit "
                f"({exc.cause}); raise cluster.max_frame_mib (on every member) or lower the "
                "data role's max_tokens"
            ) from exc
        self.piece = (groups // 2) * self.group
        self.log.warning(
            "batch too large for one message; sampling it in pieces",
            asked=asked,
            piece=self.piece,
            error=exc.cause,
        )
