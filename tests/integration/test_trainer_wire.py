"""A trainer group forms after a rendezvous that failed (``roles/trainer/wire.py``).

Rank 0 offers a port, and if someone takes it before rank 0 listens (EADDRINUSE) it offers
another. torch had already counted a group for the failed attempt, so rank 0's next group was
named 1 while a fresh rank's was 0, and the two waited for each other until the timeout: a
re-formed trainer group that never formed. Here the failed attempt is real (a port held by
another socket), the second rank a real process. Local ranks' meeting file is
``tests/unit/test_trainer_wire.py``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket

import pytest
import torch.distributed as dist

from laminar.roles.trainer.wire import init_group, staging_group


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank1(address: str) -> None:
    init_group(1, 2, address, 30)
    dist.barrier()
    dist.barrier(group=staging_group())
    dist.destroy_process_group()


def test_a_group_forms_after_a_rendezvous_that_failed() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
        with pytest.raises(Exception, match=r"(?i)address already in use|EADDRINUSE|listen"):
            dist.init_process_group(
                "gloo", init_method=busy, rank=0, world_size=2,
                timeout=datetime.timedelta(seconds=5),
            )  # fmt: skip
    address = f"tcp://127.0.0.1:{_port()}"
    other = mp.get_context("spawn").Process(target=_rank1, args=(address,))
    other.start()
    try:
        init_group(0, 2, address, 30)
        dist.barrier()
        dist.barrier(group=staging_group())
        dist.destroy_process_group()
        other.join(30)
        assert other.exitcode == 0
    finally:
        if other.is_alive():
            other.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
