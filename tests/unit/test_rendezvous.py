"""The trainer group's rendezvous at the manager (``roles.manager.rendezvous.GroupBoard``) and
rank 0's helpers: seats in asking order, generations that never go back (a manager restart
included), offers withdrawn with their connection, and which errors mean the group broke."""

from __future__ import annotations

import asyncio

import pytest

from laminar.roles.manager.api import GroupOffer, SeatRequest
from laminar.roles.manager.rendezvous import GroupBoard
from laminar.roles.trainer.rendezvous import group_failure, host_of
from laminar.runtime.clock import RealClock


def offer(world: int = 3, address: str = "tcp://10.0.0.1:29500") -> GroupOffer:
    return GroupOffer(instance="trainer", address=address, world=world, config="{}")


def ask(instance: str, after: int = 0, wait_s: float = 0.0) -> SeatRequest:
    return SeatRequest(instance=instance, after=after, wait_s=wait_s)


async def test_seats_in_asking_order_and_the_same_seat_when_asked_again() -> None:
    board = GroupBoard(RealClock())
    assert (await board.take(ask("a"))).generation == 0  # nothing offered yet
    formed = board.offer(offer(world=3), connection=7)
    a, b = await board.take(ask("b")), await board.take(ask("a"))
    assert (a.rank, b.rank) == (1, 2)
    assert a.generation == b.generation == formed.generation == 1
    assert a.address == "tcp://10.0.0.1:29500" and a.world == 3
    assert (await board.take(ask("b"))).rank == 1  # a retried request keeps its seat
    assert (await board.take(ask("c"))).generation == 0  # full
    assert (await board.take(ask("a", after=1))).generation == 0  # served it: wants a newer one
    again = board.offer(offer(world=3), connection=7)
    assert again.generation == 2
    assert (await board.take(ask("c", after=0))).rank == 1  # fresh seats in each generation


async def test_a_new_offer_is_numbered_past_every_generation_asked_about() -> None:
    board = GroupBoard(RealClock())  # a restarted manager: it has forgotten generations 1..7
    assert (await board.take(ask("a", after=7))).generation == 0
    formed = board.offer(offer(world=2), connection=1)
    assert formed.generation == 8
    seat = await board.take(ask("a", after=7))
    assert (seat.generation, seat.rank) == (8, 1)


async def test_an_offer_goes_with_the_connection_it_came_on() -> None:
    board = GroupBoard(RealClock())
    board.offer(offer(world=2), connection=5)
    assert board.disconnected(6) == []
    assert board.disconnected(5) == [1]  # rank 0 died: nobody may join its dead group
    assert (await board.take(ask("a"))).generation == 0


async def test_a_waiting_rank_gets_the_offer_made_meanwhile() -> None:
    board = GroupBoard(RealClock())
    waiting = asyncio.create_task(board.take(ask("a", wait_s=10.0)))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    board.offer(offer(world=2), connection=1)
    seat = await asyncio.wait_for(waiting, 5.0)
    assert (seat.generation, seat.rank) == (1, 1)


@pytest.mark.parametrize(
    ("error", "broken"),
    [
        (
            RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"),
            True,
        ),
        (RuntimeError("Socket Timeout"), True),
        (RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"), False),
        (ValueError("connection"), False),  # only the errors a collective raises
    ],
)
def test_which_errors_mean_the_group_broke(error: Exception, broken: bool) -> None:
    assert group_failure(error) is broken


def test_the_host_rank_0_offers_is_its_bind_host() -> None:
    assert host_of("tcp://10.1.2.3:7500") == "10.1.2.3"
    assert host_of("tcp://[fe80::1]:7500") == "fe80::1"
    assert host_of("tcp://0.0.0.0:7500") not in ("", "0.0.0.0")  # a name others can resolve
