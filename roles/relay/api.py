"""The relay role's contract: what local rollouts ask of it, and what it reports.

Declaration only, and torch-free: rollouts, the manager and tools import it; ``RelayService``
(:mod:`.service`) serves it. How the relay tier moves weights is in ``docs/training.md``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel

from laminar.runtime.endpoint import endpoint, stream
from laminar.runtime.stats import VersionedStats
from laminar.weights.manifest import WeightManifest


class SharedVersion(BaseModel):
    """Where a local rollout maps a version from (``available`` false: none yet)."""

    available: bool
    version: int = -1
    segment: str = ""
    manifest: WeightManifest | None = None


class LatestRequest(BaseModel):
    newer_than: int = -1


class VersionState(BaseModel):
    version: int
    chunks: int
    received: int
    verified: bool


class RelayStatus(BaseModel):
    instance: str
    weights: str
    chain_epoch: int
    chain_applied_at: float  # wall clock when this relay acted on the newest chain view
    position: int | None
    downstream: str | None
    versions: list[VersionState]
    forwarded: dict[int, float]  # version -> wall clock when the downstream verified it
    received_at: dict[int, float]  # version -> wall clock when it was verified here


class RelayApi:
    @endpoint
    async def latest(self, req: LatestRequest) -> SharedVersion:
        raise NotImplementedError

    @stream
    async def versions(self, req: LatestRequest) -> AsyncIterator[SharedVersion]:
        raise NotImplementedError
        yield  # pragma: no cover

    @endpoint
    async def status(self) -> RelayStatus:
        raise NotImplementedError


class RelayStats(VersionedStats):
    """``RelayService.stats``: the newest version it holds (-1: none) and its chain place."""

    version: int = -1
    chain_epoch: int = 0
    chain_position: int = -1  # -1: not in the chain
