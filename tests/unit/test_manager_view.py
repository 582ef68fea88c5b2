"""The admin API's views take a narrow ``ManagerView``, not the manager service, and the manager's
repack reads time from its clock.

Why: ``admin.py`` and ``cluster_view.py`` used to take the whole ``ManagerService``, read its
private ``_chain``, and import ``service.py`` (a cycle through ``admin``). Now any object with the
protocol's attributes will do, so the status assembly and the gauges are exercised here on a
hand-built view in one event loop, on virtual time, with no manager running.
"""

from __future__ import annotations

import ast
import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import structlog

import laminar.transport  # noqa: F401  (registers the schemes)
from laminar.repack import RepackPolicy
from laminar.roles.manager import ManagerConfig
from laminar.roles.manager.api import ChainView, RelayInfo
from laminar.roles.manager.cluster_view import ScrapeGauges, cluster_status
from laminar.roles.manager.events import EventLog
from laminar.roles.manager.repack import RepackController
from laminar.roles.manager.view import ManagerView
from laminar.roles.rollout.api import MigrateReport, MigrateRequest, RolloutApi
from laminar.runtime.clock import run_virtual
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import ServiceContext, transport_options
from laminar.runtime.endpoint import endpoint
from laminar.runtime.membership import Member
from laminar.runtime.service import Service, ServiceHost
from tests.support.procs import TOKEN

MANAGER = Path(__file__).resolve().parents[2] / "roles" / "manager"
CLUSTER = ClusterConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, rpc_timeout_s=2.0)
OPTIONS = transport_options(CLUSTER, TOKEN.encode())
MIGRATE_S = 2.0  # virtual seconds the source below takes to hand its trajectories over


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, under ``if TYPE_CHECKING:`` too (relative ones as .name)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def test_admin_and_cluster_view_never_import_the_service() -> None:
    for name in ("admin.py", "cluster_view.py", "view.py"):
        imported = _imports(MANAGER / name)
        assert not {".service", "laminar.roles.manager.service"} & imported, name


def _rollout(name: str, state: str, **stats: float) -> Member:
    return Member(instance=name, role="rollout", address=f"inproc://{name}", state=state,  # type: ignore[arg-type]
                  host="h", stats=stats)  # fmt: skip


BUSY = {"kv_cache_usage": 0.25, "running": 2.0, "waiting": 0.0, "in_flight": 2.0,
        "version": 7.0, "generated_tokens": 300.0, "completed": 5.0, "starved": 1.0}  # fmt: skip


@dataclass
class StandaloneView:
    """A ``ManagerView`` built by hand: real context, event log and repack controller."""

    ctx: ServiceContext
    members: dict[str, Member]
    relay_chain: ChainView
    events: EventLog = field(default_factory=EventLog)
    log: Any = field(default_factory=lambda: structlog.get_logger("test"))
    repack: RepackController = field(init=False)

    def __post_init__(self) -> None:
        self.repack = RepackController(
            RepackPolicy(enabled=False), self.events,
            lambda address: self.ctx.connect(RolloutApi, address),
            self.ctx.clock, self.ctx.registry, self.log,
        )  # fmt: skip


def _context() -> ServiceContext:
    config = ManagerConfig(bind="inproc://*", metrics=None, admin=None)
    return ServiceContext(role="manager", instance="manager", cluster=CLUSTER, config=config,
                          options=OPTIONS)  # fmt: skip


def test_status_and_gauges_from_a_view_that_is_not_the_service() -> None:
    async def main() -> None:
        relay = RelayInfo(instance="relay-0", address="inproc://relay-0", weights="inproc://w")
        view = StandaloneView(
            ctx=_context(),
            members={
                "rollout-0": _rollout("rollout-0", "alive", **BUSY),
                "rollout-1": _rollout("rollout-1", "alive"),  # no heartbeat yet
                "rollout-2": _rollout("rollout-2", "dead", **{**BUSY, "version": 6.0}),
            },
            relay_chain=ChainView(incarnation="i", epoch=3, relays=[relay]),
        )
        typed: ManagerView = view  # the protocol is all the views need
        try:
            status = await cluster_status(typed)
            gauges = {f.name: f.samples for f in ScrapeGauges(typed).collect()}
        finally:
            await view.ctx.close_clients()
        rows = {r.id: r for r in status.rollouts}
        # nobody serves the rollouts' ``state``: the heartbeats alone describe them
        assert (rows["rollout-0"].state, rows["rollout-0"].version) == ("running", 7)
        assert (rows["rollout-0"].kv_cache_usage, rows["rollout-0"].in_flight) == (0.25, 2)
        assert rows["rollout-1"].state == "unknown" and rows["rollout-1"].version is None
        assert (rows["rollout-2"].state, rows["rollout-2"].version) == ("dead", 6)
        assert status.chain.epoch == 3 and status.staleness.rollout_versions == [7]
        assert [s.value for s in gauges["laminar_admin_chain_epoch"]] == [3]
        assert [(s.labels, s.value) for s in gauges["laminar_admin_rollouts_by_version"]] == [
            ({"version": "7"}, 1)
        ]
        assert [s.value for s in gauges["laminar_admin_in_flight"]] == [2]

    run_virtual(main())


class SlowSource(Service):
    """A repack source that takes ``MIGRATE_S`` of its clock to hand one trajectory over."""

    role: ClassVar[str] = "rollout"

    @endpoint
    async def migrate(self, req: MigrateRequest) -> MigrateReport:
        await self.ctx.clock.sleep(MIGRATE_S)
        return MigrateReport(source=self.ctx.instance, destination=req.destination,
                             version=req.version, moved=["t-1"], mode="reprefill")  # fmt: skip


def test_repack_overhead_is_measured_on_the_managers_clock() -> None:
    """On virtual time the move takes exactly ``MIGRATE_S``; a wall-clock timer would see ~0."""

    async def main() -> float:
        source_ctx = ServiceContext(role="rollout", instance="rollout-a", cluster=CLUSTER,
                                    config=Service.config_model(bind="inproc://*", metrics=None),
                                    options=OPTIONS)  # fmt: skip
        host = ServiceHost(SlowSource, source_ctx)
        task = asyncio.create_task(host.run())
        await host.started()
        assert source_ctx.address is not None
        source = _rollout("rollout-a", "alive", **{**BUSY, "kv_cache_usage": 0.1})
        source.address = source_ctx.address
        view = StandaloneView(
            ctx=_context(),
            members={"rollout-a": source, "rollout-b": _rollout("rollout-b", "alive", **BUSY)},
            relay_chain=ChainView(),
        )
        try:
            for member in view.members.values():
                view.repack.observe(member)
            outcome = await view.repack.repack("operator")
        finally:
            await view.ctx.close_clients()
            host.stop()
            await task
        assert outcome.moved == 1 and outcome.released == ["rollout-a"], outcome
        return outcome.overhead_s

    assert abs(run_virtual(main()) - MIGRATE_S) < 0.05
