"""Rank 0's link to the manager for ``ranks: serve`` (:mod:`laminar.roles.manager.api`), and its
helpers.

The data-parallel group is driven from the trainer's compute thread (:mod:`.dp`), which must not
touch the event loop's objects, while offers go out over the service's RPC client. So
:class:`GroupRendezvous` is made on the loop (it keeps the loop) and its :meth:`offer` is called
from the thread: the call runs on the loop, the thread waits for its answer. A manager that is
down is retried until it answers: a group cannot form without it anyway, and the rest of the
trainer (heartbeats, status) keeps running on the loop meanwhile.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import torch.distributed as dist

from laminar.roles.manager.api import GroupOffer, RendezvousApi
from laminar.runtime.context import ServiceContext
from laminar.runtime.errors import RpcError
from laminar.runtime.peers import Outage

__all__ = ["GroupRendezvous", "free_port", "group_failure", "host_of", "rendezvous_for"]

# What a collective or a rendezvous raises when a member of the group is gone or silent; gloo
# raises plain RuntimeErrors ("Read error [...]: Connection reset by peer"), NCCL and the store
# raise torch.distributed.DistError subclasses.
_FAILURE_WORDS = ("gloo", "nccl", "connection", "socket", "timed out", "timeout", "peer")


def group_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the group broke (a member died or went silent), not a bug."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _FAILURE_WORDS)


def host_of(address: str) -> str:
    """The host of an RPC address (``tcp://HOST:PORT``); a wildcard bind (``0.0.0.0``, ``::``)
    gives the local machine's name, which the other hosts can resolve."""
    host = address.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def free_port(host: str) -> int:
    """A port free on ``host`` now (the group's store binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class GroupRendezvous:
    """Offers generations of the trainer's group through the manager (see the module)."""

    def __init__(self, ctx: ServiceContext, group: str = "trainer") -> None:
        if ctx.manager is None:
            raise ValueError(
                "trainer.ranks is serve but the trainer runs standalone: its ranks find the "
                "group through the manager (laminar serve --join)"
            )
        assert ctx.address is not None
        self.ctx, self.group = ctx, group
        self.host = host_of(ctx.address)
        self.loop = asyncio.get_running_loop()
        self.outage = Outage.logged(ctx.log, "manager unreachable; retrying", "manager back")

    def offer(
        self, address: str, world: int, config: str, state_path: str | None, timeout_s: float
    ) -> int:
        """Offer a generation (from the compute thread); its number."""
        req = GroupOffer(
            group=self.group,
            instance=self.ctx.instance,
            address=address,
            world=world,
            config=config,
            state_path=state_path,
            timeout_s=timeout_s,
        )
        return asyncio.run_coroutine_threadsafe(self._offer(req), self.loop).result()

    async def _offer(self, req: GroupOffer) -> int:
        assert self.ctx.manager is not None
        manager: Any = self.ctx.connect(RendezvousApi, self.ctx.manager)
        while True:
            try:
                formed = await manager.offer_group.call(req)
            except RpcError as exc:
                self.outage.failed(exc)
                await self.ctx.clock.sleep(1.0)
                continue
            self.outage.ok()
            return int(formed.generation)


def rendezvous_for(ctx: ServiceContext, config: Any) -> GroupRendezvous | None:
    """What the trainer service gives its :class:`.dp.DataParallelGroup`: a rendezvous when its
    ranks are served (``ranks: serve`` and more than one rank), else None. Call it on the loop."""
    served = config.data_parallel > 1 and getattr(config, "ranks", "spawn") == "serve"
    return GroupRendezvous(ctx) if served else None
