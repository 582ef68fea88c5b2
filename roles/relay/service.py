"""The relay role: newest weight versions in host shared memory, one relay per rollout machine.

Three owned tasks and a listener:

* **weights listener** (``tcp://`` or ``ucx://``): accepts a version from upstream (the trainer,
  when this relay is master; otherwise the previous relay) chunk by chunk, straight into a shared
  memory segment (``laminar.weights.transfer``). Each version is verified against its manifest's
  CRCs before anyone is told about it.
* **chain** follows the manager's relay chain; when this relay's downstream changes (a relay died,
  one joined) it restarts the forwarder towards the new one at once.
* **forward** sends the newest version, in any state, to the downstream relay: chunk i goes on as
  soon as it has arrived here, so the whole chain moves at the pace of one link. A downstream
  that already holds a prefix answers ``have`` and the transfer resumes there.

Local rollouts ask ``latest`` (or follow ``versions``) and get the version's segment name and
manifest; they map the segment themselves, so the bytes never cross a socket on the host. At
most ``keep`` versions are held, the one arriving included (the newest verified one always stays);
an older segment is unlinked, which does not disturb a rollout that already mapped it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, ClassVar

from pydantic import Field

from laminar import transport
from laminar.roles.manager.api import ChainFollower, ChainView, RelayInfo
from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.endpoint import endpoint, stream
from laminar.runtime.service import Service
from laminar.transport.shm import sweep_dead_segments
from laminar.weights.transfer import (
    TransferError,
    VersionBuffer,
    VersionStore,
    push_version,
    receive_versions,
)

from .api import LatestRequest, RelayApi, RelayStatus, SharedVersion, VersionState


def default_weights_scheme() -> str:
    """UCX where ``ucxx`` imports, TCP otherwise (asked of the transport, which sets UCX's
    environment before libucx loads)."""
    from laminar.transport.ucx import available

    return "ucx" if available() else "tcp"


class RelayConfig(ServiceConfig):
    weights_bind: str = Field(
        "auto",
        description="Where weight transfers arrive: tcp://host:port, ucx://host:port, or auto "
        "(ucx:// if ucxx is importable, else tcp://, on weights_host with a free port).",
    )
    weights_host: str = Field("127.0.0.1", description="Host for weights_bind=auto.")
    keep: Annotated[int, Field(ge=1)] = Field(
        2,
        description="Versions held in memory, counting one being received (the newest verified "
        "one always stays, so keep 1 holds two during a transfer): a relay needs about keep x "
        "one version's bytes.",
    )
    transfer_timeout_s: Annotated[float, Field(gt=0)] = Field(
        120.0, description="Timeout of one version's push to the next relay in the chain."
    )
    retry_s: Annotated[float, Field(gt=0)] = Field(
        0.2, description="Pause before retrying a failed forward or chain watch."
    )


class RelayService(Service, RelayApi):
    role: ClassVar[str] = "relay"
    config_model: ClassVar[type[ServiceConfig]] = RelayConfig
    config: RelayConfig

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.store = VersionStore(self.config.keep, shared=True)
        self.listener: transport.Listener | None = None
        self.view = ChainView()
        self.chain_applied_at = 0.0
        self.downstream: RelayInfo | None = None
        self._forwarder: asyncio.Task[None] | None = None
        self.forwarded: dict[int, float] = {}
        self.received_at: dict[int, float] = {}

    async def on_start(self) -> None:
        swept = sweep_dead_segments()
        if swept:
            self.log.info("removed shared memory of dead processes", segments=len(swept))
        bind = self.config.weights_bind
        if bind == "auto":
            bind = f"{default_weights_scheme()}://{self.config.weights_host}:0"
        options = self.ctx.options.with_allocator(self.store.allocator)
        self.listener = await transport.listen(bind, options, self._upstream)
        self.log.info("weights listener", address=self.listener.address)
        if self.ctx.manager is not None:
            chain = ChainFollower(self.ctx.client(self.ctx.manager), self._apply)
            self.ctx.follow("chain", chain.subscribe, chain.apply, backoff=self.config.retry_s)

    async def on_stop(self) -> None:
        # the chain follower and the forwarder have ended (the host ends our tasks first)
        if self.listener is not None:
            await self.listener.close()
        self.store.close()

    def advertise(self) -> dict[str, str]:
        assert self.listener is not None
        return {"weights": self.listener.address}

    def stats(self) -> dict[str, float]:
        latest = self.store.latest()
        pos = self.view.position(self.ctx.instance)
        return {
            "version": float(latest.version if latest else -1),
            "chain_epoch": float(self.view.epoch),
            "chain_position": float(-1 if pos is None else pos),
        }

    # -- endpoints ---------------------------------------------------------------------------

    @endpoint
    async def latest(self, req: LatestRequest) -> SharedVersion:
        return self._shared(self.store.latest(), req.newer_than)

    @stream
    async def versions(self, req: LatestRequest) -> AsyncIterator[SharedVersion]:
        seen = req.newer_than
        while True:
            vb = self.store.latest()
            if vb is not None and vb.version > seen:
                seen = vb.version
                yield self._shared(vb, -1)
            else:  # no await between the look and the wait, so no change can slip in between
                await self.store.wait_changed()

    @endpoint
    async def status(self) -> RelayStatus:
        assert self.listener is not None
        return RelayStatus(
            instance=self.ctx.instance,
            weights=self.listener.address,
            chain_epoch=self.view.epoch,
            chain_applied_at=self.chain_applied_at,
            position=self.view.position(self.ctx.instance),
            downstream=self.downstream.instance if self.downstream else None,
            versions=[
                VersionState(
                    version=v.version,
                    chunks=len(v.chunks),
                    received=v.received,
                    verified=v.verified,
                )
                for v in sorted(self.store.versions.values(), key=lambda v: v.version)
            ],
            forwarded=self.forwarded,
            received_at=self.received_at,
        )

    @staticmethod
    def _shared(vb: VersionBuffer | None, newer_than: int) -> SharedVersion:
        if vb is None or vb.version <= newer_than or vb.segment is None:
            return SharedVersion(available=False)
        return SharedVersion(
            available=True, version=vb.version, segment=vb.segment, manifest=vb.manifest
        )

    # -- upstream: versions arrive -------------------------------------------------------------

    async def _upstream(self, conn: transport.Connection) -> None:
        self.log.info("upstream connected", peer=conn.peer)
        try:
            await receive_versions(
                conn, self.store, self._verified, executor=self.ctx.executor("relay-verify")
            )
        except (transport.TransportError, TransferError, TimeoutError) as exc:
            self.log.info("upstream gone", peer=conn.peer, reason=str(exc))

    def _verified(self, vb: VersionBuffer) -> None:
        self.received_at[vb.version] = self.ctx.clock.wall()
        self.log.info("version verified", version=vb.version, bytes=vb.manifest.total_bytes)

    # -- the chain and the downstream ----------------------------------------------------------

    def _apply(self, view: ChainView) -> None:
        self.view = view
        downstream = view.downstream_of(self.ctx.instance)
        if downstream != self.downstream or self._forwarder is None:
            if self._forwarder is not None:
                self._forwarder.cancel()
                self._forwarder = None
            self.downstream = downstream
            if downstream is not None:
                self._forwarder = self.spawn(self._forward(downstream), name="forward")
        self.chain_applied_at = self.ctx.clock.wall()
        self.log.info(
            "chain applied",
            epoch=view.epoch,
            position=view.position(self.ctx.instance),
            downstream=downstream.instance if downstream else None,
        )

    async def _forward(self, target: RelayInfo) -> None:
        """Keep ``target`` supplied with our newest version, reconnecting as needed."""
        acked = -1
        while True:
            conn = None
            try:
                conn = await transport.connect(target.weights, self.ctx.options)
                while True:
                    changed = self.store.changed
                    vb = self.store.newest()
                    if vb is not None and vb.version > acked:
                        await push_version(conn, vb, timeout=self.config.transfer_timeout_s)
                        acked = vb.version
                        self.forwarded[vb.version] = self.ctx.clock.wall()
                    else:
                        await changed.wait()
            except (transport.TransportError, TransferError, TimeoutError, OSError) as exc:
                self.log.info("downstream transfer failed", target=target.instance, error=str(exc))
            finally:
                if conn is not None:
                    conn.close("forwarder restarting")
            await self.ctx.clock.sleep(self.config.retry_s)
