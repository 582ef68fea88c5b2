"""The model-free engine verifies a shared weight version without loading torch, in a fresh
interpreter. The engine itself is ``tests/unit/test_sim_engine.py``."""

from __future__ import annotations

SIM_LOAD_SCRIPT = """
import asyncio, sys
from laminar.engines import SimEngineConfig, create_engine
from laminar.engines.base import EngineError
from laminar.transport.shm import SharedBuffer
from laminar.weights.manifest import plan_specs, with_checksums

async def main():
    engine = create_engine(SimEngineConfig())
    await engine.start()
    manifest = plan_specs([("w", "float32", (256,)), ("b", "bfloat16", (3, 5))], 4)
    segment = SharedBuffer(manifest.total_bytes)
    try:
        segment.view[:] = bytes(range(256)) * (manifest.total_bytes // 256) + bytes(
            manifest.total_bytes % 256
        )
        manifest = with_checksums(manifest, segment.view)
        bad = manifest.model_copy(update={"tensors": [
            manifest.tensors[0].model_copy(update={"crc32": manifest.tensors[0].crc32 ^ 1}),
            *manifest.tensors[1:],
        ]})
        try:
            await engine.load_shared(4, segment.name, bad)
        except EngineError as exc:
            print("refused:", exc)
        assert engine.version == 0, engine.version
        assert await engine.load_shared(4, segment.name, manifest) == manifest.digest()
        assert engine.version == 4
    finally:
        segment.close()
        await engine.close()
    print("torch loaded:", "torch" in sys.modules)

asyncio.run(main())
"""


def test_a_sim_engine_verifies_a_shared_version_without_loading_torch() -> None:
    """A sim rollout maps and checks each version's bytes as every backend does (a corrupt one is
    refused, the old weights stay), but it has no model to hand tensors to: building them loaded
    torch into every emulated rollout, 3-4 CPU-s at its first version."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", SIM_LOAD_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "refused: version 4 failed its checksums: ['w']" in done.stdout, done.stdout
    assert "torch loaded: False" in done.stdout, done.stdout
