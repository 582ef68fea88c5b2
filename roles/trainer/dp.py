"""Data parallelism: rank 0 lives in the trainer service, ranks 1..W-1 are spawned processes.

Rank 0 owns everything that talks to the cluster (data, relays, checkpoints); the other ranks only
compute. Each global batch goes from rank 0 to the others with ``torch.distributed.broadcast``
(a command header, then the batch's five tensors), the same collective library that all-reduces
the gradients: gloo on CPU, NCCL where CUDA is available. No pickle crosses a process boundary.

A rank that dies takes the group down (its peers' next collective fails after ``timeout_s``);
the trainer then exits and is restarted from its last checkpoint, which is the recovery story for
trainer failures anyway.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket

import torch
import torch.distributed as dist

from laminar.rl import PackedBatch

from .checkpoint import load_training_state
from .compute import PolicyTrainer, StepResult
from .config import TrainerConfig

_TRAIN, _STOP = 1, 2
_FIELDS = ("input_ids", "attention_mask", "loss_mask", "behaviour_logprobs", "advantages")
_DTYPES = (torch.long, torch.long, torch.float32, torch.float32, torch.float32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _threads(config: TrainerConfig) -> int:
    """``threads_per_rank``, else the threads `laminar run`'s CPU plan gave this process
    (``LAMINAR_THREADS``), else this process's cores, divided between the ranks."""
    if config.threads_per_rank is not None:
        return config.threads_per_rank
    planned = os.environ.get("LAMINAR_THREADS")
    cores = int(planned) if planned else len(os.sched_getaffinity(0))
    return max(1, cores // config.data_parallel)


def _init(rank: int, world: int, address: str, timeout_s: float) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        init_method=address,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _broadcast_batch(batch: PackedBatch | None) -> PackedBatch | None:
    """Rank 0 passes a batch (or None: stop); every rank returns what rank 0 passed."""
    header = torch.zeros(3, dtype=torch.long)
    if dist.get_rank() == 0:
        if batch is None:
            header[0] = _STOP
        else:
            header[0], header[1], header[2] = _TRAIN, *batch.input_ids.shape
    dist.broadcast(header, 0)
    if int(header[0]) == _STOP:
        return None
    shape = (int(header[1]), int(header[2]))
    tensors = []
    for name, dtype in zip(_FIELDS, _DTYPES, strict=True):
        t = (
            getattr(batch, name).to(dtype).contiguous()
            if batch
            else torch.empty(shape, dtype=dtype)
        )
        dist.broadcast(t, 0)
        tensors.append(t)
    return PackedBatch(*tensors)


def _worker(
    rank: int, config_json: str, address: str, state_path: str | None, timeout_s: float
) -> None:
    config = TrainerConfig.model_validate_json(config_json)
    torch.set_num_threads(_threads(config))
    _init(rank, config.data_parallel, address, timeout_s)
    trainer = PolicyTrainer(config, rank, config.data_parallel)
    if state_path is not None:
        trainer.load_state(*load_training_state(state_path))
    while (batch := _broadcast_batch(None)) is not None:
        trainer.train(batch)
    dist.destroy_process_group()


class DataParallelGroup:
    """Rank 0's handle on the group. Blocking methods: call them from a worker thread."""

    def __init__(
        self, config: TrainerConfig, state_path: str | None = None, timeout_s: float = 600.0
    ) -> None:
        self.config = config
        self.world = config.data_parallel
        self.procs: list[mp.process.BaseProcess] = []
        torch.set_num_threads(_threads(config))
        if self.world > 1:
            address = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            for rank in range(1, self.world):
                proc = ctx.Process(
                    target=_worker,
                    args=(rank, config.model_dump_json(), address, state_path, timeout_s),
                    daemon=True,
                    name=f"trainer-rank{rank}",
                )
                proc.start()
                self.procs.append(proc)
            _init(0, self.world, address, timeout_s)
        self.trainer = PolicyTrainer(config, 0, self.world)
        if state_path is not None:
            self.trainer.load_state(*load_training_state(state_path))

    def train(self, batch: PackedBatch) -> StepResult:
        if self.world > 1:
            _broadcast_batch(batch)
        return self.trainer.train(batch)

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            try:
                _broadcast_batch(None)
                dist.destroy_process_group()
            except Exception:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs.clear()
