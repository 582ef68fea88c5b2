"""Named torch tensors <-> a version's flat buffer, by the manifest. No copies on the way out.

Torch is imported here and nowhere else on the weight path: the trainer (through the publisher)
and the engines that load tensors use this module, the control plane never does (which is why the
segment check lives in :mod:`.shared`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

import torch

from ..transport.shm import drop_pages
from .manifest import WeightManifest, layout
from .shared import CorruptVersion, map_verified

__all__ = [
    "CorruptVersion",
    "copy_into",
    "map_verified",
    "plan_tensors",
    "tensors_from",
]


def plan_tensors(named: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightManifest:
    """The layout for ``named`` (checksums not yet filled in)."""
    return layout(
        (
            (name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size())
            for name, t in named
        ),
        version,
    )


def copy_into(
    named: Iterable[tuple[str, torch.Tensor]], manifest: WeightManifest, buffer: memoryview
) -> None:
    """Copy each tensor into its place in ``buffer`` (the trainer's one copy)."""
    flat = torch.frombuffer(buffer, dtype=torch.uint8) if buffer.nbytes else None
    for (name, tensor), entry in zip(named, manifest.tensors, strict=True):
        if name != entry.name:
            raise ValueError(f"tensor order changed: {name} where the manifest has {entry.name}")
        if entry.nbytes == 0 or flat is None:
            continue
        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[entry.offset : entry.offset + entry.nbytes].copy_(src)


def tensors_from(
    manifest: WeightManifest, buffer: memoryview, *, release: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` as named tensors (read-only buffers are fine: loaders only read).

    ``release``: ``buffer`` maps a segment read once (a relay's version, loaded by an engine):
    each tensor's pages leave this process's resident set once the next one is asked for
    (:func:`~laminar.transport.shm.drop_pages`; a loader that still reads it faults them back)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about non-writable buffers
        for entry in manifest.tensors:
            dtype = getattr(torch, entry.dtype)
            if entry.nbytes == 0:
                yield entry.name, torch.empty(entry.shape, dtype=dtype)
                continue
            raw = buffer[entry.offset : entry.offset + entry.nbytes]
            yield entry.name, torch.frombuffer(raw, dtype=dtype).reshape(entry.shape)
            if release:
                drop_pages(buffer, entry.offset, entry.nbytes)
