"""Weight switching: follow the local relay's versions and load each newer one between batches.

Why it works this way: a trajectory never mixes versions. When the relay announces a newer
version, the rollout stops taking prompts (``PAUSED_FOR_WEIGHTS``), lets the trajectories in flight
finish on the version they started with (or a repack moves them out), then loads the new version in
place from the relay's shared memory (``LOADING``: the engine maps it; the bytes never cross a
socket) and takes prompts again. The relay is the one on this host, or ``relay`` if set; with no
relay in the cluster, weights never change. The phase rules live in :mod:`.state`; this module
is the I/O around them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from laminar.engines import Engine
from laminar.engines.base import EngineError
from laminar.roles.relay.api import LatestRequest, RelayApi, SharedVersion
from laminar.runtime.context import ServiceContext
from laminar.runtime.errors import STREAM_ERRORS
from laminar.runtime.rpc.client import QUIET_STREAM_TIMEOUT_S

from .api import LoadedWeights
from .changes import Changes
from .flights import FlightTable
from .state import RolloutPhases

LATEST_TIMEOUT_S = 5.0  # asking the local relay for the version to load (see ``switch``)


class WeightSwitcher:
    """Owns the ``weights`` task's loop and the history of loads (the ``weights`` endpoint)."""

    def __init__(
        self,
        ctx: ServiceContext,
        engine: Engine,
        phases: RolloutPhases,
        flights: FlightTable,
        changes: Changes,
        take_lock: asyncio.Lock,
        *,
        relay: str | None,
        retry_s: float,
    ) -> None:
        self.ctx = ctx
        self.engine = engine
        self.phases = phases
        self.flights = flights
        self.changes = changes
        self.take_lock = take_lock
        self.relay_address = relay
        self.retry_s = retry_s
        self.loads: list[LoadedWeights] = []
        self._following: RelayApi | None = None  # the relay whose versions we load
        self._remote_stand_in = False  # following another host's relay: none on this one yet

    async def _relay(self) -> RelayApi | None:
        if self.relay_address is not None:
            return self.ctx.connect(RelayApi, self.relay_address)
        relays = [m for m in await self.ctx.members("relay") if m.state == "alive"]
        local = [m for m in relays if m.host == socket.gethostname()]
        mine = local or relays
        if not mine:
            return None
        # Another host's relay is a stand-in until this host's joins (see ``_on_version``).
        self._remote_stand_in = not local
        return self.ctx.connect(RelayApi, sorted(mine, key=lambda m: m.instance)[0].address)

    def start(self) -> asyncio.Task[None]:
        """Follow the relay's newest version (the ``weights`` task); load each one between
        batches. A failed load counts as the stream failing (it includes a segment the relay
        evicted just before we mapped it): subscribe again, from the version we have."""
        return self.ctx.follow(
            "weights",
            self._subscribe,
            self._on_version,
            backoff=self.retry_s,
            errors=(*STREAM_ERRORS, EngineError),
        )

    async def _subscribe(self) -> AsyncIterator[SharedVersion]:
        # no relay in the cluster (yet): wait quietly, weights do not change without one
        while (relay := await self._relay()) is None:
            await self.ctx.clock.sleep(self.retry_s)
        self._following = relay
        return relay.versions.options(timeout=QUIET_STREAM_TIMEOUT_S).stream(
            LatestRequest(newer_than=self.engine.version)
        )

    async def _on_version(self, shared: SharedVersion) -> None:
        if shared.available and shared.version > self.engine.version:
            if self._remote_stand_in:
                # Started before this host's relay joined: load from it once it has, not across
                # the network for the rest of the run.
                # The stand-in's stream still announces versions until it ends.
                local = await self._relay()
                if local is not None and not self._remote_stand_in:
                    self._following = local
            assert self._following is not None
            await self.switch(self._following)

    async def switch(self, relay: RelayApi) -> None:
        """Drain, then load the relay's newest version (newer ones may have come meanwhile)."""
        clock, phases = self.ctx.clock, self.phases
        noticed = clock.wall()
        phases.newer_version()
        try:
            async with self.take_lock:  # no lease is half-started while we swap
                # a migration under way may hand some back: wait for it too
                await self.changes.until(lambda: phases.may_load(len(self.flights)))
                phases.load(len(self.flights))
                drained = clock.wall()
                # short: the rollout takes no prompts while paused here, and a relay that died
                # since it announced the version is found again by the caller's retry
                shared = await relay.latest.options(timeout=LATEST_TIMEOUT_S).call(
                    LatestRequest(newer_than=self.engine.version)
                )
                if not shared.available or shared.manifest is None:
                    return
                digest = await self.engine.load_shared(
                    shared.version, shared.segment, shared.manifest
                )
        finally:
            phases.switched()
        loaded = clock.wall()
        self.loads.append(
            LoadedWeights(
                version=shared.version,
                digest=digest,
                loaded_at=loaded,
                load_s=loaded - drained,
                drain_s=drained - noticed,
            )
        )
        self.ctx.log.info(
            "weights loaded",
            version=shared.version,
            drain_s=round(drained - noticed, 3),
            load_s=round(loaded - drained, 3),
        )
