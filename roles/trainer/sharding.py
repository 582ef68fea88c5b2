"""FSDP2 for the policy: each rank keeps 1/W of every parameter, gradient and optimizer state.

Why FSDP2 (``torch.distributed.fsdp.fully_shard``) and not a hand-written ZeRO: it is torch's own,
works on gloo (CPU, the suite) and NCCL alike, and its parameters are ``DTensor`` s, so the
optimizer, gradient clipping and state dicts need no special cases beyond the few here.

What sharding changes for the trainer, and where it is handled:

- **Every collective is a rendezvous.** A forward all-gathers each layer's parameters and a
  backward reduce-scatters its gradients, so every rank must run the same number of forwards and
  backwards in the same order, even a rank with no rows left in a step. :func:`lockstep` pads
  each rank's list of micro-batches to the longest; a padding entry runs on one real row with its
  loss mask zeroed, so it contributes exactly nothing (:mod:`.compute`).
- **Sum, not mean.** The loss of every micro-batch is already normalised by the token count of
  the whole mini-batch over all ranks, so the gradients must be *summed* over ranks. FSDP2
  averages by default, and a divide factor of 1 would use ``PREMUL_SUM``, which gloo lacks; so
  reductions are forced to plain sums (:func:`shard_policy`).
- **Gradient accumulation without communication**: gradients are only reduce-scattered on a
  step's last micro-batch (``set_requires_gradient_sync``).
- **Full tensors are collectives too**: reading a parameter whole (to publish or checkpoint it)
  all-gathers it, so every rank takes part, one tensor at a time (:func:`full_tensors`): the rank
  that keeps the result never holds more than one whole parameter beyond its shards.

Checkpoints stay in the replicated trainer's format (an HF model directory and ``optimizer.pt``),
but the optimizer state is keyed by parameter *name*, not by position, so a checkpoint can be
resumed at another world size or sharding (:func:`optimizer_state_by_name`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from laminar.weights.manifest import WeightManifest

from .device import for_training, layer_classes
from .published import entry_dtype, published_dtype, published_state

__all__ = [
    "full",
    "full_tensors",
    "gathered_optimizer_state",
    "load_sharded",
    "load_sharded_optimizer",
    "load_sharded_policy",
    "lockstep",
    "optimizer_state_by_name",
    "optimizer_state_by_position",
    "own_rows",
    "read_slices",
    "row_spans",
    "set_gradient_sync",
    "shard_policy",
    "weight_specs",
]


def load_sharded_policy(
    path: str | Path,
    device: torch.device,
    rank: int,
    world: int,
    *,
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> torch.nn.Module:
    """The policy in ``path`` (an HF directory) sharded over ``world`` ranks, each rank reading
    only its own rows of each tensor from the safetensors files (memory-mapped).

    Why not ``from_pretrained`` and then shard: every rank would first hold the whole model, on
    the host and then on its device, so a model that does not fit one GPU could never be
    sharded. Here the model is built on the meta device (no memory), sharded, and only then
    given storage (``to_empty``): each rank allocates 1/W of every parameter. Non-persistent
    buffers (the rotary tables) hold no checkpoint data and come out of ``to_empty``
    uninitialised, so HF's own ``_init_weights`` recomputes them for the modules that have any.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for_training(model, activation_checkpointing, compile)
    shard_policy(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if module._non_persistent_buffers_set:
                model._init_weights(module)
    read_slices(model, path, rank, world)
    return model


def _rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s rows of a dimension of ``n`` under ``Shard(0)`` (``torch.chunk``'s
    split: ceil(n / W) rows each, the last ranks' possibly fewer or none)."""
    size = -(-n // world)
    return min(n, rank * size), min(n, (rank + 1) * size)


@torch.no_grad()
def read_slices(model: torch.nn.Module, path: str | Path, rank: int, world: int) -> None:
    """Fill a sharded model from an HF directory's safetensors, this rank's rows only."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        single = path / "model.safetensors"
        if not single.exists():
            raise FileNotFoundError(f"{path} has no model.safetensors (sharded loading needs it)")
        with safe_open(single, "pt") as f:
            files = dict.fromkeys(f.keys(), single)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    handles: dict[Path, Any] = {}
    try:
        for name, target in model.state_dict().items():
            if name not in files:
                if name in tied or name.endswith("inv_freq"):
                    continue  # the tied parameter is the one read under its other name
                raise KeyError(f"{name} is not in {path}'s safetensors")
            if files[name] not in handles:
                handles[files[name]] = safe_open(files[name], "pt")
            f = handles[files[name]]
            if isinstance(target, DTensor):
                local = target.to_local()
                start, end = _rows(target.shape[0], rank, world)
                value = f.get_slice(name)[start:end] if end > start else None
                if value is not None:
                    local.copy_(value.to(local.dtype))
            else:
                target.copy_(f.get_tensor(name).to(target.dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def shard_policy(model: torch.nn.Module) -> torch.nn.Module:
    """Shard every decoder layer, then the rest (embeddings, final norm, head) as the root.

    One unit per layer is the usual FSDP granularity: a layer's parameters are gathered just
    before it runs and freed right after, so at most about one layer is ever whole."""
    layers = layer_classes(model)
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a sharded one: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_tensors(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each published tensor whole, on the host, in its published dtype, one at a time (every
    rank must iterate): :mod:`.published`."""
    for name, value in published_state(model):
        whole = full(value.detach())
        yield name, whole.to("cpu", published_dtype(whole.dtype, dtype))


def _spans(
    model: torch.nn.Module, manifest: WeightManifest, rank: int, world: int
) -> Iterator[tuple[torch.Tensor, int, int, torch.dtype]]:
    """(tensor, byte offset, bytes, published dtype) of ``rank``'s part of each published tensor
    in a version buffer laid out by ``manifest``: a ``Shard(0)`` parameter's rows ``[start,
    end)`` are one contiguous byte range of the whole tensor, so the ranks' parts tile the
    buffer. Tensors every rank holds whole (buffers) are rank 0's. ``model`` may be any rank's:
    only shapes are read."""
    entries = {e.name: e for e in manifest.tensors}
    for name, value in published_state(model):
        entry = entries[name]
        dtype = entry_dtype(entry)
        if entry.nbytes == 0:
            continue
        if isinstance(value, DTensor):
            if tuple(value.placements) != (Shard(0),):
                raise ValueError(f"{name} is sharded as {value.placements}, not by rows")
            start, end = _rows(value.shape[0], rank, world)
            row = entry.nbytes // value.shape[0]
            if end > start:
                yield value, entry.offset + start * row, (end - start) * row, dtype
        elif rank == 0:
            yield value, entry.offset, entry.nbytes, dtype


def own_rows(
    model: torch.nn.Module, manifest: WeightManifest, rank: int, world: int
) -> list[tuple[int, torch.Tensor, torch.dtype]]:
    """This rank's rows of every tensor at their byte offsets, with their published dtype (a
    :data:`.staging.CopyPlan`): written by every rank, they make the whole version with nothing
    gathered. References only: the bytes move when the plan is copied."""
    return [
        (offset, (value.to_local() if isinstance(value, DTensor) else value).detach(), dtype)
        for value, offset, _, dtype in _spans(model, manifest, rank, world)
    ]


def row_spans(
    model: torch.nn.Module, manifest: WeightManifest, rank: int, world: int
) -> list[tuple[int, int]]:
    """Where ``rank``'s rows go (byte offset, bytes), in the order that rank's :func:`own_rows`
    lists them: what rank 0 receives from a rank on another host."""
    return [(offset, size) for _, offset, size, _ in _spans(model, manifest, rank, world)]


def weight_specs(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> list[tuple[str, torch.dtype, list[int]]]:
    """Name, dtype and whole shape of each tensor :func:`full_tensors` yields, gathering nothing."""
    return [(k, published_dtype(v.dtype, dtype), list(v.shape)) for k, v in published_state(model)]


def lockstep(per_rank: list[list[list[int]]]) -> int:
    """How many micro-batches every rank runs in a step: the most any rank has (pad to it)."""
    return max((len(micro) for micro in per_rank), default=0)


def optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A positional ``optimizer.state_dict()`` (parameters numbered in ``parameters()`` order)
    keyed by parameter name instead; a state already keyed by name is returned as it is."""
    if all(isinstance(k, str) for k in state.get("state", {})) and all(
        isinstance(p, str) for g in state.get("param_groups", []) for p in g["params"]
    ):
        return state
    return {
        "state": {names[int(i)]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def optimizer_state_by_position(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_name`: what ``optimizer.load_state_dict`` of an
    unsharded optimizer takes; a positional state is returned as it is."""
    index = {name: i for i, name in enumerate(names)}
    if not any(isinstance(p, str) for g in state.get("param_groups", []) for p in g["params"]):
        return state
    return {
        "state": {index[k]: v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [index[p] for p in g["params"]]} for g in state["param_groups"]
        ],
    }


def gathered_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The whole optimizer state keyed by parameter name, on rank 0's host (empty elsewhere).
    A collective: every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


@torch.no_grad()
def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
) -> None:
    """Load whole (unsharded) state dicts, which every rank read from the checkpoint, into the
    sharded model and optimizer: each rank keeps its own slice."""
    for name, target in model.state_dict().items():
        value = model_state[name].to(dtype=target.dtype)
        if isinstance(target, DTensor):
            # every rank read the same whole tensor: each cuts its own slice, nothing is sent
            value = distribute_tensor(
                value.to(target.device), target.device_mesh, target.placements, src_data_rank=None
            )
            target.to_local().copy_(value.to_local())
        else:
            target.copy_(value)
    load_sharded_optimizer(model, optimizer, optim_state)


def load_sharded_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, optim_state: dict[str, Any]
) -> None:
    """Load a whole optimizer state (by name or by position) into a sharded optimizer."""
    names = [n for n, _ in model.named_parameters()]
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(
        model, optimizer, optimizer_state_by_name(optim_state, names), options=options
    )
    if dist.is_initialized():
        dist.barrier()
