"""Data parallelism: rank 0 lives in the trainer service, ranks 1..W-1 in other processes.

Rank 0 owns everything that talks to the cluster (data, relays, checkpoints); the other ranks only
compute. Each global batch goes from rank 0 to the others with ``torch.distributed.broadcast``
(a command header, then the batch's five tensors), the same collective library that all-reduces
the gradients: gloo on CPU, NCCL where CUDA is available. No pickle crosses a process boundary.

Where the other ranks run (``ranks``):

- ``spawn`` (the default): ``multiprocessing`` children of the trainer, on its host, meeting on a
  local port. A rank that dies takes the group down (its peers' next collective fails, at once for
  a closed socket, else after ``timeout_s``); the trainer then exits and is restarted from its
  last checkpoint, which is the recovery story for trainer failures anyway.
- ``serve``: each rank is its own ``laminar serve --role trainer_rank`` process, on any host
  (:mod:`.rank`). Rank 0 offers each *generation* of the group through the manager: a free port
  on its own bind host, the world size, its config and the checkpoint to start from
  (:mod:`laminar.rendezvous`); the rank processes take seats 1..W-1 and join. When a collective
  fails (a rank died), rank 0 does not exit: it tears the group down, offers a new generation,
  waits until all W ranks have joined it (the dead one restarted by its supervisor), and every
  rank loads the last checkpoint; rank 0 then replays the batches it trained on since that
  checkpoint (it keeps them, a few token tensors) and retries the failed operation, so the group
  is exactly where it was and the trainer's loop never notices beyond the wait. Rank 0 dying is
  the trainer's restart as in ``spawn`` mode; its ranks' collectives fail and they take seats in
  the generation the restarted trainer offers. Nothing outside the trainer waits on its group:
  rollouts keep generating throughout.

Sharded (``sharding: fsdp``, :mod:`.sharding`), reading the weights is a collective too, so rank
0 tells the others what comes next in the same header: train on a batch, gather the weights for a
publish (one tensor at a time, straight into the publisher's buffer), gather the training state
for a checkpoint, evaluate (every rank generates the same prompts), or stop. Replicated, rank 0
does the last three alone.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist

from laminar.rl import PackedBatch
from laminar.transport.shm import map_writable
from laminar.weights.manifest import WeightManifest
from laminar.weights.tensors import plan_specs

from .checkpoint import latest_checkpoint
from .compute import PolicyTrainer, StepResult
from .config import TrainerConfig
from .evaluator import Evaluator
from .rendezvous import GroupRendezvous, free_port, group_failure
from .sharding import write_slices

T = TypeVar("T")
log = structlog.get_logger("trainer")

#: Failures in a row, each right after the group re-formed, before rank 0 gives up (the trainer
#: exits and is restarted): a failure that follows every re-form is not a rank that died.
MAX_REFORMS = 3

_TRAIN, _STOP, _WEIGHTS, _STATE, _EVAL, _SLICES = 1, 2, 3, 4, 5, 6
_NAME_BYTES = 128  # room for a shared-memory segment's name in a broadcast
_FIELDS = ("input_ids", "attention_mask", "loss_mask", "behaviour_logprobs", "advantages")
_DTYPES = (torch.long, torch.long, torch.float32, torch.float32, torch.float32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ranks_mode(config: TrainerConfig) -> str:
    """``trainer.ranks``: where ranks 1..W-1 run (``spawn`` or ``serve``, see the module)."""
    return str(getattr(config, "ranks", "spawn"))


def _threads(config: TrainerConfig) -> int:
    """``threads_per_rank``, else the threads `laminar run`'s CPU plan gave this process
    (``LAMINAR_THREADS``), else this process's cores, divided between the ranks it holds (all
    of them when spawned, itself alone when each rank is its own process)."""
    if config.threads_per_rank is not None:
        return config.threads_per_rank
    planned = os.environ.get("LAMINAR_THREADS")
    cores = int(planned) if planned else len(os.sched_getaffinity(0))
    here = 1 if ranks_mode(config) == "serve" else config.data_parallel
    return max(1, cores // here)


def _init(rank: int, world: int, address: str, timeout_s: float) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # each rank its own GPU (resolve_device picks the same one)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=address,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _device() -> torch.device:
    """Where this group's collectives run: NCCL takes device tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_op(op: int = 0, *arg: int) -> tuple[int, int, int]:
    """Rank 0 says what comes next (an op and up to two numbers); every rank returns it."""
    header = torch.zeros(3, dtype=torch.long, device=_device())
    if dist.get_rank() == 0:
        header[: 1 + len(arg)] = torch.tensor([op, *arg])
    dist.broadcast(header, 0)
    a, b, c = header.tolist()
    return a, b, c


def _broadcast_batch(batch: PackedBatch | None, shape: tuple[int, int]) -> PackedBatch:
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


def _broadcast_name(name: str | None) -> str:
    """Rank 0 passes a short ASCII name (a shared-memory segment's); every rank returns it."""
    raw = torch.zeros(_NAME_BYTES, dtype=torch.uint8, device=_device())
    if name is not None:
        data = name.encode()
        raw[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(raw, 0)
    return bytes(raw.cpu().tolist()).rstrip(b"\0").decode()


def _write_slices(trainer: PolicyTrainer, total: int, name: str | None, view: Any) -> None:
    """Every rank: write its own rows into rank 0's staging segment (:meth:`DataParallelGroup.
    fill`), then wait until all have."""
    name = _broadcast_name(name)
    manifest = plan_specs(trainer.weight_specs(), 0)  # the same layout rank 0 planned
    if manifest.total_bytes != total:
        mine = manifest.total_bytes
        raise RuntimeError(f"rank {trainer.rank} plans {mine} bytes for a version, rank 0 {total}")
    if view is None:
        view = map_writable(name)
    write_slices(trainer.model, manifest, view, trainer.rank, trainer.world)
    dist.barrier()


def _worker(
    rank: int, config_json: str, address: str, state_path: str | None, timeout_s: float
) -> None:
    config = TrainerConfig.model_validate_json(config_json)
    torch.set_num_threads(_threads(config))
    _init(rank, config.data_parallel, address, timeout_s)
    trainer = PolicyTrainer(config, rank, config.data_parallel)
    if state_path is not None:
        trainer.load_checkpoint(state_path)
    evaluator = Evaluator(config.eval, config.model) if config.eval is not None else None
    while (header := _broadcast_op())[0] != _STOP:
        op, a, b = header
        if op == _TRAIN:
            trainer.train(_broadcast_batch(None, (a, b)))
        elif op == _WEIGHTS:  # rank 0 keeps them; this rank only takes part in each gather
            for _ in trainer.weights():
                pass
        elif op == _STATE:
            trainer.training_state()
        elif op == _SLICES:
            _write_slices(trainer, a, None, None)
        elif op == _EVAL and evaluator is not None:
            evaluator(trainer.model, a, synced=True)
    dist.destroy_process_group()


class DataParallelGroup:
    """Rank 0's handle on the group. Blocking methods: call them from a worker thread.

    ``rendezvous``: how rank 0 offers its group through the manager; needed (only) when
    ``ranks`` is ``serve``."""

    def __init__(
        self,
        config: TrainerConfig,
        state_path: str | None = None,
        timeout_s: float = 600.0,
        rendezvous: GroupRendezvous | None = None,
    ) -> None:
        self.config = config
        self.world = config.data_parallel
        self.procs: list[mp.process.BaseProcess] = []
        self.timeout_s = timeout_s
        self.served = self.world > 1 and ranks_mode(config) == "serve"
        self.rendezvous = rendezvous
        self.generation = 0  # served: the group's generation (the manager's number)
        self.reforms = 0  # served: how often the group was re-formed after a failure
        # served: what a re-formed group starts from (the last checkpoint) and the batches
        # trained on since, replayed on top of it (see the module docstring)
        self._base = state_path
        self._checkpointed = False  # a checkpoint was gathered since: the newest on disk
        self._replay: list[PackedBatch] = []
        torch.set_num_threads(_threads(config))
        if self.served:
            if rendezvous is None:
                raise ValueError(
                    "trainer.ranks is serve: rank 0 needs the manager's rendezvous "
                    "(roles/trainer/rendezvous.py), which only a trainer service has"
                )
            self._form(state_path)
        elif self.world > 1:
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
            self.trainer.load_checkpoint(state_path)

    def _tell(self, op: int, *arg: int) -> None:
        """Sharded: have the other ranks join rank 0's next collective read (see the module)."""
        if self.trainer.sharded:
            _broadcast_op(op, *arg)

    def _train(self, batch: PackedBatch) -> StepResult:
        if self.world > 1:
            _broadcast_op(_TRAIN, *batch.input_ids.shape)
            _broadcast_batch(batch, tuple(batch.input_ids.shape))
        return self.trainer.train(batch)

    def train(self, batch: PackedBatch) -> StepResult:
        result = self._recovering(lambda: self._train(batch))
        if self.served:
            self._replay.append(batch)
        return result

    def state_bytes(self) -> dict[str, int]:
        """Rank 0's share of parameters, gradients and optimizer states (the ranks' are equal,
        to a shard's rounding)."""
        return self.trainer.state_bytes()

    def weight_specs(self) -> list[tuple[str, torch.dtype, list[int]]]:
        return self.trainer.weight_specs()

    @property
    def writes_slices(self) -> bool:
        """Whether a publish can be staged by every rank writing its own rows into one
        shared-memory buffer (:meth:`fill`): sharded, with every rank on this host."""
        return self.trainer.sharded and not self.served

    def fill(self, manifest: WeightManifest, segment: str, view: memoryview) -> None:
        """Stage the weights into ``segment`` (``view`` is rank 0's mapping of it): each rank
        writes its own rows of every tensor, nothing is gathered, and rank 0 never holds a
        whole tensor (:func:`.sharding.write_slices`). Only where :attr:`writes_slices`."""
        if not self.writes_slices:
            raise RuntimeError("fill needs a sharded group whose ranks share this host")
        self._tell(_SLICES, manifest.total_bytes)
        _write_slices(self.trainer, manifest.total_bytes, segment, view)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights whole, one tensor at a time (sharded: one gather each, on every rank)."""
        if self.served:
            return self._served_weights()
        self._tell(_WEIGHTS)
        return self.trainer.weights()

    def _served_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`weights`, going on after a re-form from the first tensor not yet yielded (the
        re-formed group holds the same weights: the module docstring)."""
        done, failures = 0, 0
        while True:
            try:
                if failures:
                    self._reform()
                self._tell(_WEIGHTS)
                for i, item in enumerate(self.trainer.weights()):
                    if i >= done:
                        yield item
                        done += 1
                return
            except Exception as exc:
                failures = self._failed(exc, failures)

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        def gather() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            self._tell(_STATE)
            return self.trainer.training_state()

        state = self._recovering(gather)
        if self.served:  # gathered for a checkpoint: a re-formed group starts from that one
            self._checkpointed = True
            self._replay.clear()
        return state

    def evaluate(self, evaluator: Evaluator, version: int) -> Any:
        def run() -> Any:
            self._tell(_EVAL, version)
            return evaluator(self.trainer.model, version, synced=self.trainer.sharded)

        return self._recovering(run)

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            try:
                _broadcast_op(_STOP)
                dist.destroy_process_group()
            except Exception:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs.clear()

    # -- served ranks: forming and re-forming the group --------------------------------------

    def _recovering(self, op: Callable[[], T]) -> T:
        """``op()``; served, a group failure re-forms the group and ``op`` runs again."""
        failures = 0
        while True:
            try:
                if failures:
                    self._reform()
                return op()
            except Exception as exc:
                failures = self._failed(exc, failures)

    def _failed(self, exc: Exception, failures: int) -> int:
        """``exc`` again unless it is a group failure in served mode (and the group has not
        kept failing right after re-forming); else the failures so far, the group to re-form."""
        if not self.served or not group_failure(exc):
            raise exc
        failures += 1
        if failures > MAX_REFORMS:
            raise RuntimeError(
                f"the trainer group failed {failures} times in a row right after re-forming"
            ) from exc
        log.warning(
            "trainer group failed; re-forming it from the last checkpoint",
            generation=self.generation,
            error=str(exc)[:300],
        )
        return failures

    def _form(self, state_path: str | None) -> None:
        """Offer generations until one forms: all W ranks joined (a seated rank that never
        comes fails the join after ``timeout_s``, and a new generation is offered)."""
        assert self.rendezvous is not None
        host = self.rendezvous.host
        while True:
            address = f"tcp://{host}:{free_port(host)}"
            self.generation = self.rendezvous.offer(
                address, self.world, self.config.model_dump_json(), state_path, self.timeout_s
            )
            log.info("trainer group offered", generation=self.generation, address=address)
            try:
                _init(0, self.world, address, self.timeout_s)
            except Exception as exc:
                if not group_failure(exc):
                    raise
                log.warning(
                    "trainer group did not form; offering another generation",
                    generation=self.generation,
                    error=str(exc)[:300],
                )
                _destroy()
                continue
            log.info("trainer group formed", generation=self.generation, world=self.world)
            return

    def _reform(self) -> None:
        """A new generation from the last checkpoint, with the batches since replayed."""
        _destroy()
        self.trainer = None  # type: ignore[assignment]  # the old group's model: free it first
        gc.collect()
        base = self._base
        if self._checkpointed:
            found = latest_checkpoint(self.config.checkpoint.dir, _problem)
            base = str(found) if found is not None else None
            self._base, self._checkpointed = base, False
        self._form(base)
        self.reforms += 1
        self.trainer = PolicyTrainer(self.config, 0, self.world)
        if base is not None:
            self.trainer.load_checkpoint(base)
        for batch in self._replay:
            self._train(batch)
        log.info(
            "trainer group re-formed", generation=self.generation, checkpoint=base,
            replayed=len(self._replay),
        )  # fmt: skip


def _destroy() -> None:
    with contextlib.suppress(Exception):  # a broken group may fail to say goodbye
        if dist.is_initialized():
            dist.destroy_process_group()


def _problem(problem: str) -> None:
    log.error("checkpoint", problem=problem)
