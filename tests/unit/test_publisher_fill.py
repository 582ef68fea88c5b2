"""``WeightPublisher.stage(..., fill=)``: a version staged by writers into a shared segment.

A sharded trainer's ranks each write their own rows into the publisher's buffer by the segment's
name (``roles/trainer/dp.py``); here a writer maps the segment by name the same way, and the
staged version must hold exactly the bytes written, reuse its segment for the next version, and
unlink segments it no longer keeps.
"""

from __future__ import annotations

import os

import torch

from laminar.roles.trainer.publisher import WeightPublisher
from laminar.transport.shm import SHM_DIR, map_writable
from laminar.transport.tcp import TransportOptions
from laminar.weights.config import PublishConfig
from laminar.weights.manifest import WeightManifest
from laminar.weights.tensors import plan_tensors, tensors_from


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(7, 5, generator=g)), ("b", torch.randn(3, generator=g).half())]


def _live(names: set[str]) -> list[str]:
    return [name for name in names if os.path.exists(os.path.join(SHM_DIR, name))]


async def test_a_filled_version_holds_what_the_writers_wrote_in_a_reused_segment() -> None:
    publisher = WeightPublisher(
        PublishConfig(master="tcp://127.0.0.1:1"), TransportOptions(token=b"x" * 32)
    )
    seen: list[str] = []

    def writer(version: int):  # type: ignore[no-untyped-def]
        def fill(manifest: WeightManifest, segment: str, view: memoryview) -> None:
            seen.append(segment)
            mine = map_writable(segment)  # as another rank would: by name, not through `view`
            flat = torch.frombuffer(mine, dtype=torch.uint8)
            for (name, tensor), entry in zip(weights(version), manifest.tensors, strict=True):
                assert name == entry.name
                raw = tensor.contiguous().view(-1).view(torch.uint8)
                flat[entry.offset : entry.offset + entry.nbytes].copy_(raw)

        return fill

    specs = [(n, t.dtype, list(t.shape)) for n, t in weights(0)]
    versions = {}
    for version in (1, 2, 3, 4):
        vb = publisher.stage(version, (), specs=specs, fill=writer(version))
        assert vb.manifest == plan_tensors(weights(version), version)
        staged = dict(tensors_from(vb.manifest, vb.view))
        for name, tensor in weights(version):
            assert torch.equal(staged[name], tensor), (version, name)
        versions[version] = vb
        await publisher.hand_off(vb)  # checksummed: pending (a version staged and not yet
        # handed off is never recycled)
        publisher.acked = version  # the master has it: older ones may be recycled
        publisher._release_unused()
    # two buffers kept for reuse, the rest unlinked: no segment piles up in /dev/shm
    assert len(set(seen)) <= 3, seen
    live = _live(set(seen))
    assert len(live) <= 3 and set(live) <= set(seen)
    # a plain (not shared) stage never takes a shared buffer, and the other way round
    plain = publisher.stage(5, weights(5))
    await publisher.hand_off(plain)
    assert id(plain.view.obj) not in publisher._segments
    for segment in list(publisher._segments.values()):
        segment.close()
