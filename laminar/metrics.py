"""Prometheus metrics: one registry per service (several services may share a process in tests
and in the simulator), served over HTTP at ``/metrics`` by aiohttp."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class RpcMetrics:
    """Counters every service exports about the calls it serves."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.calls = Counter(
            "laminar_rpc_calls",
            "RPC calls served",
            ["role", "method", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "laminar_rpc_latency_seconds",
            "RPC handler latency",
            ["role", "method"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
        )
        self.role = role
        # Labelled children, looked up once: ``labels()`` costs more than the observation itself,
        # and this runs on every call served (the RPC round trip is measured against a bare echo).
        self._counted: dict[tuple[str, str], Any] = {}
        self._timed: dict[str, Any] = {}

    def observe(self, method: str, outcome: str, seconds: float) -> None:
        counter = self._counted.get((method, outcome))
        if counter is None:
            counter = self._counted[method, outcome] = self.calls.labels(self.role, method, outcome)
        timer = self._timed.get(method)
        if timer is None:
            timer = self._timed[method] = self.latency.labels(self.role, method)
        counter.inc()
        timer.observe(seconds)


async def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[web.AppRunner, str]:
    """Serve ``/metrics`` (and ``/healthz``); returns the runner and the bound ``host:port``."""

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
    return runner, f"{bound[0]}:{bound[1]}"
