"""A version in a relay's shared memory, as a reader maps it: read-only, every CRC checked.

Apart from :mod:`.tensors` because nothing here needs torch: the engine interface (and through it
the rollout's contracts, which the manager imports) checks a segment before any backend turns its
bytes into tensors.
"""

from __future__ import annotations

from ..transport.shm import drop_pages, map_segment
from .manifest import WeightManifest, crc_of


class CorruptVersion(ValueError):
    """Bytes that do not match the manifest's CRCs (nothing may be loaded from them)."""

    def __init__(self, version: int, names: list[str]) -> None:
        super().__init__(f"version {version} failed its checksums: {names[:4]}")
        self.names = names


def map_verified(segment: str, manifest: WeightManifest) -> memoryview:
    """Map a relay's ``segment`` read-only and check every tensor's CRC before anyone loads it.

    Raises :class:`~laminar.transport.shm.SegmentGone` when the relay evicted it meanwhile (ask
    for the newest version again) and :class:`CorruptVersion` when the bytes are wrong.
    """
    view = map_segment(segment, 0, manifest.total_bytes)
    bad = []
    for entry in manifest.tensors:
        if crc_of(view, entry) != entry.crc32:
            bad.append(entry.name)
        drop_pages(view, entry.offset, entry.nbytes)  # read once here; the loader reads it again
    if bad:
        raise CorruptVersion(manifest.version, bad)
    return view
