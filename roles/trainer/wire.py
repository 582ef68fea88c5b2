"""What crosses between the ranks of a trainer group: one op header, then the op's tensors.

Rank 0 drives; ranks 1..W-1 follow (:mod:`.worker`). Everything goes over
``torch.distributed`` (gloo on CPU, NCCL where CUDA is), the same library that reduces the
gradients, so no pickle crosses a process boundary and a rank that dies fails its peers' next
collective the same way whatever they were doing.

Each group has a second, gloo-only process group, :func:`staging_group`: a publish's background
copy (:mod:`.staging`) ends with a barrier on it while the training thread goes on with the next
step's collectives on the main group. Two groups, because two threads may not interleave
collectives on one: each rank would issue them in its own order.
"""

from __future__ import annotations

import datetime
import enum
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from laminar.rl import PackedBatch

from .config import TrainerConfig

NAME_BYTES = 128  # room for a shared-memory segment's name in a broadcast
_FIELDS = ("input_ids", "attention_mask", "loss_mask", "behaviour_logprobs", "advantages")
_DTYPES = (torch.long, torch.long, torch.float32, torch.float32, torch.float32)


class Op(enum.IntEnum):
    """What rank 0 asks of the group next (the header's first number)."""

    TRAIN = 1  # then the batch: (rows, width)
    STOP = 2
    WEIGHTS = 3  # gather the weights whole, one tensor at a time (a publish across hosts)
    STATE = 4  # gather the training state (a checkpoint)
    EVAL = 5  # (version): every rank generates the same prompts
    SLICES = 6  # (total bytes), then a segment's name: write your rows into it (a publish)
    ROWS = 7  # (total bytes): send your rows to rank 0 on the staging group (a publish)


_staging: dist.ProcessGroup | None = None


def ranks_mode(config: TrainerConfig) -> str:
    """``trainer.ranks``: where ranks 1..W-1 run (``spawn`` or ``serve``, :mod:`.dp`)."""
    return str(getattr(config, "ranks", "spawn"))


def threads_for(config: TrainerConfig) -> int:
    """``threads_per_rank``, else the threads `laminar run`'s CPU plan gave this process
    (``LAMINAR_THREADS``), else this process's cores, divided between the ranks it holds (all
    of them when spawned, itself alone when each rank is its own process)."""
    if config.threads_per_rank is not None:
        return config.threads_per_rank
    planned = os.environ.get("LAMINAR_THREADS")
    cores = int(planned) if planned else len(os.sched_getaffinity(0))
    here = 1 if ranks_mode(config) == "serve" else config.data_parallel
    return max(1, cores // here)


def local_rendezvous() -> tuple[str, Path]:
    """Where ranks on this host meet: a file in a fresh private directory (``file://``), and
    that directory, for the caller to remove once the group is closed.

    Not a free port, closed, then named to the ranks: between the close and rank 0's listen
    another process may take it (EADDRINUSE: a suite run lost a test to it), and a group of
    local ranks has no second try. The ranks' collectives (gloo) bind their own ports."""
    directory = Path(tempfile.mkdtemp(prefix="laminar-group-"))
    return f"file://{directory / 'store'}", directory


def init_group(rank: int, world: int, address: str, timeout_s: float) -> None:
    """Join the group at ``address`` as ``rank`` (every rank calls this), and its staging group."""
    global _staging
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # each rank its own GPU (resolve_device picks the same one)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    _reset_group_names()
    dist.init_process_group(
        backend, init_method=address, rank=rank, world_size=world, timeout=timeout
    )
    # Named from its ranks, not from the process's count of groups made so far: a rank 0 that
    # has re-formed its group (or failed to form one) has counted differently from a fresh rank,
    # and groups named from those counts never meet (a hang until the timeout).
    _staging = dist.new_group(
        list(range(world)), backend="gloo", timeout=timeout, use_local_synchronization=True
    )


def _reset_group_names() -> None:
    """Number this process's groups from 0 again, as a fresh process does.

    torch names an unnamed group after a per-process counter and keys the group's rendezvous by
    that name. ``destroy_process_group`` resets the counter, but a rendezvous that failed (its
    port taken between offer and listen: EADDRINUSE) has already counted one, so rank 0's next
    group got name 1 while a fresh rank's got 0, and the two never met (a hang until the
    timeout). torch has no public reset."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def staging_group() -> dist.ProcessGroup:
    """The group's second process group, for background copies (see the module)."""
    if _staging is None or not dist.is_initialized():
        raise RuntimeError("no trainer group: init_group first")
    return _staging


def _device() -> torch.device:
    """Where this group's collectives run: NCCL takes device tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_op(op: int = 0, *arg: int) -> tuple[int, int, int]:
    """Rank 0 says what comes next (an :class:`Op` and up to two numbers); every rank returns
    it."""
    header = torch.zeros(3, dtype=torch.long, device=_device())
    if dist.get_rank() == 0:
        header[: 1 + len(arg)] = torch.tensor([op, *arg])
    dist.broadcast(header, 0)
    a, b, c = header.tolist()
    return a, b, c


def broadcast_batch(batch: PackedBatch | None, shape: tuple[int, int]) -> PackedBatch:
    """Rank 0 passes ``batch``, the others None; every rank returns rank 0's batch."""
    tensors = []
    for name, dtype in zip(_FIELDS, _DTYPES, strict=True):
        t = (
            getattr(batch, name).to(_device(), dtype).contiguous()
            if batch
            else torch.empty(shape, dtype=dtype, device=_device())
        )
        dist.broadcast(t, 0)
        tensors.append(t)
    return PackedBatch(*tensors)


def broadcast_name(name: str | None) -> str:
    """Rank 0 passes a short ASCII name (a shared-memory segment's); every rank returns it."""
    raw = torch.zeros(NAME_BYTES, dtype=torch.uint8, device=_device())
    if name is not None:
        data = name.encode()
        raw[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(raw, 0)
    return bytes(raw.cpu().tolist()).rstrip(b"\0").decode()


class GroupStop:
    """The ``stop`` of an evaluation that the ranks of a sharded group run in step (every rank
    generates the same prompts, and each decoding step's forward pass gathers the weights from
    all of them), so that a trainer told to stop mid-evaluation takes every rank out of it.

    Two questions, because ``generate`` asks at every decoding step, and a rank whose rows are
    done stops asking while it keeps stepping with the others (HF's ``synced_gpus``): a
    collective there would not pair up. So the per-step question (``stop()``) is local: rank 0
    answers from ``told`` (the trainer's flag; None: never told) and, once it is up, writes a key
    in the group's store; another rank reads that key (on every ``every``-th question: a read is
    a round trip to the store). It only ends the ``generate`` call early. Whether the evaluation
    ends is :meth:`agreed`, asked between generate calls, where every rank asks the same number
    of times: one all-reduce of the ranks' answers, so all of them give up after the same call,
    or none does.

    Reaches into torch for the group's store (``_get_default_store``: the rendezvous store every
    group has, file or TCP); nothing else here is private."""

    def __init__(
        self, version: int, told: Callable[[], bool] | None = None, every: int = 4
    ) -> None:
        from torch.distributed import distributed_c10d

        self._key = f"laminar/eval-stop/{version}"
        self._told = told
        self._rank0 = dist.get_rank() == 0
        self._every = every
        self._store = distributed_c10d._get_default_store()
        self._stopped = False
        self._asked = 0

    def __call__(self) -> bool:
        if self._stopped:
            return True
        if self._rank0:
            if self._told is not None and self._told():
                self._store.set(self._key, "1")
                self._stopped = True
        elif self._asked % self._every == 0:
            self._stopped = self._store.check([self._key])
        self._asked += 1
        return self._stopped

    def agreed(self) -> bool:
        """Whether any rank's ``stop()`` says stop (a collective: every rank asks here)."""
        flag = torch.tensor([int(self())], device=_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
