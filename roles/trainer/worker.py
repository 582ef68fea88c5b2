"""Ranks 1..W-1 of a trainer group: follow rank 0's ops until it says stop (:mod:`.dp`).

A rank holds its share of the policy and does what rank 0's header says (:class:`.wire.Op`):
train on the batch that follows, take part in a gather, write its rows of a version into rank 0's
shared buffer (one host) or send them to rank 0 (other hosts), evaluate.
It talks to nothing but its group; a spawned rank and a ``trainer_rank`` service (:mod:`.rank`)
run this same loop.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future

import torch
import torch.distributed as dist

from laminar.recipe.episodes import EvalStopped
from laminar.transport.shm import map_writable
from laminar.weights.manifest import WeightManifest, plan_specs

from .compute import PolicyTrainer
from .config import TrainerConfig
from .evaluator import Evaluator
from .sharding import own_rows
from .wire import (
    GroupStop,
    Op,
    broadcast_batch,
    broadcast_name,
    broadcast_op,
    init_group,
    staging_group,
    threads_for,
)


def write_rows(
    trainer: PolicyTrainer, total: int, name: str | None, view: memoryview | None
) -> Future[None]:
    """Every rank: copy its own rows of the weights into rank 0's staging segment ``name``
    (rank 0 passes the name and its mapping, the others None: they get both from the
    broadcast). The copy runs in the background (:mod:`.staging`) and ends with a barrier on
    the staging group, so rank 0's future is done when every rank's rows are in."""
    name = broadcast_name(name)
    manifest = _layout(trainer, total)
    if view is None:
        view = map_writable(name)
    group = staging_group()
    return trainer.copy_out(manifest, view, then=lambda: dist.barrier(group=group))


def send_rows(trainer: PolicyTrainer, total: int) -> Future[None]:
    """Ranks 1..W-1 of a group spread over hosts: send this rank's rows of the weights to rank 0
    on the staging group, in the background, one tensor's rows at a time (rank 0 receives them
    straight into its buffer: :meth:`.dp.DataParallelGroup.copy_out`)."""
    manifest = _layout(trainer, total)
    plan = own_rows(trainer.model, manifest, trainer.rank, trainer.world)
    group = staging_group()

    def send() -> None:
        for _, rows, dtype in plan:
            sent = rows.to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8)
            dist.send(sent, 0, group=group)

    return trainer.fence.start(send, trainer.device)


def _layout(trainer: PolicyTrainer, total: int) -> WeightManifest:
    """The version's layout as rank 0 planned it (the same specs give the same plan)."""
    manifest = plan_specs(trainer.weight_specs(), 0)
    if manifest.total_bytes != total:
        mine = manifest.total_bytes
        raise RuntimeError(f"rank {trainer.rank} plans {mine} bytes for a version, rank 0 {total}")
    return manifest


def serve_rank(
    rank: int,
    config_json: str,
    address: str,
    state_path: str | None,
    timeout_s: float,
    threads: int | None = None,
) -> None:
    """Join the group at ``address`` as ``rank`` and follow rank 0 until it stops the group;
    a failed collective (a peer died) raises. ``threads``: torch's threads here (default:
    :func:`.wire.threads_for` this process)."""
    config = TrainerConfig.model_validate_json(config_json)
    torch.set_num_threads(threads if threads is not None else threads_for(config))
    init_group(rank, config.data_parallel, address, timeout_s)
    trainer = PolicyTrainer(config, rank, config.data_parallel)
    if state_path is not None:
        trainer.load_checkpoint(state_path)
    evaluator = Evaluator(config.eval, config.model) if config.eval is not None else None
    try:
        while (header := broadcast_op())[0] != Op.STOP:
            op, a, b = header
            if op == Op.TRAIN:
                trainer.train(broadcast_batch(None, (a, b)))
            elif op == Op.WEIGHTS:  # rank 0 keeps them; this rank takes part in each gather
                for _ in trainer.weights():
                    pass
            elif op == Op.STATE:
                trainer.training_state()
            elif op == Op.SLICES:
                write_rows(trainer, a, None, None)
            elif op == Op.ROWS:
                send_rows(trainer, a)
            elif op == Op.EVAL and evaluator is not None:
                # rank 0's trainer may be told to stop half-way: then every rank gives up
                with contextlib.suppress(EvalStopped):
                    evaluator(trainer.model, a, synced=True, stop=GroupStop(a))
    except BaseException:
        trainer.fence.abandon()  # a served rank goes on to the next generation: no stray thread
        raise
    trainer.close()  # rank 0 waited for its copies before STOP: so did every barrier
    dist.destroy_process_group()
