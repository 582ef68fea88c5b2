"""The manager's side of the trainer group's rendezvous (``api.RendezvousApi``):
the open generation of each trainer group.

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

State is small and soft: one offer per group (the newest), its seats, and the newest generation
number anyone has offered or asked about. A restarted manager loses it and that is fine: a rank
waiting for a seat asks again with the generation it served (so numbering resumes past it), and a
rank 0 whose group fails to form offers again.

An offer is withdrawn when the connection it came on closes: rank 0 offers while its service
starts, before it has joined as a member (it forms its group in ``on_start``), so membership
cannot say whether it is alive; its connection can, at once, as it does for membership (a
process killed with -9 has its sockets closed by the kernel).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from laminar.roles.manager.api import GroupFormed, GroupOffer, Seat, SeatRequest
from laminar.runtime.clock import Clock


@dataclass
class _Open:
    offer: GroupOffer
    generation: int
    connection: int | None  # the RPC connection it came on (None: in-process, never closes)
    seats: dict[str, int] = field(default_factory=dict)  # rank instance -> rank


class GroupBoard:
    """Offers and seats of every group (see the module docstring)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._open: dict[str, _Open] = {}
        self._newest: dict[str, int] = {}  # group -> newest generation offered or asked about
        self._changed = asyncio.Event()

    def offer(self, req: GroupOffer, connection: int | None) -> GroupFormed:
        generation = self._newest.get(req.group, 0) + 1
        self._newest[req.group] = generation
        self._open[req.group] = _Open(req, generation, connection)
        self._changed.set()
        self._changed = asyncio.Event()
        return GroupFormed(generation=generation)

    def seat(self, req: SeatRequest) -> Seat | None:
        """A seat now, or None: nothing open for this rank (yet)."""
        self._newest[req.group] = max(self._newest.get(req.group, 0), req.after)
        current = self._open.get(req.group)
        if current is None or current.generation <= req.after:
            return None
        rank = current.seats.get(req.instance)
        if rank is None:
            if len(current.seats) >= current.offer.world - 1:
                return None  # full: the next generation has room
            rank = current.seats[req.instance] = len(current.seats) + 1
        o = current.offer
        return Seat(
            generation=current.generation,
            rank=rank,
            world=o.world,
            address=o.address,
            config=o.config,
            state_path=o.state_path,
            timeout_s=o.timeout_s,
        )

    def disconnected(self, connection: int) -> list[int]:
        """Withdraw the offers made on ``connection``; the generations withdrawn."""
        gone = [g for g, o in self._open.items() if o.connection == connection]
        return [self._open.pop(g).generation for g in gone]

    async def take(self, req: SeatRequest) -> Seat:
        """A seat, waiting up to ``req.wait_s`` for an offer that has one (else generation 0)."""
        deadline = self._clock.time() + req.wait_s
        while (seat := self.seat(req)) is None:
            left = deadline - self._clock.time()
            if left <= 0:
                return Seat()
            with contextlib.suppress(TimeoutError):  # an offer wakes us; a death is polled
                async with asyncio.timeout(min(left, 0.5)):
                    await self._changed.wait()
        return seat
