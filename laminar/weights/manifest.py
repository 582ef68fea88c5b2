"""What a weight version is on the wire: one flat byte buffer plus a manifest that describes it.

A version is laid out once, by the trainer, as a single contiguous buffer: every tensor at an
aligned offset. Everything downstream (master relay, the chain, a rollout mapping the relay's
shared memory) handles that one buffer and this manifest, never a dict of tensors: so a relay
knows nothing about models, a chunk is just a byte range, and "did it arrive intact" is a
checksum per tensor.

Checksums are CRC-32 (``zlib.crc32``: fast, and it releases the GIL): they detect
corruption and bugs (a wrong offset, a truncated chunk, a stale segment), not an adversary; every
link is already authenticated with the cluster token.

The planning helpers are pure (no I/O), in the checkpoint-engine habit of plan-then-execute: the
layout, the chunk boundaries and the paper's optimal chunk count are computed here and unit-tested,
and the transfer code only executes a plan.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

ALIGN = 64  # every tensor starts on a cache line (and any dtype's alignment)


class TensorEntry(BaseModel):
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: list[int]
    offset: Annotated[int, Field(ge=0)]
    nbytes: Annotated[int, Field(ge=0)]
    crc32: int = 0


class WeightManifest(BaseModel):
    """One version: its number and where each tensor lies in the version's flat buffer."""

    version: Annotated[int, Field(ge=0)]
    total_bytes: Annotated[int, Field(ge=0)]
    tensors: list[TensorEntry]

    @model_validator(mode="after")
    def _inside(self) -> WeightManifest:
        for t in self.tensors:
            if t.offset + t.nbytes > self.total_bytes:
                raise ValueError(f"tensor {t.name} ends past the buffer ({self.total_bytes} B)")
        return self

    def digest(self) -> str:
        """One short string for the whole version: the CRCs of all tensors, in order."""
        crc = 0
        for t in self.tensors:
            crc = zlib.crc32(t.name.encode(), crc)
            crc = zlib.crc32(t.crc32.to_bytes(4, "little"), crc)
        return f"{self.version}:{crc:08x}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(tensors: Iterable[tuple[str, str, Sequence[int], int]], version: int) -> WeightManifest:
    """Place ``(name, dtype, shape, nbytes)`` tensors one after another at aligned offsets."""
    entries, offset = [], 0
    for name, dtype, shape, nbytes in tensors:
        offset = _align(offset)
        entries.append(
            TensorEntry(name=name, dtype=dtype, shape=list(shape), offset=offset, nbytes=nbytes)
        )
        offset += nbytes
    return WeightManifest(version=version, total_bytes=offset, tensors=entries)


#: bytes per element of the dtypes a spec may name as text (torch's names, ``torch.`` left off)
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
}  # fmt: skip


def plan_specs(specs: Iterable[tuple[str, Any, Sequence[int]]], version: int) -> WeightManifest:
    """The layout for tensors described by (name, dtype, shape), none of them needed yet.
    ``dtype`` is a ``torch.dtype`` or its name (``"bfloat16"``): planning needs no torch, so the
    emulated trainer publishes without importing it."""

    def entry(name: str, dtype: Any, shape: Sequence[int]) -> tuple[str, str, list[int], int]:
        named = str(dtype).removeprefix("torch.")
        if not isinstance(dtype, str):
            itemsize = dtype.itemsize
        elif named in ITEMSIZE:
            itemsize = ITEMSIZE[named]
        else:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}; known: {sorted(ITEMSIZE)}")
        return name, named, list(shape), math.prod(shape) * itemsize

    return layout((entry(*spec) for spec in specs), version)


def crc_of(buffer: memoryview, entry: TensorEntry) -> int:
    return zlib.crc32(buffer[entry.offset : entry.offset + entry.nbytes])


def with_checksums(manifest: WeightManifest, buffer: memoryview) -> WeightManifest:
    """The manifest with every tensor's CRC computed from ``buffer`` (the trainer does this)."""
    tensors = [t.model_copy(update={"crc32": crc_of(buffer, t)}) for t in manifest.tensors]
    return manifest.model_copy(update={"tensors": tensors})


def verify(manifest: WeightManifest, buffer: memoryview) -> list[str]:
    """Names of the tensors whose bytes in ``buffer`` do not match the manifest (empty: intact)."""
    if buffer.nbytes < manifest.total_bytes:
        return [t.name for t in manifest.tensors]
    return [t.name for t in manifest.tensors if crc_of(buffer, t) != t.crc32]


# -- chunking -----------------------------------------------------------------------------------


def optimal_chunks(
    relays: int,
    total_bytes: int,
    seconds_per_byte: float,
    start_s: float,
    *,
    lo: int = 1,
    hi: int = 4096,
) -> int:
    """The paper's k* = sqrt((p-2)·M·T_byte / T_start) for a chain of ``relays`` = p nodes.

    ``T(p, k) = (p + k - 2)·(M/k·T_byte + T_start)``: more chunks overlap more hops but pay the
    per-message start cost more often. With p <= 2 there is nothing to overlap and one chunk is
    best; the result is clamped to ``[lo, hi]`` (a chunk per frame keeps frames bounded too).
    """
    if relays <= 2 or total_bytes <= 0:
        return max(lo, 1)
    k = math.sqrt((relays - 2) * total_bytes * seconds_per_byte / start_s)
    return int(min(max(round(k), lo), hi))


def chain_time(
    relays: int, total_bytes: int, chunks: int, seconds_per_byte: float, start_s: float
) -> float:
    """The model's broadcast time T(p, k) (for docs and the benchmark's sanity print)."""
    per_chunk = total_bytes / chunks * seconds_per_byte + start_s
    return (max(relays, 2) + chunks - 2) * per_chunk


def chunk_bounds(total_bytes: int, chunks: int, *, max_chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of each chunk: ``chunks`` near-equal ranges, none over the frame cap.

    Boundaries are multiples of ALIGN so a chunk never splits a cache line between frames.
    """
    if total_bytes == 0:
        return []
    chunks = max(chunks, math.ceil(total_bytes / max_chunk_bytes), 1)
    step = _align(math.ceil(total_bytes / chunks))
    return [(off, min(step, total_bytes - off)) for off in range(0, total_bytes, step)]
