"""The rendezvous contract: how a trainer's ranks in other processes (other hosts) find its group.

Why through the manager: every member already knows the manager's address and nothing else, so a
rank started by hand on another host, by ``laminar run``'s supervisor or by Ray needs no
``MASTER_ADDR``; and a rank restarted after a crash learns where the group re-forms without anyone
editing its command line. Rank 0 (the trainer service) *offers* each generation of its group:
the address it listens on (a free port on its own bind host), the world size, and what every rank
must run (rank 0's trainer config, the checkpoint to start from). Each rank process *takes a
seat* in the newest generation it has not served; seats are numbered 1..W-1 in the order they are
taken (rank 0 is the offerer), so ranks need no per-host configuration.

Generations count up across the trainer's restarts (the manager numbers them) and past the newest
any rank asked about (``SeatRequest.after``), so after a manager restart a surviving rank is never
offered a number it already served. A generation whose offerer's connection to the manager closed
(it died), or whose seats are all taken, is not offered: a rank 0 whose group fails to form (a
seated rank never came) offers a new one.

It lives here, beside :mod:`laminar.membership`, because ranks and the trainer speak it while only
the manager serves it (``roles.manager.rendezvous``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from .endpoint import endpoint

#: The longest a seat request may wait at the manager: well inside any RPC timeout.
MAX_SEAT_WAIT_S = 30.0


class GroupOffer(BaseModel):
    """Rank 0 forming a new generation of its group."""

    group: str = "trainer"  # which group (one per trainer)
    instance: str  # rank 0's member instance: its death withdraws the offer
    address: str  # tcp://HOST:PORT of the group's store, on rank 0's host
    world: Annotated[int, Field(ge=2)]
    config: str  # the trainer's config (JSON): every rank runs rank 0's settings
    state_path: str | None = None  # the checkpoint every rank loads (None: the initial model)
    timeout_s: Annotated[float, Field(gt=0)] = 600.0  # the group's collective timeout


class GroupFormed(BaseModel):
    generation: int  # the offer's number, newer than any generation offered or asked about


class SeatRequest(BaseModel):
    group: str = "trainer"
    instance: str  # the rank process's member instance (the same seat if it asks again)
    after: int = 0  # a generation newer than this one (the last this process served)
    wait_s: Annotated[float, Field(ge=0, le=MAX_SEAT_WAIT_S)] = 5.0


class Seat(BaseModel):
    """A place in one generation of the group; ``generation`` 0: none open (ask again)."""

    generation: int = 0
    rank: int = 0
    world: int = 0
    address: str = ""
    config: str = ""
    state_path: str | None = None
    timeout_s: float = 600.0


class RendezvousApi:
    """Served by the manager; called by a trainer (offer) and its rank processes (seat)."""

    @endpoint
    async def offer_group(self, req: GroupOffer) -> GroupFormed:
        raise NotImplementedError

    @endpoint
    async def take_seat(self, req: SeatRequest) -> Seat:
        raise NotImplementedError
