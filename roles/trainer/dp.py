"""Data parallelism: rank 0 lives in the trainer service, ranks 1..W-1 in other processes.

Rank 0 owns everything that talks to the cluster (data, relays, checkpoints); the other ranks only
compute. Each global batch goes from rank 0 to the others with ``torch.distributed.broadcast``
(a command header, then the batch's five tensors), the same collective library that all-reduces
the gradients: gloo on CPU, NCCL where CUDA is available. No pickle crosses a process boundary.

Where the other ranks run (``ranks``):

- ``spawn`` (the default): ``multiprocessing`` children of the trainer, on its host, meeting at a
  file (:func:`.wire.local_rendezvous`; forked from a server that imported their code once:
  :func:`rank_processes`). A rank that dies takes the group down (its peers' next collective
  fails, at once for a closed socket, else after ``timeout_s``); the trainer then exits and is
  restarted from its last checkpoint, which is the recovery story for trainer failures anyway.
- ``serve``: each rank is its own ``laminar serve --role trainer_rank`` process, on any host
  (:mod:`.rank`). Rank 0 offers each *generation* of the group through the manager: a free port
  on its own bind host, the world size, its config and the checkpoint to start from
  (:mod:`laminar.roles.manager.api`); the rank processes take seats 1..W-1 and join. When a
  collective
  fails (a rank died), rank 0 does not exit: it tears the group down, offers a new generation,
  waits until all W ranks have joined it (the dead one restarted by its supervisor), and every
  rank loads the last checkpoint; rank 0 then replays the batches it trained on since that
  checkpoint (it keeps them, a few token tensors) and retries the failed operation, so the group
  is exactly where it was and the trainer's loop never notices beyond the wait. Rank 0 dying is
  the trainer's restart as in ``spawn`` mode; its ranks' collectives fail and they take seats in
  the generation the restarted trainer offers. Nothing outside the trainer waits on its group:
  rollouts keep generating throughout.

Sharded (``sharding: fsdp``, :mod:`.sharding`), reading the weights is a collective too, so rank
0 tells the others what comes next in one header (:mod:`.wire`): train on a batch, write your
rows of a version into a shared-memory buffer (a publish, ranks on one host) or send them to rank
0 (a publish, ranks on other hosts), gather the weights whole (one tensor at a time), gather the
training state for a checkpoint, evaluate (every rank generates the same prompts), or stop.
Replicated, rank 0 does all but training alone. Ranks 1..W-1 run :func:`.worker.serve_rank`.

A publish does not hold training (:mod:`.staging`): its copy runs in the background on every
rank that takes part, over the group's second (staging) process group where ranks talk, and each
rank's next optimizer step waits for its own part.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist

from laminar.rl import PackedBatch
from laminar.weights.manifest import WeightManifest

from .checkpoint import latest_checkpoint
from .compute import PolicyTrainer, StepResult
from .config import TrainerConfig
from .evaluator import Evaluator
from .rendezvous import GroupRendezvous, free_port, group_failure
from .sharding import own_rows, row_spans
from .staging import copy_plan
from .wire import (
    GroupStop,
    Op,
    broadcast_batch,
    broadcast_op,
    init_group,
    local_rendezvous,
    ranks_mode,
    staging_group,
    threads_for,
)
from .worker import serve_rank, write_rows

T = TypeVar("T")
log = structlog.get_logger("trainer")

#: Failures in a row, each right after the group re-formed, before rank 0 gives up (the trainer
#: exits and is restarted): a failure that follows every re-form is not a rank that died.
MAX_REFORMS = 3


def rank_processes() -> ForkServerContext:
    """How rank 0 starts ranks 1..W-1 on its own host: ``forkserver``, its server having
    imported the ranks' code.

    A rank is never a fork of the trainer itself (its threads, and a CUDA context on a GPU, do
    not survive a fork). ``spawn`` gives each rank a fresh interpreter, which imports torch and
    transformers again: seconds of CPU per rank. The forkserver is one fresh interpreter that
    imports :mod:`.worker` once (one thread after it, no device touched) and forks every rank
    from that state, so ranks after the first start in a fraction of a second
    (docs/benchmarks.md, *Forming a trainer group*): what an 8-GPU host's seven ranks, or a
    trainer that forms groups again and again, would otherwise pay each time. The server lives
    as long as this process, in its process group (it ends with the trainer's group, like the
    ranks).

    Its ranks inherit the server's environment (this process's when the server started), not
    this process's at fork time; what a rank needs from here travels in its arguments (its
    threads: :func:`.wire.threads_for` of this process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([serve_rank.__module__])
    return ctx


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
        # sharded publishes: ranks on one host write into a shared segment; served ranks may be
        # on other hosts, and send their rows to rank 0 instead (:meth:`copy_out`)
        self.rows_by_segment = not self.served
        self.rendezvous = rendezvous
        self.generation = 0  # served: the group's generation (the manager's number)
        self.reforms = 0  # served: how often the group was re-formed after a failure
        # served: what a re-formed group starts from (the last checkpoint) and the batches
        # trained on since, replayed on top of it (see the module docstring)
        self._base = state_path
        self._checkpointed = False  # a checkpoint was gathered since: the newest on disk
        self._replay: list[PackedBatch] = []
        self._rendezvous_dir: Path | None = None  # local ranks: where they met (wire.py)
        torch.set_num_threads(threads_for(config))
        if self.served:
            if rendezvous is None:
                raise ValueError(
                    "trainer.ranks is serve: rank 0 needs the manager's rendezvous "
                    "(roles/trainer/rendezvous.py), which only a trainer service has"
                )
            self._form(state_path)
        elif self.world > 1:
            address, self._rendezvous_dir = local_rendezvous()  # removed at close
            try:
                ctx, blob = rank_processes(), config.model_dump_json()
                threads = threads_for(config)
                for rank in range(1, self.world):
                    proc = ctx.Process(
                        target=serve_rank,
                        args=(rank, blob, address, state_path, timeout_s, threads),
                        daemon=True,
                        name=f"trainer-rank{rank}",
                    )
                    proc.start()
                    self.procs.append(proc)
                init_group(0, self.world, address, timeout_s)
            except BaseException:  # no group: the caller has nothing to close, so undo it here
                self._end_local_ranks()
                raise
        self.trainer = PolicyTrainer(config, 0, self.world)
        if state_path is not None:
            self.trainer.load_checkpoint(state_path)

    def _tell(self, op: int, *arg: int) -> None:
        """Sharded: have the other ranks join rank 0's next collective read (see the module)."""
        if self.trainer.sharded:
            broadcast_op(op, *arg)

    def _train(self, batch: PackedBatch) -> StepResult:
        if self.world > 1:
            broadcast_op(Op.TRAIN, *batch.input_ids.shape)
            rows, width = batch.input_ids.shape
            broadcast_batch(batch, (rows, width))
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
    def needs_segment(self) -> bool:
        """Whether :meth:`copy_out` needs a shared-memory buffer: sharded, with every rank on
        this host, each writes its own rows into it by name."""
        return self.trainer.sharded and self.rows_by_segment

    def copy_out(
        self, manifest: WeightManifest, segment: str | None, view: memoryview
    ) -> Future[None]:
        """Start copying the weights into ``view`` (laid out by ``manifest``); the future is
        done when all of it is in, and training goes on meanwhile: each rank's next optimizer
        step waits for its own part (:mod:`.staging`). Replicated, rank 0 copies its weights.
        Sharded, nothing is gathered: with every rank on this host each writes its own rows
        into shared-memory ``segment`` (:attr:`needs_segment`); with ranks on other hosts each
        sends its rows to rank 0 on the staging group, received straight into ``view``."""
        trainer = self.trainer
        if not trainer.sharded:
            return trainer.copy_out(manifest, view)
        if self.rows_by_segment:
            if segment is None:
                raise ValueError("ranks on one host write through a shared-memory segment")
            self._tell(Op.SLICES, manifest.total_bytes)
            return write_rows(trainer, manifest.total_bytes, segment, view)
        return self._recovering(lambda: self._receive_rows(manifest, view))

    def _receive_rows(self, manifest: WeightManifest, view: memoryview) -> Future[None]:
        self._tell(Op.ROWS, manifest.total_bytes)
        trainer, group = self.trainer, staging_group()
        mine = own_rows(trainer.model, manifest, 0, self.world)
        spans = [
            (r, row_spans(trainer.model, manifest, r, self.world)) for r in range(1, self.world)
        ]

        def receive() -> None:
            copy_plan(mine, view)
            flat = torch.frombuffer(view, dtype=torch.uint8)
            for rank, rows in spans:
                for offset, size in rows:
                    dist.recv(flat[offset : offset + size], rank, group=group)

        return trainer.fence.start(receive, trainer.device)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights whole, one tensor at a time (sharded: one gather each, on every rank)."""
        if self.served:
            return self._served_weights()
        self._tell(Op.WEIGHTS)
        return self.trainer.weights()

    def _served_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`weights`, going on after a re-form from the first tensor not yet yielded (the
        re-formed group holds the same weights: the module docstring)."""
        done, failures = 0, 0
        while True:
            try:
                if failures:
                    self._reform()
                self._tell(Op.WEIGHTS)
                for i, item in enumerate(self.trainer.weights()):
                    if i >= done:
                        yield item
                        done += 1
                return
            except Exception as exc:
                failures = self._failed(exc, failures)

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        def gather() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            self._tell(Op.STATE)
            return self.trainer.training_state()

        state = self._recovering(gather)
        if self.served:  # gathered for a checkpoint: a re-formed group starts from that one
            self._checkpointed = True
            self._replay.clear()
        return state

    def evaluate(
        self, evaluator: Evaluator, version: int, stop: Callable[[], bool] | None = None
    ) -> Any:
        """``stop``: asked at every decoding step; true gives up with ``EvalStopped``. Sharded,
        every rank generates in step with this one, so the stop reaches them through the group
        (:class:`.wire.GroupStop`) and all of them give up after the same ``generate`` call;
        otherwise rank 0 evaluates alone."""

        def run() -> Any:
            self._tell(Op.EVAL, version)
            sharded = self.trainer.sharded
            # every rank asks a GroupStop between generate calls: rank 0's too, told or not
            told = GroupStop(version, stop) if sharded else stop
            return evaluator(self.trainer.model, version, synced=sharded, stop=told)

        return self._recovering(run)

    def close(self) -> None:
        if self.trainer is not None:  # None: a re-form that failed half-way
            self.trainer.close()  # copies under way finish first: the other ranks' too
        if self.world > 1 and dist.is_initialized():
            try:
                broadcast_op(Op.STOP)
                dist.destroy_process_group()
            except Exception:
                pass
        self._end_local_ranks(join_s=10.0)

    def _end_local_ranks(self, join_s: float = 0.0) -> None:
        """The rank processes gone (given ``join_s`` to stop by themselves, then killed), and the
        directory where they met removed."""
        for proc in self.procs:
            proc.join(timeout=join_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self.procs.clear()
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None

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
                init_group(0, self.world, address, self.timeout_s)
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
        with contextlib.suppress(Exception):  # a copy on the broken group fails: wait for that
            self.trainer.close()
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
