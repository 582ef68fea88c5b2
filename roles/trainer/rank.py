"""The ``trainer_rank`` role: one data-parallel rank of a trainer, as its own process on any host.

With ``trainer.ranks: serve`` the trainer service is rank 0 and each of ranks 1..W-1 is a
``laminar serve --role trainer_rank`` process (:mod:`.dp`). A rank knows nothing in advance but
the manager: it takes a seat in the newest generation of the group the trainer offered
(:mod:`laminar.roles.manager.api`: the group's address, the world size, its rank, the trainer's
config
and the checkpoint to load), joins it and follows rank 0's ops (the same
:func:`.worker.serve_rank` a spawned rank runs) until rank 0 stops the group or a collective
fails: rank 0 died, or another rank did and rank 0 re-forms the group. Then it asks for a seat
in a newer generation, and so on: a rank outlives any number of trainer restarts, and a
restarted rank joins whatever generation is next.

Ranks are numbered in the order they take their seats (rank 0 is the trainer); nothing in a rank's
command line or config says which it is, so every host runs the same command. Each rank process
loads the model (``trainer.model``) and checkpoints (``trainer.checkpoint.dir``) from the paths in
the trainer's config: on other hosts these must name the same files (a shared file system).

The group's work runs on a daemon thread, not an executor: a collective cannot be interrupted,
and an executor's threads are joined at interpreter exit, so a rank stopped while its group hangs
would hang too.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, ClassVar

import torch.distributed as dist
from prometheus_client import Gauge
from pydantic import BaseModel

from laminar.roles.manager.api import RendezvousApi, Seat, SeatRequest
from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.endpoint import endpoint
from laminar.runtime.errors import ConfigError, RpcError
from laminar.runtime.peers import Outage
from laminar.runtime.service import Service

from .config import TrainerRankConfig
from .worker import serve_rank


class RankStatus(BaseModel):
    generation: int  # the generation served now (0: none, waiting for a seat)
    rank: int
    world: int
    served: list[int]  # every generation joined, in order
    failed: int  # generations that ended in a failed collective (not rank 0's stop)


class TrainerRankApi:
    @endpoint
    async def status(self) -> RankStatus:
        raise NotImplementedError


class TrainerRankService(Service, TrainerRankApi):
    role: ClassVar[str] = "trainer_rank"
    computes: ClassVar[bool] = True  # keeps its priority and cores (laminar.proc.placement)
    config_model: ClassVar[type[ServiceConfig]] = TrainerRankConfig
    config: TrainerRankConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.seat = Seat()
        self.served: list[int] = []
        self.failed = 0
        self.m_generation = Gauge(
            "laminar_trainer_rank_generation",
            "The trainer group generation this rank serves (0: none)",
            registry=ctx.registry,
        )

    async def on_start(self) -> None:
        if self.ctx.manager is None:
            raise ConfigError("trainer_rank finds its group through the manager: use --join")
        self.spawn(self._serve(), name="rank")

    def stats(self) -> dict[str, float]:
        return {"generation": float(self.seat.generation), "rank": float(self.seat.rank)}

    @endpoint
    async def status(self) -> RankStatus:
        return RankStatus(
            generation=self.seat.generation,
            rank=self.seat.rank,
            world=self.seat.world,
            served=list(self.served),
            failed=self.failed,
        )

    async def _serve(self) -> None:
        """Take a seat in each newer generation and serve in it, for ever."""
        assert self.ctx.manager is not None
        manager: Any = self.ctx.connect(RendezvousApi, self.ctx.manager)
        wait = min(self.config.seat_wait_s, self.ctx.cluster.rpc_timeout_s)
        outage = Outage.logged(self.log, "manager unreachable; retrying", "manager back")
        after = 0
        while True:
            req = SeatRequest(
                group=self.config.group, instance=self.ctx.instance, after=after, wait_s=wait
            )
            try:
                seat = await manager.take_seat.options(
                    timeout=wait + self.ctx.cluster.rpc_timeout_s
                ).call(req)
            except RpcError as exc:
                outage.failed(exc)
                await self.ctx.clock.sleep(1.0)
                continue
            outage.ok()
            if seat.generation == 0:
                continue  # nothing open yet (or full): ask again
            after = seat.generation
            await self._generation(seat)

    async def _generation(self, seat: Seat) -> None:
        self.seat = seat
        self.served.append(seat.generation)
        self.m_generation.set(seat.generation)
        self.log.info(
            "joining the trainer group",
            generation=seat.generation,
            rank=seat.rank,
            world=seat.world,
            address=seat.address,
        )
        error = await _in_thread(seat, f"trainer-rank{seat.rank}")
        if error is None:
            self.log.info("trainer group stopped", generation=seat.generation)
        else:
            self.failed += 1
            self.log.warning(
                "trainer group failed; waiting for the next generation",
                generation=seat.generation,
                error=str(error)[:300],
            )
        self.seat = Seat()
        self.m_generation.set(0)


async def _in_thread(seat: Seat, name: str) -> BaseException | None:
    """Serve ``seat`` on a daemon thread (see the module); what ended it (None: a stop)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BaseException | None] = loop.create_future()

    def finish(result: BaseException | None) -> None:
        if not done.done():
            done.set_result(result)

    def body() -> None:
        result: BaseException | None = None
        try:
            serve_rank(seat.rank, seat.config, seat.address, seat.state_path, seat.timeout_s)
        except BaseException as exc:  # reported to the loop, which decides
            result = exc
        finally:
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # a broken group may fail to say goodbye
                    dist.destroy_process_group()
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
            loop.call_soon_threadsafe(finish, result)

    threading.Thread(target=body, name=name, daemon=True).start()
    return await done
