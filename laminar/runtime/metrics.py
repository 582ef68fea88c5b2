"""Prometheus metrics: one registry per service (several services may share a process in tests
and in the simulator), served over HTTP at ``/metrics`` (and ``/healthz``) by
:class:`MetricsServer`, prometheus_client's threaded WSGI server on a thread of its own."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


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


#: how long ``/healthz`` waits for the event loop to run a callback before it answers 503
HEALTH_WAIT_S = 2.0


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: a scrape every few seconds is not news."""


class MetricsServer:
    """``/metrics`` (the registry, Prometheus' text format) and ``/healthz`` over HTTP.

    Why a thread and not the service's event loop: the role process needs no web framework for two
    GET routes, and aiohttp's import alone is a sizeable share of the CPU every ``laminar serve``
    spends starting; prometheus_client ships this threaded server for the purpose. A scrape then
    never waits behind a long step on the loop, and reads only prometheus_client's metric objects,
    which take their own locks. ``/healthz`` still says whether the *loop* runs, not just the
    process: it asks the loop to run a callback and waits up to :data:`HEALTH_WAIT_S` (200 ``{"ok":
    true}``; else 503 with how long it waited).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._loop = loop
        self._metrics = make_wsgi_app(registry)
        host = host.strip("[]")  # "[::1]" as written in a host:port

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._httpd = make_server(host, port, self._app, Server, handler_class=_Quiet)
        self._httpd.daemon_threads = True
        host_bound, port_bound = self._httpd.server_address[:2]
        shown = host_bound.decode() if isinstance(host_bound, bytes) else host_bound
        self.address = f"{shown}:{port_bound}"
        threading.Thread(
            target=self._httpd.serve_forever, name=f"metrics {self.address}", daemon=True
        ).start()

    def _app(self, environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/healthz":
            scraped: Iterable[bytes] = self._metrics(environ, start)
            return scraped
        ok = self._loop_answers()
        silent = f"the event loop ran nothing for {HEALTH_WAIT_S} s"
        body = {"ok": True} if ok else {"ok": False, "error": silent}
        status = "200 OK" if ok else "503 Service Unavailable"
        start(status, [("Content-Type", "application/json")])
        return [json.dumps(body).encode()]

    def _loop_answers(self) -> bool:
        ran = threading.Event()
        try:
            self._loop.call_soon_threadsafe(ran.set)
        except RuntimeError:  # the loop is closed
            return False
        return ran.wait(HEALTH_WAIT_S)

    def close(self) -> None:
        """Stop serving, without blocking the caller: ``shutdown`` waits for the serving loop's
        next poll (up to half a second), so a helper thread waits for it and closes the socket."""

        def stop() -> None:
            self._httpd.shutdown()
            self._httpd.server_close()

        threading.Thread(target=stop, name=f"metrics {self.address} close", daemon=True).start()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``/metrics`` and ``/healthz`` for the running event loop's service; the server's
    ``address`` is the bound ``host:port``."""
    return MetricsServer(registry, host, port, asyncio.get_running_loop())
